"""A bfloat16 / float16 checkpoint's experts kept as stored in the cache (float32 compute on the CPU).

The slots hold the file's bytes (half of float32's), the CPU kernel multiplies them as stored
(:mod:`runahead.models.qkernel`), and the tokens are still transformers' in float32 (which widens the
same weights exactly), under every policy. ``expert_slots`` chooses, and refuses what cannot apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ggufhelpers import build_tiny_gguf

from runahead.backends.torch import TorchBackend
from runahead.models import qkernel
from runahead.models.layout import kept_as_stored
from runahead.models.loader import load_model, load_reference_slot
from runahead.store.base import DTYPES

from modelhelpers import HIDDEN, build_tiny_model, compare_with_transformers, random_moe_inputs

needs_kernel = pytest.mark.skipif(not qkernel.available(), reason="no C compiler here")
WIDTH = 32  # the experts' width: whole 32-weight blocks, as the kernel needs
KINDS = {"bfloat16": "BF16", "float16": "F16"}


@pytest.fixture(scope="module", params=list(KINDS))
def half_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny Qwen3-MoE saved in bfloat16 (transformers' fused ``gate_up_proj``) or float16 (per expert)."""
    dtype = request.param
    path = build_tiny_model(
        "qwen3_moe",
        tmp_path_factory.mktemp(dtype),
        dtype=getattr(torch, dtype),
        stacked=dtype == "bfloat16",
        moe_intermediate_size=WIDTH,
    )
    return path, KINDS[dtype]


@needs_kernel
@pytest.mark.parametrize("policy", ["sync", "runahead"])
def test_half_width_experts_stay_as_stored_and_give_transformers_tokens(
    half_model: tuple[Path, str], policy: str
) -> None:
    path, kind = half_model
    backend = TorchBackend.open(str(path), cache_slots=6, dtype="float32")
    try:
        layers = backend.model.config.num_layers
        assert backend.slots.data.dtype == torch.uint8
        assert backend.slots.data.shape[1] == 3 * HIDDEN * WIDTH * 2  # two bytes a weight, not four
        assert {backend.model._stored_kind(layer) for layer in range(layers)} == {kind}
        half = DTYPES[kind]
        weights = backend.model.weights  # the projections and the LM head as stored too
        assert weights["0.q_proj"].dtype == weights["lm_head"].dtype == half
        assert weights["embed"].dtype == weights["0.input_norm"].dtype == torch.float32
    finally:
        backend.close()
    found = compare_with_transformers(path, policy=policy, slots=6)
    assert found["tokens_equal"], found
    assert found["logit_error"] < 1e-4, found


@needs_kernel
def test_experts_with_more_rows_than_the_kernel_takes_are_widened_and_agree(
    half_model: tuple[Path, str], monkeypatch: Any
) -> None:
    path, _ = half_model
    monkeypatch.setattr(qkernel, "max_rows", lambda: 1)  # every expert with 2+ rows: widened, torch's product
    found = compare_with_transformers(path, policy="sync", slots=6, chunk=4)
    assert found["tokens_equal"], found
    assert found["logit_error"] < 1e-4, found


def test_stored_slots_hold_the_files_bytes(half_model: tuple[Path, str]) -> None:
    path, kind = half_model
    _, layout = load_model(path)
    stored = kept_as_stored(layout)
    assert stored is not None and stored.stored
    assert {r.role for r in stored.ranges[1, 3]} == {"gate", "up", "down"}  # a fused gate_up split in two
    assert [p.kind for p in stored.slot_format(0).parts] == [kind] * 3
    half = DTYPES[kind]
    for layer, expert in ((0, 0), (1, 3), (2, 7)):
        widened = load_reference_slot(layout, layer, expert, dtype=half)  # the compute-dtype layout's slot
        assert torch.equal(load_reference_slot(stored, layer, expert), widened.view(torch.uint8))


@needs_kernel
def test_expert_slots_compute_widens_and_stored_names_what_it_cannot_apply_to(
    half_model: tuple[Path, str], tmp_path: Path, monkeypatch: Any
) -> None:
    path, _ = half_model
    backend = TorchBackend.open(str(path), cache_slots=4, dtype="float32", expert_slots="compute")
    try:
        assert backend.slots.data.dtype == torch.float32 and backend.model.slot_formats is None
    finally:
        backend.close()
    with pytest.raises(ValueError, match="bfloat16 on cpu"):
        TorchBackend.open(str(path), cache_slots=4, dtype="bfloat16", expert_slots="stored")
    full = build_tiny_model("qwen3_moe", tmp_path / "f32", moe_intermediate_size=WIDTH)
    with pytest.raises(ValueError, match="experts are F32"):
        TorchBackend.open(str(full), cache_slots=4, dtype="float32", expert_slots="stored")
    odd = build_tiny_model("qwen3_moe", tmp_path / "odd", dtype=torch.bfloat16)  # experts 24 wide
    with pytest.raises(ValueError, match="32-weight blocks"):
        TorchBackend.open(str(odd), cache_slots=4, dtype="float32", expert_slots="stored")
    gguf, _ = build_tiny_gguf("qwen3_moe", tmp_path / "gguf", "Q8_0")
    with pytest.raises(ValueError, match="GGUF"):
        TorchBackend.open(str(gguf), cache_slots=4, expert_slots="compute")
    with pytest.raises(ValueError, match="auto, stored or compute"):
        TorchBackend.open(str(path), cache_slots=4, expert_slots="half")  # type: ignore[arg-type]
    monkeypatch.setenv("RUNAHEAD_QUANT_KERNEL", "off")
    qkernel._library.cache_clear()
    try:  # with the kernel off, auto widens as before
        backend = TorchBackend.open(str(path), cache_slots=4, dtype="float32")
        try:
            assert backend.slots.data.dtype == torch.float32
        finally:
            backend.close()
    finally:
        monkeypatch.delenv("RUNAHEAD_QUANT_KERNEL")
        qkernel._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen3_5_moe", "gemma4"])
def test_the_papers_architectures_in_bfloat16_give_transformers_tokens(arch: str, tmp_path: Path) -> None:
    """Qwen3.6 (linear attention's projections too) and Gemma 4 (softcapped head, dense MLP beside
    the experts), saved in bfloat16: experts, projections and head kept as stored."""
    widths = {"hidden_size": 64} if arch == "gemma4" else {}
    path = build_tiny_model(arch, tmp_path, dtype=torch.bfloat16, moe_intermediate_size=WIDTH, **widths)
    backend = TorchBackend.open(str(path), cache_slots=6, dtype="float32")
    try:
        kept = {k for k, w in backend.model.weights.items() if w.dtype == torch.bfloat16}
        assert backend.slots.data.dtype == torch.uint8 and "lm_head" in kept
        if arch == "qwen3_5_moe":
            assert {"0.in_proj_qkv", "0.in_proj_z", "1.q_gate"} <= kept  # out_proj: rows of 48, kept wide
    finally:
        backend.close()
    for policy in ("sync", "runahead"):
        found = compare_with_transformers(path, policy=policy, slots=6)
        assert found["tokens_equal"], (policy, found)
        assert found["logit_error"] < 1e-4, (policy, found)


@needs_kernel
def test_auto_computes_in_float32_where_the_kernel_takes_the_experts_as_stored(
    half_model: tuple[Path, str], monkeypatch: Any
) -> None:
    """``dtype="auto"`` on CPU: float32 with the experts as stored wherever the kernel multiplies them,
    whatever the timed dtype race would say (it is rigged for bfloat16 here); with compute-dtype slots
    asked for, the race decides."""
    from runahead.backends import torch_load

    path, kind = half_model
    monkeypatch.setattr(torch_load, "resolve_dtype", lambda *_args, **_kw: torch.bfloat16)
    backend = TorchBackend.open(str(path), cache_slots=16, dtype="auto")
    try:
        assert backend.compute_dtype == "float32"
        assert {part.kind for fmt in backend.model.slot_formats.values() for part in fmt.parts} == {kind}
    finally:
        backend.close()
    backend = TorchBackend.open(str(path), cache_slots=16, dtype="auto", expert_slots="compute")
    try:
        assert backend.compute_dtype == "bfloat16" and backend.model.slot_formats is None
    finally:
        backend.close()


@needs_kernel
def test_auto_computes_a_bf16_checkpoint_in_bfloat16_where_its_rows_multiply_faster(
    half_model: tuple[Path, str], monkeypatch: Any
) -> None:
    """Where the kernel race says bfloat16 rows multiply the stored bf16 experts faster (rigged here),
    ``auto`` computes a bf16 checkpoint in bfloat16, its slots holding the file's bytes as the compute
    dtype's (no widening, no second form); a float16 checkpoint, and ``expert_slots="stored"``, stay
    float32 (the kernel takes float32 rows only there)."""
    from runahead.backends import dtypes

    path, kind = half_model
    monkeypatch.setattr(dtypes, "faster_expert_rows", lambda hidden, inter: torch.bfloat16)
    backend = TorchBackend.open(str(path), cache_slots=16, dtype="auto")
    try:
        wanted = "bfloat16" if kind == "BF16" else "float32"
        assert backend.compute_dtype == wanted
        if kind == "BF16":
            assert backend.model.slot_formats is None and backend.slots.data.dtype == torch.bfloat16
    finally:
        backend.close()
    backend = TorchBackend.open(str(path), cache_slots=16, dtype="auto", expert_slots="stored")
    try:
        assert backend.compute_dtype == "float32" and backend.model.slot_formats is not None
    finally:
        backend.close()


def test_a_float32_checkpoint_is_left_to_the_timed_dtype(tmp_path: Path, monkeypatch: Any) -> None:
    from runahead.backends import torch_load

    path = build_tiny_model("qwen3_moe", tmp_path)  # float32 experts: nothing to keep as stored
    assert not torch_load.stored_kernel_applies(str(path))
    monkeypatch.setattr(torch_load, "resolve_dtype", lambda *_args, **_kw: torch.bfloat16)
    backend = TorchBackend.open(str(path), cache_slots=16, dtype="auto")
    try:
        assert backend.compute_dtype == "bfloat16"
    finally:
        backend.close()


@needs_kernel
@pytest.mark.parametrize("policy", ["sync", "runahead"])
def test_a_float32_checkpoints_experts_run_through_the_kernel_and_give_transformers_tokens(
    tmp_path: Path, policy: str, monkeypatch: Any
) -> None:
    """float32 experts (no conversion) take the kernel's prefetched pass, one call per group, not torch's
    products expert by expert; the tokens stay transformers' float32 ones, and the per-expert torch
    path agrees with it to float32 rounding."""
    path = build_tiny_model("qwen3_moe", tmp_path / "f32", moe_intermediate_size=WIDTH)
    model, layout = load_model(path)
    assert model.slot_formats is None  # compute-dtype slots: the flat float32 gate | up | down
    f32, bf16 = torch.float32, torch.bfloat16
    assert model._kernel_layout(1, f32, f32) == (qkernel.FLOAT32, 0, 2 * WIDTH * HIDDEN * 4)
    assert model._kernel_layout(1, bf16, bf16) == ("BF16", 0, 2 * WIDTH * HIDDEN * 2)  # a bf16 compute
    assert model._kernel_layout(1, bf16, f32) is None  # rows and slots of two dtypes: torch's products
    hidden, ids, weights, experts = random_moe_inputs(model, layout, 1)
    kernel = model.moe_partial(1, hidden, ids, weights, experts)
    with monkeypatch.context() as patch:
        patch.setattr(qkernel, "multiplies", lambda kind, lengths: False)
        assert model._kernel_layout(1, f32, f32) is None
        torch_path = model.moe_partial(1, hidden, ids, weights, experts)
    assert (kernel - torch_path).abs().max().item() < 1e-5
    found = compare_with_transformers(path, policy=policy, slots=6)
    assert found["tokens_equal"], found
    assert found["logit_error"] < 1e-4, found


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_a_half_width_compute_multiplies_on_the_kernel_with_torchs_rounding(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """In a bfloat16 / float16 compute the routed experts and resident matrices take the kernel's
    half-width pass at decode's rows (rows widened exactly, sums in float32, one rounding per product,
    as torch's half-width products round): within one rounding of torch's products, and nearer the
    exact products than that, for every row, whatever the rows beside it."""
    path = build_tiny_model("qwen3_moe", tmp_path / "half", dtype=dtype, moe_intermediate_size=WIDTH)
    model, layout = load_model(path, dtype=dtype)
    assert model.slot_formats is None and model._dense_kind("1.q_proj", model.weights["1.q_proj"])
    hidden, ids, weights, experts = random_moe_inputs(model, layout, 1)
    hidden, weights = hidden.to(dtype), weights.to(dtype)
    experts = {e: slot.to(dtype) for e, slot in experts.items()}
    calls = []
    real = qkernel.grouped_product

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[3])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qkernel, "grouped_product", counted)
        kernel = model.moe_partial(1, hidden, ids, weights, experts)
        alone = torch.cat(
            [
                model.moe_partial(1, hidden[i : i + 1], ids[i : i + 1], weights[i : i + 1], experts)
                for i in range(4)
            ]
        )
    dot = dtype == torch.bfloat16 and qkernel.bf16_dot()  # bf16 rows as they are, the CPU's dot products
    assert calls and set(calls) == {qkernel.BF16_DOT if dot else qkernel.HALF_KINDS[dtype]}, calls
    assert torch.equal(kernel[:4], alone)  # a row's result is the same alone as beside others
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qkernel, "multiplies", lambda kind, lengths: False)
        model.init_products()  # forget the kinds found (the kernel "absent" now)
        torch_path = model.moe_partial(1, hidden, ids, weights, experts)
        exact = model.moe_partial(
            1, hidden.float(), ids, weights.float(), {e: s.float() for e, s in experts.items()}
        )
    eps = torch.finfo(dtype).eps
    scale = exact.abs().max().item()
    assert (kernel.float() - torch_path.float()).abs().max().item() <= 8 * eps * scale
    assert (kernel.float() - exact).abs().max().item() <= 8 * eps * scale
    x = hidden[:3]
    w = model.weights["1.q_proj"]
    ours = model.dense(x, "1.q_proj")
    assert ours.dtype == dtype and torch.equal(ours[1:2], model.dense(x[1:2], "1.q_proj"))
    assert (ours.float() - x.float() @ w.float().T).abs().max().item() <= eps * (
        x.float() @ w.float().T
    ).abs().max().item()
