"""Tiny models for the mlx backend's tests, and mlx-lm as the judge of their greedy tokens.

mlx-lm reads only the hub's spelling of a config (``num_experts``, ``rope_theta``), which
transformers 5 no longer writes; :func:`hub_spelling` adds it (the runtime reads both). Its
Mixtral ignores ``sliding_window`` and its OLMoE ``clip_qkv``, so the models built here for
comparison with mlx-lm have neither.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelhelpers import build_tiny_model

MLX_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
"""Architectures the mlx backend runs."""

MLX_OVERRIDES: dict[str, dict[str, Any]] = {
    "mixtral": {"sliding_window": None},
    "olmoe": {"clip_qkv": None},
}

QUANT_WIDTH: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"moe_intermediate_size": 32},
    "mixtral": {"intermediate_size": 32},
    "olmoe": {"intermediate_size": 32},
    "qwen2_moe": {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
}
"""Expert widths that are whole 32-weight groups, so mlx-lm quantizes every expert matrix."""

MLX_LM_PAPER: dict[str, dict[str, Any]] = {
    "qwen3_5_moe": {  # mlx-lm places full attention by the interval, not layer_types
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "full_attention_interval": 2,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    },
    "gemma4": {"hidden_size": 64, "moe_intermediate_size": 32, "tie_word_embeddings": True},
}
"""The paper's architectures mlx-lm converts, with what their tiny models need for it (as for
:data:`QUANT_WIDTH`); they are saved with stacked experts, the form mlx-lm's converter stacks."""

HUB_MODEL_TYPE = {"qwen3_5_moe_text": "qwen3_5_moe"}
"""transformers' text-only ``model_type`` -> the hub's (the only one mlx-lm knows)."""


def hub_wrap(path: str | Path) -> None:
    """Rewrite a transformers ``gemma4_text`` folder as the hub's Gemma 4 (the only one mlx-lm's
    converter reads): the config under ``text_config`` with the hub's ``global_head_dim`` /
    ``num_global_key_value_heads`` (transformers 5 writes ``per_layer_config``), the tensors under
    ``model.language_model.``."""
    from safetensors.numpy import load_file, save_file

    folder = Path(path)
    inner = json.loads((folder / "config.json").read_text())
    for layer in (inner.pop("per_layer_config", None) or {}).values():  # transformers 5's spelling
        inner["global_head_dim"] = layer["head_dim"]
        inner["num_global_key_value_heads"] = layer["num_key_value_heads"]
    keep = ("tie_word_embeddings", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    outer = {"model_type": "gemma4", "text_config": inner, **{k: inner[k] for k in keep if k in inner}}
    (folder / "config.json").write_text(json.dumps(outer, indent=2))
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    save_file({"model.language_model." + k.removeprefix("model."): v for k, v in tensors.items()}, str(file))


def hub_spelling(path: str | Path) -> None:
    """Add the hub's ``num_experts`` and ``rope_theta`` keys to a folder's config.json, and its
    ``model_type`` (for mlx-lm)."""
    file = Path(path) / "config.json"
    config = json.loads(file.read_text())
    config["model_type"] = HUB_MODEL_TYPE.get(config["model_type"], config["model_type"])
    if "num_local_experts" in config:
        config.setdefault("num_experts", config["num_local_experts"])
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    file.write_text(json.dumps(config, indent=2))


def build_mlx_model(arch: str, path: str | Path, *, quantized: bool = False, **overrides: Any) -> Path:
    """A tiny float32 ``arch`` folder mlx-lm loads; with ``quantized`` widths mlx-lm fully quantizes."""
    if arch in MLX_LM_PAPER:
        folder = build_tiny_model(arch, path, stacked=True, **{**MLX_LM_PAPER[arch], **overrides})
        hub_spelling(folder)
        if arch == "gemma4":
            hub_wrap(folder)
        return folder
    extra = {**MLX_OVERRIDES.get(arch, {}), **(QUANT_WIDTH[arch] if quantized else {}), **overrides}
    folder = build_tiny_model(arch, path, **extra)
    hub_spelling(folder)
    return folder


def convert(source: str | Path, target: str | Path, *, bits: int = 4, group_size: int = 32) -> Path:
    """``mlx_lm.convert`` of ``source`` quantized to ``bits`` with ``group_size``, into ``target``."""
    from mlx_lm import convert as mlx_convert

    mlx_convert(str(source), str(target), quantize=True, q_group_size=group_size, q_bits=bits)
    return Path(target)


def mlx_lm_greedy(path: str | Path, prompts: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """mlx-lm's own greedy continuation of each prompt (``generate_step``, argmax sampler)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(path))
    out = []
    for prompt in prompts:
        steps = generate_step(
            mx.array(list(prompt)), model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1)
        )
        out.append([int(token) for token, _ in steps])
    return out


def transformers_greedy(path: str | Path, prompts: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``tokens`` long, never stopping at EOS
    (as neither the runtime without stop tokens nor mlx-lm's ``generate_step`` does)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            full = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False
            )
            out.append(full[0, len(prompt) :].tolist())
    return out


def run_requests(
    backend: Any,
    policy: str,
    prompts: Sequence[Sequence[int]],
    tokens: int,
    *,
    slots: int,
    chunk: int = 2,
    keep: dict[int, Any] | None = None,
) -> tuple[dict[int, list[int]], Any]:
    """Greedy ``tokens`` for every prompt at once through the runtime on ``backend`` (closed after);
    with ``keep``, each request's logits (``keep_logits``) are saved into it before its state is freed.
    Checks that every pin was released. Returns the tokens and the runtime."""
    import asyncio

    from runahead.jobs import RequestSpec
    from runahead.runtime import Runtime, RuntimeConfig
    from runahead.sampling import SamplingParams

    runtime = Runtime(backend, RuntimeConfig(cache_slots=slots, policy=policy, prefill_chunk=chunk))
    specs = [
        RequestSpec(i, tokens, prompt=tuple(p), sampling=SamplingParams(max_tokens=tokens))
        for i, p in enumerate(prompts)
    ]
    if keep is not None:
        close = backend.close_request

        def keeping(request: int) -> None:
            if request in backend._requests:
                keep[request] = backend.logits_of(request)
            close(request)

        backend.close_request = keeping
    try:
        out = asyncio.run(runtime.run(specs))
    finally:
        backend.close()
    assert runtime.cache.is_idle() and runtime.cache.pinned_count() == 0
    return out, runtime
