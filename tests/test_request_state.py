"""Per-request state of the paper's models: recurrent and sliding-window layers, hub spellings.

The recurrent state of linear-attention layers (and the KV of attention layers) is created when a
request is admitted, advanced by its chunks and steps, and freed when it completes or is cancelled;
a cancelled request leaves the others' tokens unchanged. Hub checkpoints (a multimodal wrapper
config in the hub's spelling, tensors under ``model.language_model.``) load as the same model.
"""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.backends.torch import TorchBackend
from runahead.jobs import RequestSpec
from runahead.models.loader import load_model
from runahead.models.state import KVLayer, RecurrentLayer, RequestState
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams

from modelhelpers import PAPER_ARCHS, build_tiny_model, reference_logits, run_jobs

PROMPTS = [[5, 17, 42, 9, 8, 7, 6], [3, 99, 7], [120, 4, 4, 66, 8, 31], [200]]
TOKENS = 12


@pytest.fixture(scope="module", params=PAPER_ARCHS)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def expected(folder: Path) -> list[list[int]]:
    """transformers' greedy continuation of every prompt (EOS not special, as in the runtime)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    continuations = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False
            )
            continuations.append(out[0, len(prompt) :].tolist())
    return continuations


@pytest.mark.parametrize("policy", ["runahead", "sync", "prefetch-gate", "runahead/grouping=static:2:1"])
def test_cancelled_request_frees_its_state_and_the_others_are_unchanged(
    folder: Path, expected: list[list[int]], policy: str
) -> None:
    backend = TorchBackend.open(str(folder), cache_slots=8)
    runtime = Runtime(backend, RuntimeConfig(cache_slots=8, policy=policy, prefill_chunk=2))
    states: dict[int, weakref.ref[RequestState]] = {}
    kinds: dict[int, set[type]] = {}
    original_open = backend.open_request

    def tracked_open(spec: RequestSpec) -> None:
        original_open(spec)
        state = backend._requests[spec.request].cache
        states[spec.request] = weakref.ref(state)
        kinds[spec.request] = {type(layer) for layer in state.layers}

    backend.open_request = tracked_open  # type: ignore[method-assign]
    specs = [
        RequestSpec(i, TOKENS, prompt=tuple(p), sampling=SamplingParams(max_tokens=TOKENS))
        for i, p in enumerate(PROMPTS)
    ]

    async def main() -> tuple[list[list[int]], int, bool]:
        async with runtime:
            handles = runtime.submit(*specs)
            seen = 0
            async for _ in handles[1].stream():
                seen += 1
                if seen == 3:
                    open_then = 1 in backend._requests
                    handles[1].cancel()
                    break
            return [await h.result() for h in handles], seen, open_then

    try:
        results, seen, open_then = asyncio.run(main())
    finally:
        backend.close()
    assert open_then and seen == 3
    assert len(results[1]) < TOKENS
    for request in (0, 2, 3):
        assert results[request] == expected[request]
    assert results[1] == expected[1][: len(results[1])]
    assert not backend._requests
    gc.collect()
    assert all(ref() is None for ref in states.values())  # nothing holds a request's state any more
    assert kinds[1] == ({RecurrentLayer, KVLayer} if "qwen3_5_moe" in folder.name else {KVLayer})
    assert runtime.cache.is_idle()


def test_recurrent_state_is_fixed_size_and_kv_grows(folder: Path) -> None:
    model, layout = load_model(folder)
    if "linear_attention" not in model.config.layer_types:
        pytest.skip("no linear-attention layers in this architecture")
    state = model.new_cache(capacity=4)
    run_jobs(model, layout, [(state, PROMPTS[0])])
    first = [layer.recurrent.clone() for layer in state.layers if isinstance(layer, RecurrentLayer)]
    size = state.nbytes()
    run_jobs(model, layout, [(state, [11] * 6)])
    assert state.lengths == [len(PROMPTS[0]) + 6] * model.config.num_layers
    assert state.nbytes() > size  # the KV of the full-attention layer grew; recurrent states did not
    recurrent = [layer for layer in state.layers if isinstance(layer, RecurrentLayer)]
    assert recurrent and all(r.recurrent.shape == f.shape for r, f in zip(recurrent, first, strict=True))
    assert not any(torch.equal(r.recurrent, f) for r, f in zip(recurrent, first, strict=True))


def _hub_spelling(folder: Path, out: Path, arch: str) -> Path:
    """Rewrite a transformers-saved folder as the hub publishes the model: a multimodal wrapper."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    config = json.loads((folder / "config.json").read_text())
    text: dict[str, Any] = {
        k: v for k, v in config.items() if k not in ("architectures", "tie_word_embeddings")
    }
    if arch == "qwen3_5_moe":
        params = text.pop("rope_parameters")
        text["rope_theta"] = params["rope_theta"]
        text["partial_rotary_factor"] = params["partial_rotary_factor"]
        text["rope_scaling"] = {"rope_type": "mrope", "mrope_section": [1, 1, 2], "mrope_interleaved": True}
        kinds = text.pop("layer_types")
        interval = kinds.index("full_attention") + 1
        if kinds != [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(kinds))
        ]:
            text["layer_types"] = kinds  # not a regular pattern: keep the list
        else:
            text["full_attention_interval"] = interval
    if arch == "gemma4":  # the hub's keys for the global layers' heads instead of per_layer_config
        (override, *_) = text.pop("per_layer_config").values()
        text["global_head_dim"] = override["head_dim"]
        text["num_global_key_value_heads"] = override["num_key_value_heads"]
        text["hidden_act"] = "gelu_pytorch_tanh"
    if arch == "gpt_oss":  # no wrapper on the hub, but the older keys
        text["rope_scaling"] = text.pop("rope_parameters")
        text["experts_per_token"] = text.pop("num_experts_per_tok")
        (out / "config.json").write_text(
            json.dumps({**text, "tie_word_embeddings": config["tie_word_embeddings"]})
        )
        (out / "model.safetensors").symlink_to(folder / "model.safetensors")
        return out
    wrapper = {
        "architectures": [
            {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}.get(arch, "Gemma4ForConditionalGeneration")
        ],
        "model_type": arch,
        "tie_word_embeddings": config["tie_word_embeddings"],
        "text_config": text,
        "vision_config": {"depth": 2, "hidden_size": 16},
    }
    (out / "config.json").write_text(json.dumps(wrapper))
    tensors = load_file(folder / "model.safetensors")
    renamed = {
        (name if name.startswith("lm_head") else "model.language_model." + name[len("model.") :]): t
        for name, t in tensors.items()
    }
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(48, 16)  # a vision tower, not read
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_hub_wrapper_config_and_names_load_the_same_model(folder: Path, tmp_path: Path) -> None:
    arch = json.loads((folder / "config.json").read_text())["model_type"].removesuffix("_text")
    hub = _hub_spelling(folder, tmp_path / "hub", arch)
    plain, plain_layout = load_model(folder)
    wrapped, wrapped_layout = load_model(hub)
    assert wrapped.config == plain.config
    assert wrapped.weights.keys() == plain.weights.keys()
    for key, weight in plain.weights.items():
        assert torch.equal(wrapped.weights[key], weight), key
    assert wrapped_layout.ranges.keys() == plain_layout.ranges.keys()
    prompt = PROMPTS[0]
    ours = run_jobs(wrapped, wrapped_layout, [(wrapped.new_cache(), prompt)])[0]
    assert (ours - reference_logits(folder, prompt)).abs().max().item() < 1e-4


def test_sliding_window_keeps_only_what_later_queries_see(tmp_path: Path) -> None:
    path = build_tiny_model("mixtral", tmp_path / "m")  # sliding_window 6 on every layer
    model, layout = load_model(path)
    tokens = [(7 * i + 3) % 250 for i in range(30)]
    state = model.new_cache(capacity=2)
    logits = torch.cat([run_jobs(model, layout, [(state, [t])])[0] for t in tokens])
    assert (logits - reference_logits(path, tokens)).abs().max().item() < 1e-4
    for layer in state.layers:
        assert isinstance(layer, KVLayer) and layer.length == 30
        assert layer.stored <= 2 * 6 and layer.first >= 30 - 2 * 6  # bounded by the window, not the length


def _rewrite(folder: Path, out: Path, change: Any) -> Path:
    """A copy of ``folder`` whose tensors ``change(tensors)`` edits in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_mxfp4_experts_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    from runahead.models.base import ModelLoadError

    folder = build_tiny_model("gpt_oss", tmp_path / "m")
    name = "model.layers.0.mlp.experts.gate_up_proj"

    def quantize(tensors: dict[str, torch.Tensor]) -> None:  # the hub's layout: 16 bytes per 32 weights
        experts, hidden, width = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.zeros(experts, width, hidden // 32 + 1, 16, dtype=torch.uint8)
        tensors[name + "_scales"] = torch.zeros(experts, width, hidden // 32 + 1, dtype=torch.uint8)

    path = _rewrite(folder, tmp_path / "mxfp4", quantize)
    with pytest.raises(
        ModelLoadError, match=f"tensor {name}_blocks: MXFP4-quantized experts are not supported"
    ):
        load_model(path)


@pytest.mark.parametrize(
    ("arch", "name"),
    [
        ("gpt_oss", "model.layers.2.mlp.experts.down_proj_bias"),
        ("gemma4", "model.layers.1.experts.gate_up_proj"),
        ("qwen3_5_moe", "model.layers.2.linear_attn.conv1d.weight"),
    ],
)
def test_wrong_shaped_tensor_is_named(arch: str, name: str, tmp_path: Path) -> None:
    from runahead.models.base import ModelLoadError

    folder = build_tiny_model(arch, tmp_path / "m")

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][..., :-1].clone()

    path = _rewrite(folder, tmp_path / "bad", shrink)
    with pytest.raises(ModelLoadError, match=f"tensor {name}: expected shape"):
        load_model(path)
