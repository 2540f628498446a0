"""The job-split models against transformers' own forward, the loader's formats, and its errors."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.models import ARCHITECTURES, get_architecture, qkernel
from runahead.models.base import DENSE_ROLES, ModelLoadError, MoEModel
from runahead.models.layout import ExpertLayout
from runahead.models.loader import checkpoint_layout, load_model, load_reference_slot, load_tokenizer
from runahead.models.routing import ExpertRows

from modelhelpers import (
    ARCHS,
    EXPERTS,
    HF_MODEL_TYPE,
    build_tiny_model,
    reference_logits,
    run_jobs,
    slots_for,
)

PROMPT = [5, 17, 33, 2, 100, 7, 9, 250, 3, 44]
TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny per-expert model folder per architecture, built once."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def references(folders: dict[str, Path]) -> dict[str, torch.Tensor]:
    """transformers' logits of ``PROMPT`` for each architecture."""
    return {arch: reference_logits(path, PROMPT) for arch, path in folders.items()}


def _decode(model: MoEModel, layout: ExpertLayout, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(capacity=2)  # small, so the cache grows on the way
    return torch.cat([run_jobs(model, layout, [(cache, [t])])[0] for t in tokens])


@pytest.mark.parametrize("arch", ARCHS)
def test_token_by_token_matches_transformers(
    arch: str, folders: dict[str, Path], references: dict[str, torch.Tensor]
) -> None:
    model, layout = load_model(folders[arch])
    assert type(model).model_type == arch
    logits = _decode(model, layout, PROMPT)
    assert (logits - references[arch]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_matches_transformers(
    arch: str, folders: dict[str, Path], references: dict[str, torch.Tensor]
) -> None:
    model, layout = load_model(folders[arch])
    cache = model.new_cache()
    prefill = run_jobs(model, layout, [(cache, PROMPT[:7])])[0]
    decoded = [run_jobs(model, layout, [(cache, [t])])[0] for t in PROMPT[7:]]
    logits = torch.cat([prefill, *decoded])
    assert cache.length == len(PROMPT)
    assert (logits - references[arch]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_varies_so_the_comparison_means_something(arch: str, folders: dict[str, Path]) -> None:
    model, _ = load_model(folders[arch])
    cache = model.new_cache()
    hidden = model.attention(0, model.embed(torch.tensor(PROMPT)), [(cache, 0, len(PROMPT))])
    ids, weights = model.route(0, hidden)
    assert ids.shape == weights.shape == (len(PROMPT), 2)
    assert len(torch.unique(ids)) >= EXPERTS // 2
    if model.config.norm_topk_prob and arch != "gemma4":  # gemma4 scales the renormalised weights per expert
        assert torch.allclose(weights.sum(-1), torch.ones(len(PROMPT)))


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen2_moe", {"tie_word_embeddings": True}),
        ("qwen3_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}),
    ],
    ids=["tied-embeddings", "linear-rope"],
)
def test_config_variants_match_transformers(arch: str, overrides: dict[str, object], tmp_path: Path) -> None:
    path = build_tiny_model(arch, tmp_path / "m", **overrides)
    model, layout = load_model(path)
    logits = _decode(model, layout, PROMPT[:6])
    assert (logits - reference_logits(path, PROMPT[:6])).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_two_requests_in_one_batch_match_separate_runs(arch: str, folders: dict[str, Path]) -> None:
    model, layout = load_model(folders[arch])
    first, second = PROMPT[:5], PROMPT[5:8]
    alone_a, alone_b = model.new_cache(), model.new_cache()
    run_jobs(model, layout, [(alone_a, first)])
    run_jobs(model, layout, [(alone_b, second)])
    expected_a = run_jobs(model, layout, [(alone_a, [PROMPT[8]])])[0]  # decode at position 5
    expected_b = run_jobs(model, layout, [(alone_b, PROMPT[8:])])[0]  # prefill at positions 3..4
    batch_a, batch_b = model.new_cache(), model.new_cache()
    run_jobs(model, layout, [(batch_a, first), (batch_b, second)])
    got_a, got_b = run_jobs(model, layout, [(batch_a, [PROMPT[8]]), (batch_b, PROMPT[8:])])
    # Batched products round differently; the delta rule's recurrence carries that noise further
    # (~3e-5 on logits of size ~3). A request reading another's state would be off by far more.
    atol = 1e-4 if arch == "qwen3_5_moe" else 1e-5
    torch.testing.assert_close(got_a, expected_a, atol=atol, rtol=0)
    torch.testing.assert_close(got_b, expected_b, atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_per_expert_stacked_and_sharded_files_load_identically(
    arch: str, tmp_path: Path, folders: dict[str, Path]
) -> None:
    plain = load_model(folders[arch])
    stacked = load_model(build_tiny_model(arch, tmp_path / "stacked", stacked=True))
    sharded = load_model(build_tiny_model(arch, tmp_path / "sharded", sharded=True))
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert {r.role for r in stacked[1].ranges[0, 3]} == {"gate_up", "down"}
    assert {r.role for r in plain[1].ranges[0, 3]} == {"gate", "up", "down"}
    for model, layout in (stacked, sharded):
        assert model.weights.keys() == plain[0].weights.keys()
        for key, weight in plain[0].weights.items():
            assert torch.equal(model.weights[key], weight), key
        for layer, expert in plain[1].ranges:
            expected = load_reference_slot(plain[1], layer, expert)
            assert torch.equal(load_reference_slot(layout, layer, expert), expected)
        assert torch.equal(_decode(model, layout, PROMPT[:4]), _decode(*plain, PROMPT[:4]))


def test_bf16_files_widen_to_float32_and_match_transformers(tmp_path: Path) -> None:
    path = build_tiny_model("qwen3_moe", tmp_path / "bf16", dtype=torch.bfloat16, stacked=True)
    model, layout = load_model(path)
    assert {r.dtype for ranges in layout.ranges.values() for r in ranges} == {"BF16"}
    assert model.weights["embed"].dtype == torch.float32
    assert load_reference_slot(layout, 1, 5).dtype == torch.float32
    logits = _decode(model, layout, PROMPT)
    assert (logits - reference_logits(path, PROMPT)).abs().max().item() < TOLERANCE


@pytest.mark.skipif(not qkernel.available(), reason="no C compiler here")
def test_dense_as_stored_keeps_the_files_half_width_matrices_and_widens_the_rest(tmp_path: Path) -> None:
    """The projections, routers and LM head load as the file stores them (bfloat16, never widened),
    the rest in float32; the layout equals the one read from the headers alone."""
    from safetensors.torch import load_file

    path = build_tiny_model(
        "qwen3_moe",
        tmp_path / "bf16",
        dtype=torch.bfloat16,
        moe_intermediate_size=32,
        tie_word_embeddings=False,
    )
    model, layout = load_model(path, dense_as_stored=True)
    assert layout == checkpoint_layout(path)
    stored = load_file(str(path / "model.safetensors"))
    names = type(model).weight_names(model.config)
    half = {key for key in model.weights if key.rpartition(".")[2] in DENSE_ROLES}
    assert {"lm_head", "0.q_proj", "0.router"} <= half
    for key, w in model.weights.items():
        assert w.dtype == (torch.bfloat16 if key in half else torch.float32), key
        if key in half:
            assert torch.equal(w, stored[next(name for name in names[key] if name in stored)])
    widened, _ = load_model(path)
    assert all(w.dtype == torch.float32 for w in widened.weights.values())
    logits = _decode(model, layout, PROMPT)  # the kernel multiplies the half-width matrices
    assert (logits - reference_logits(path, PROMPT)).abs().max().item() < TOLERANCE


def test_layout_ranges_are_the_tensors_bytes(folders: dict[str, Path]) -> None:
    from safetensors import safe_open

    _, layout = load_model(folders["mixtral"])
    assert (layout.num_layers, layout.num_experts, layout.hidden_size) == (3, EXPERTS, 64)
    slot = load_reference_slot(layout, 2, 6)
    with safe_open(str(folders["mixtral"] / "model.safetensors"), framework="pt") as f:
        prefix = "model.layers.2.block_sparse_moe.experts.6."
        parts = [f.get_tensor(prefix + name + ".weight").flatten() for name in ("w1", "w3", "w2")]
    assert torch.equal(slot, torch.cat(parts))


def test_moe_needs_a_slot_for_every_routed_expert(folders: dict[str, Path]) -> None:
    model, layout = load_model(folders["qwen3_moe"])
    hidden = model.attention(0, model.embed(torch.tensor([5, 6])), [(model.new_cache(), 0, 2)])
    ids, weights = model.route(0, hidden)
    slots = slots_for(layout, 0, ids)
    missing = int(ids[0, 0])
    del slots[missing]
    with pytest.raises(KeyError, match=f"expert {missing} is routed to but has no slot"):
        model.moe(0, hidden, ids, weights, slots)


def test_the_moe_reads_the_routing_or_the_ids_and_refuses_neither(folders: dict[str, Path]) -> None:
    """A backend holding the routing on the host passes it and no ids (the torch backend does): the
    same sum to the bit as from the ids; with neither, a clear error."""
    model, layout = load_model(folders["qwen3_moe"])
    hidden = model.attention(0, model.embed(torch.tensor([5, 6, 7])), [(model.new_cache(), 0, 3)])
    ids, weights = model.route(0, hidden)
    slots = slots_for(layout, 0, ids)
    routing = ExpertRows.from_ids(ids, slots)
    from_ids = model.moe_partial(0, hidden, ids, weights, slots)
    assert torch.equal(model.moe_partial(0, hidden, None, weights, slots, routing=routing), from_ids)
    assert from_ids.abs().sum().item() > 0
    with pytest.raises(ValueError, match="needs the routing or the expert ids"):
        model.moe_partial(0, hidden, None, weights, slots)


def test_attention_refuses_a_segment_that_skips_positions(folders: dict[str, Path]) -> None:
    model, _ = load_model(folders["olmoe"])
    with pytest.raises(ValueError, match="starts at position 3 but its cache holds 0"):
        model.attention(0, model.embed(torch.tensor([5])), [(model.new_cache(), 3, 1)])


def test_tokenizer_loads_offline(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(folders["qwen2_moe"])
    assert tokenizer("w2 w40")["input_ids"] == [5, 43]
    assert tokenizer.eos_token_id == 2


# --- errors ----------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_unsupported_model_type_names_the_supported_ones(tmp_path: Path, folders: dict[str, Path]) -> None:
    path = _copy(folders["qwen3_moe"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    supported = ", ".join(sorted(ARCHITECTURES))
    with pytest.raises(
        ModelLoadError, match=re.escape(f"unsupported model_type 'llama'; supported: {supported}")
    ):
        load_model(path)


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = build_tiny_model("olmoe", tmp_path / "m", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=re.escape(f"missing shard {shard.name}")):
        load_model(path)


def test_truncated_data_names_file_and_tensor(tmp_path: Path, folders: dict[str, Path]) -> None:
    path = _copy(folders["qwen3_moe"], tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    weights.write_bytes(data[:-10])
    with pytest.raises(
        ModelLoadError, match=re.escape(f"model.safetensors: truncated: tensor {last} ends at byte")
    ):
        load_model(path)


def test_truncated_header_is_named(tmp_path: Path, folders: dict[str, Path]) -> None:
    path = _copy(folders["qwen3_moe"], tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated header"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path: Path, folders: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(folders["qwen2_moe"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.shared_expert.up_proj.weight"
    tensors[name] = torch.zeros(39, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    expected = f"tensor {name}: expected shape [40, 64], found [39, 64]"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        load_model(path)


def test_missing_tensor_is_named(tmp_path: Path, folders: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(folders["mixtral"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.2.block_sparse_moe.experts.7.w2.weight"
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=re.escape(f"missing tensor {name}")):
        load_model(path)


def test_registry_covers_every_architecture() -> None:
    assert set(ARCHITECTURES) == set(ARCHS) | set(HF_MODEL_TYPE.values())
    for arch in ARCHS:
        assert get_architecture(arch).model_type == arch
    for ours, theirs in HF_MODEL_TYPE.items():  # transformers' text-only spelling of the same model
        assert get_architecture(theirs) is get_architecture(ours)


def test_imports_stay_light() -> None:
    code = (
        "import sys; sys.modules['torch'] = None;"  # a torch-less interpreter
        "from runahead.models.layout import ExpertLayout; import runahead.models;"
        "from runahead.models.description import ModelDescription, MoEConfig;"
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    code = (
        "import sys, runahead.models.loader as m; m.get_architecture('mixtral');"
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attention_in_fewer_calls_equals_the_separate_calls_bit_for_bit(
    arch: str, dtype: torch.dtype, folders: dict[str, Path]
) -> None:
    """One product for q, k and v, one norm and one rotation for both halves, cos/sin from the table:
    the same values as three products, two norms, two rotations and cos/sin computed per call, for
    prompt rows, decode rows, two requests in one batch, and more rows than the kernel takes (then
    three products again), in float32 and in a bfloat16 compute (the kernel's half-width pass)."""
    from runahead.models.ops import rope_tables

    fused, _ = load_model(folders[arch], dtype=dtype)
    separate, _ = load_model(folders[arch], dtype=dtype)
    kind = qkernel.FLOAT32 if dtype == torch.float32 else qkernel.HALF_KINDS[dtype]
    on_kernel = qkernel.multiplies(kind, (fused.config.hidden_size,))
    assert bool(fused._qkv) == ("0.qkv" in fused.derived) == on_kernel  # torch's GEMM: three products
    assert "0.qkv" not in fused.weights
    noise = torch.Generator().manual_seed(1)  # the tiny models' norms are all ones: tell q's from k's
    for key in [k for k in fused.weights if k.endswith(("q_norm", "k_norm", "input_norm"))]:
        shift = (torch.rand(fused.weights[key].shape, generator=noise) * 0.6 - 0.3).to(dtype)
        for model in (fused, separate):
            model.weights[key] = model.weights[key] + shift
    for layer in range(fused.config.num_layers):
        fused._fuse_qkv(layer)  # its one q/k norm weight from the shifted ones
    separate._qkv.clear()  # project_qkv's three products and two norms

    def per_call(layer: int, segments: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in segments])
        return rope_tables(positions, separate.rope_frequencies(layer), separate.rope_attention_factor, dtype)

    separate.rope_rows = per_call  # type: ignore[method-assign]
    torch.manual_seed(0)
    width = fused.config.hidden_size
    states = {model: (model.new_cache(16), model.new_cache(16)) for model in (fused, separate)}
    many = qkernel.max_rows() + 1  # prompt chunks too long for the kernel: three products in both
    for first, second in [((0, 3), (0, 2)), ((3, 1), (2, 1)), ((4, 2), (3, 1)), ((6, many), (4, 1))]:
        rows = torch.randn(first[1] + second[1], width).to(dtype)
        for layer in range(fused.config.num_layers):
            outs = []
            for model in (fused, separate):
                a, b = states[model]
                outs.append(model.attention(layer, rows, [(a, *first), (b, *second)]))
            assert torch.equal(outs[0], outs[1]), (layer, first, second)


def test_rope_rows_grow_the_table_and_give_the_per_call_values(folders: dict[str, Path]) -> None:
    """cos/sin read from the table equal :func:`rope_tables` computed for those positions, also past
    the first table's 256 positions (the table doubles) and for several segments in one batch."""
    from runahead.models.ops import rope_tables

    model, _ = load_model(folders["qwen3_moe"])
    state = model.new_cache(4)
    for segments in ([(state, 3, 2)], [(state, 300, 1), (state, 7, 3)], [(state, 1000, 4)]):
        cos, sin = model.rope_rows(0, segments, torch.float32)
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in segments])
        frequencies, factor = model.rope_frequencies(0), model.rope_attention_factor
        expected = rope_tables(positions, frequencies, factor, torch.float32)
        assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    ((_, cos_table, _),) = model._rope.values()
    assert cos_table.shape[0] == 1024  # 256, then 512 for position 300, then 1024 for 1003
