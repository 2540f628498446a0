"""The CPU kernel that multiplies rows by Q4_0 / Q8_0 / BF16 / F16 matrices as stored
(runahead.models.qkernel).

Judged against float64 products with the ``gguf`` package's dequantized weights; and, inside a tiny
GGUF model, against the dequantize-then-matmul path it replaces (tests/test_gguf.py checks the
model's tokens and logits against transformers through it). And that path's dequantizer
(runahead.models.quant), bit for bit against the gguf package's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from ggufhelpers import build_tiny_gguf

from runahead.models import qkernel
from runahead.models.loader import load_model
from runahead.models.quant import dequantize
from runahead.models.routing import ExpertRows

from modelhelpers import random_moe_inputs

needs_kernel = pytest.mark.skipif(not qkernel.available(), reason="no C compiler here")
BUILDS = [None, "portable", *(["avx2"] if qkernel.bf16_dot() else [])]
"""The build chosen for this CPU (AVX2 where it runs, AVX-512 BF16 where that does), the portable C one
(what arm64 runs), and the AVX2 one where the AVX-512 one was chosen."""
needs_bf16_dot = pytest.mark.skipif(not qkernel.bf16_dot(), reason="no AVX-512 BF16 on this CPU")


HALF = {"BF16": torch.bfloat16, "F16": torch.float16}


def _matrix(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``[n, k]`` matrix as ``kind`` bytes, and those bytes dequantized by the gguf package
    (a half-width one: widened by torch, which is exact).

    Row scales span fp16's range from subnormal to large, so every kind of block scale is read (and
    every kind of half-width number: subnormal float16 rows, large bfloat16 ones).
    """
    rng = np.random.default_rng(seed)
    scales = np.exp(4 * rng.standard_normal((n, 1))).astype(np.float32)
    scales[0] = 1e-6  # a subnormal fp16 block scale
    matrix = rng.standard_normal((n, k), dtype=np.float32) * scales
    if kind == "F32":
        full = torch.from_numpy(matrix)
        return full.view(torch.uint8).reshape(-1).clone(), full
    if kind in HALF:
        half = torch.from_numpy(np.minimum(np.abs(matrix), 6e4) * np.sign(matrix)).to(HALF[kind])
        return half.view(torch.uint8).reshape(-1).clone(), half.float()
    data = quants.quantize(matrix, GGMLQuantizationType[kind])
    weights = quants.dequantize(data, GGMLQuantizationType[kind])
    return torch.from_numpy(data.reshape(-1).copy()), torch.from_numpy(weights)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_dequantize_equals_the_gguf_packages_dequantizer_bit_for_bit(kind: str) -> None:
    rng = np.random.default_rng(1)
    scales = np.exp(3 * rng.standard_normal((64, 1))).astype(np.float32)  # tiny to large fp16 scales
    ggml = GGMLQuantizationType[kind]
    data = quants.quantize(rng.standard_normal((64, 256), dtype=np.float32) * scales, ggml)
    got = dequantize(torch.from_numpy(data.reshape(-1).copy()), kind, (64, 256))
    assert np.array_equal(got.numpy(), quants.dequantize(data, ggml))


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "BF16", "F16", "F32"])
def test_grouped_product_equals_the_dequantized_product(kind: str, threads: int, build: str | None) -> None:
    n, k = 46, 96  # outputs not whole 32-output units nor whole passes of 4; 3 blocks per row
    spans = [(0, 1), (1, 12), (12, 16)]  # 11 rows: more than the kernel's 8 at once
    mats = [_matrix(kind, n, k, seed) for seed in range(len(spans))]
    x = torch.randn(16, k)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = qkernel.grouped_product(x, [m.data_ptr() for m, _ in mats], spans, kind, n, build=build)
        alone = qkernel.grouped_product(x[5:6], [mats[1][0].data_ptr()], [(0, 1)], kind, n, build=build)
    finally:
        torch.set_num_threads(previous)
    for (start, stop), (_, weights) in zip(spans, mats, strict=True):
        want = x[start:stop].double() @ weights.double().T
        scale = x[start:stop].double().abs() @ weights.double().abs().T  # float32 rounding grows with it
        assert ((y[start:stop].double() - want).abs() <= 4e-6 * scale).all()
    assert torch.equal(alone[0], y[5])  # a row's result does not depend on the rows beside it
    for rows in range(1, 10):  # nor on how many rows share its pass (1-2 rows run 4 outputs at once, ...)
        rest = x[5 : 5 + rows]
        some = qkernel.grouped_product(rest, [mats[1][0].data_ptr()], [(0, rows)], kind, n, build=build)
        assert torch.equal(some[0], y[5])


@needs_bf16_dot
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_times_a_bf16_matrix_with_the_cpus_dot_products(threads: int) -> None:
    """:data:`qkernel.BF16_DOT`: bfloat16 rows as they are, each pair's product exact and the sums in
    float32: within float32 rounding of the exact products (as the widened rows' pass), and a row's
    result the same alone, beside others and in any pass size; the other builds refuse it."""
    n, k = 70, 96
    spans = [(0, 1), (1, 12), (12, 16)]
    mats = [torch.from_numpy(_matrix("BF16", n, k, seed)[1].numpy()).to(torch.bfloat16) for seed in range(3)]
    x = torch.randn(16, k).to(torch.bfloat16)
    pointers = [m.data_ptr() for m in mats]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = qkernel.grouped_product(x, pointers, spans, qkernel.BF16_DOT, n)
        widened = qkernel.grouped_product(x.float(), pointers, spans, "BF16", n)
        alone = [
            qkernel.grouped_product(x[i : i + 1], [pointers[1]], [(0, 1)], qkernel.BF16_DOT, n)
            for i in (5, 6)
        ]
    finally:
        torch.set_num_threads(previous)
    for (start, stop), matrix in zip(spans, mats, strict=True):
        want = x[start:stop].double() @ matrix.double().T
        scale = x[start:stop].double().abs() @ matrix.double().abs().T
        assert ((y[start:stop].double() - want).abs() <= 4e-6 * scale).all()
        assert ((widened[start:stop].double() - want).abs() <= 4e-6 * scale).all()
    assert torch.equal(alone[0][0], y[5]) and torch.equal(alone[1][0], y[6])
    for rows in range(1, 10):
        some = qkernel.grouped_product(x[5 : 5 + rows], [pointers[1]], [(0, rows)], qkernel.BF16_DOT, n)
        assert torch.equal(some[0], y[5])
    assert qkernel.multiplies(qkernel.BF16_DOT, (k,))
    with pytest.raises(ValueError, match="bfloat16"):
        qkernel.grouped_product(x.float(), pointers, spans, qkernel.BF16_DOT, n)
    with pytest.raises(ValueError, match="no bf16 dot products"):
        qkernel.grouped_product(x, pointers, spans, qkernel.BF16_DOT, n, build="avx2")


@needs_kernel
def test_rows_outside_every_span_are_zero_and_bad_arguments_are_refused() -> None:
    data, weights = _matrix("Q4_0", 32, 64, 0)
    x = torch.randn(5, 64)
    y = qkernel.grouped_product(x, [data.data_ptr()], [(1, 3)], "Q4_0", 32)
    assert torch.equal(y[[0, 3, 4]], torch.zeros(3, 32))
    assert torch.allclose(y[1:3], x[1:3] @ weights.T, atol=1e-4)
    with pytest.raises(ValueError, match="MXFP4"):
        qkernel.grouped_product(x, [data.data_ptr()], [(0, 5)], "MXFP4", 32)
    with pytest.raises(ValueError, match="float32"):
        qkernel.grouped_product(x.double(), [data.data_ptr()], [(0, 5)], "Q4_0", 32)
    with pytest.raises(ValueError, match="rows of 48"):
        qkernel.grouped_product(torch.randn(5, 48), [data.data_ptr()], [(0, 5)], "Q4_0", 32)


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_the_moe_runs_stored_slots_without_a_dequantized_copy(
    tmp_path: Path, kind: str, monkeypatch: Any
) -> None:
    path, _ = build_tiny_gguf("qwen3_moe", tmp_path, kind)
    model, layout = load_model(path)
    hidden, ids, weights, experts = random_moe_inputs(model, layout, 1)
    routing = ExpertRows.from_ids(ids, experts)
    out = model.moe_partial(1, hidden, ids, weights, experts, routing=routing)
    assert model._stored_kinds[1] == kind and not model._scratch  # no float32 copy of an expert was made
    counts = sorted(stop - start for _, start, stop in routing.spans)
    assert counts[0] < counts[-1]
    monkeypatch.setattr(
        qkernel, "max_rows", lambda: counts[len(counts) // 2]
    )  # the busier experts dequantized
    mixed = model.moe_partial(1, hidden, ids, weights, experts, routing=routing)
    assert model._scratch and (out - mixed).abs().max().item() < 1e-5
    model._stored_kinds[1] = None  # the dequantizing path
    dequantized = model.moe_partial(1, hidden, ids, weights, experts, routing=routing)
    assert model._scratch and (out - dequantized).abs().max().item() < 1e-5


@needs_kernel
def test_the_portable_build_can_be_chosen(monkeypatch: Any) -> None:
    monkeypatch.setenv("RUNAHEAD_QUANT_KERNEL", "portable")
    qkernel._library.cache_clear()
    try:
        assert qkernel.variant() == "portable"
    finally:
        monkeypatch.delenv("RUNAHEAD_QUANT_KERNEL")
        qkernel._library.cache_clear()
    with pytest.raises(ValueError, match="not 'neon'"):
        qkernel.load("neon")


@needs_kernel
@pytest.mark.parametrize("mode", ["on", "avx2"])
def test_the_build_follows_the_cpus_features_and_the_setting(mode: str, monkeypatch: Any) -> None:
    """``on`` takes the AVX-512 BF16 build where the CPU has its features (else AVX2, else portable);
    ``avx2`` never the AVX-512 one. The CPU's features are made up here, so every branch is taken
    whatever this machine has (each build still compiles here: the compiler targets, not the CPU)."""
    monkeypatch.setenv("RUNAHEAD_QUANT_KERNEL", mode)
    chosen = {}
    for flags in (
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
        {"avx2", "fma", "f16c"},
        set(),
    ):
        monkeypatch.setattr(
            qkernel.native, "cpu_lacks", lambda wanted, flags=flags: None if wanted <= flags else "lacks"
        )
        monkeypatch.setattr(qkernel, "load", lambda name: type("Build", (), {"variant": name})())
        qkernel._library.cache_clear()
        chosen[len(flags)] = qkernel.variant()
    qkernel._library.cache_clear()
    best = "avx512bf16" if mode == "on" else "avx2"
    assert chosen == {7: best, 3: "avx2", 0: "portable"}


def test_the_kernel_can_be_switched_off(monkeypatch: Any) -> None:
    monkeypatch.setenv("RUNAHEAD_QUANT_KERNEL", "off")
    qkernel._library.cache_clear()
    try:
        assert not qkernel.available() and qkernel.variant() is None
        with pytest.raises(RuntimeError, match="not available"):
            qkernel.grouped_product(torch.zeros(1, 32), [0], [(0, 1)], "Q4_0", 32)
    finally:
        monkeypatch.delenv("RUNAHEAD_QUANT_KERNEL")
        qkernel._library.cache_clear()


@needs_kernel
def test_auto_dtype_computes_a_gguf_in_float32_where_the_kernel_runs(tmp_path: Path) -> None:
    from runahead.backends.torch import TorchBackend

    path, _ = build_tiny_gguf("qwen3_moe", tmp_path, "Q4_0")
    backend = TorchBackend.open(str(path), cache_slots=4, dtype="auto")
    try:
        assert backend.compute_dtype == "float32"
    finally:
        backend.close()


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
def test_a_product_big_enough_for_helper_threads_gives_the_one_thread_result(build: str | None) -> None:
    """Helpers start only per 4 MB of weights read (small products stay on the caller's thread): a
    6 MB bf16 matrix split over two threads gives the one-thread result bit for bit."""
    weights = torch.randn(3072, 1024).to(torch.bfloat16)
    x = torch.randn(3, 1024)
    data = weights.view(torch.uint8).reshape(-1)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(qkernel.grouped_product(x, [data.data_ptr()], [(0, 3)], "BF16", 3072, build=build))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1])
    want = x.double() @ weights.double().T
    assert ((results[1].double() - want).abs() <= 4e-6 * (x.double().abs() @ weights.double().abs().T)).all()
