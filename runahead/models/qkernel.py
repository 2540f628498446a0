"""Q4_0 / Q8_0 / BF16 / F16 expert products on the CPU without dequantizing, and float32 ones in one call
per group: a small C kernel, built on first use.

The torch CPU path otherwise turns each stored expert into float32 (:mod:`runahead.models.quant`)
each time a group uses it: writing 6 MB of weights costs more than the product that reads them. A
bfloat16 or float16 checkpoint's experts are kept as stored too where the compute is float32 on the
CPU (:func:`runahead.models.layout.kept_as_stored`): half the bytes in the cache and on every pass
over an expert, and no widening copy on the link.
:func:`grouped_product` multiplies float32 rows by the matrices *as the file stores them*, forming
each weight in registers exactly as ggml dequantizes it (``d * q``, exact in float32), so it agrees
with dequantize-then-matmul to float32 rounding (it sums in another order) and never writes a
full-width copy. One call runs a whole group's experts (``qkernel.c``), split over torch's thread count.
A float32 checkpoint's experts (:data:`FLOAT32`) take the same pass: nothing to convert, but each matrix
prefetched ahead of the rows and two calls per group where torch runs two products per expert.

The kernel is C (``qkernel.c``) in builds of one source: AVX2/FMA/F16C intrinsics on an x86-64 CPU
with all three (``avx2``), the same plus AVX-512 bf16 dot products for a bfloat16 compute's rows on a CPU
that has them (``avx512bf16``: Zen 4 and later, Intel from Cooper Lake / Sapphire Rapids), else portable
C the compiler vectorizes for the CPU's baseline vector unit (NEON on arm64: Jetson, Graviton, Apple
silicon under Linux; SSE2 on older x86-64). It is compiled with the system's C compiler (``cc``;
``RUNAHEAD_CC`` to choose another) into ``$RUNAHEAD_CACHE/kernels`` (default ``~/.cache/runahead``) the
first time a process needs it (well under a second) and loaded with :mod:`ctypes`.
``RUNAHEAD_QUANT_KERNEL``: ``on`` (default: the best build for this CPU), ``avx2`` (not the AVX-512
one), ``portable`` (the portable build even where AVX2 runs), ``off``. Where no build is possible (no
compiler, or ``off``) :func:`available` is False and the model dequantizes as before; the reason is
logged once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from runahead import native

log = logging.getLogger(__name__)

KINDS = {"Q4_0": 0, "Q8_0": 1, "BF16": 2, "F16": 3}
"""Stored types the kernel multiplies (its ``kind`` codes)."""

FLOAT32 = "F32"
BF16_DOT = "BF16*bf16"
CODES = {**KINDS, FLOAT32: 4, BF16_DOT: 5}
"""Every type :func:`grouped_product` takes: the stored :data:`KINDS`, float32 matrices (a float32
checkpoint's experts in compute-dtype slots: no conversion, but the same prefetched pass over each
matrix and one call per group instead of two torch products per expert), and :data:`BF16_DOT`: a BF16
matrix times rows that are bfloat16 too (a bfloat16 compute's), with the CPU's bf16 dot products, in
the build that has them (:func:`bf16_dot`)."""

HALF_KINDS = {torch.bfloat16: "BF16", torch.float16: "F16"}
"""The kernel's kind for a half-width torch dtype."""

BLOCK = 32
"""Weights per block: the kernel multiplies rows whose length is a whole number of them (Q4_0 and
Q8_0 rows always are; a bfloat16 or float16 matrix's rows must be too)."""


def multiplies(kind: str, row_lengths: Sequence[int]) -> bool:
    """Whether the kernel multiplies ``kind`` matrices (one of :data:`CODES`) with rows of these lengths
    and runs here (``RUNAHEAD_QUANT_KERNEL=off``: never, float32 ones included)."""
    usable = available() if kind != BF16_DOT else bf16_dot()
    return kind in CODES and all(n % BLOCK == 0 for n in row_lengths) and usable


def bf16_dot() -> bool:
    """Whether the build that runs here multiplies :data:`BF16_DOT` (bfloat16 rows by a BF16 matrix with
    the CPU's bf16 dot products: the ``avx512bf16`` build)."""
    return variant() == "avx512bf16"


KERNEL_ROWS = {"avx512bf16": 32, "avx2": 32, "portable": 8}
"""Most rows one expert runs through each build; more (a prefill chunk's) go through dequantize-then-
matmul, whose blocked float32 product wins once the dequantization is shared by enough rows
(``bench/quant_kernels.py --rows 1,4,8,16,32``, one thread, ``docs/results-gguf.md``: the AVX2 build
still won at 32 rows, not at 64 for Q8_0 nor at 128 for either; the portable build, measured as
x86-64's SSE2 baseline build, won up to 8 rows and tied dequantization at 16 for Q4_0 and 8 for Q8_0)."""


def max_rows() -> int:
    """:data:`KERNEL_ROWS` of the build that runs here (0 where none does)."""
    name = variant()
    return 0 if name is None else KERNEL_ROWS[name]


SOURCE = Path(__file__).with_name("qkernel.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
BUILDS = {
    "avx512bf16": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
}
"""The kernel's builds and the flags each adds to :data:`FLAGS` (``qkernel.c`` picks its body from them:
``avx512bf16`` is the AVX2 body plus :data:`BF16_DOT`)."""
CPU_FLAGS = {"avx2", "fma", "f16c"}
BF16_DOT_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
"""What the ``avx512bf16`` build needs beyond :data:`CPU_FLAGS` (``/proc/cpuinfo``'s names)."""


def available() -> bool:
    """Whether :func:`grouped_product` can run here (the kernel is built on the first call)."""
    return _library() is not None


def variant() -> str | None:
    """Which build runs here: ``"avx512bf16"``, ``"avx2"`` or ``"portable"``; None where there is no
    kernel (dequantize)."""
    library = _library()
    return None if library is None else library.variant


def grouped_product(
    x: Tensor,
    matrices: Sequence[int],
    spans: Sequence[tuple[int, int]],
    kind: str,
    n: int,
    *,
    build: str | tuple[str, Path] | None = None,
) -> Tensor:
    """``y [P, n]``: rows ``start:stop`` of ``x [P, K]`` (float32, CPU; bfloat16 for :data:`BF16_DOT`)
    times matrix ``[n, K]`` stored as ``kind`` at address ``matrices[s]`` (a slot's ``data_ptr()`` plus
    the part's byte offset), for each ``(start, stop)`` of ``spans``; rows in no span are zero.

    The matrices must stay alive (their slots pinned) for the call; ``K`` must be whole 32-weight blocks.
    ``build`` names a build to use instead of the one chosen for this CPU, or a build and another
    source file to compile it from (:func:`load`; benchmarks that compare kernels).
    """
    library = _library() if build is None else load(build) if isinstance(build, str) else load(*build)
    if library is None:
        raise RuntimeError("the quantized product kernel is not available on this machine")
    if kind not in CODES:
        raise ValueError(f"the kernel multiplies {', '.join(CODES)}, not {kind}")
    if kind == BF16_DOT and library.variant != "avx512bf16":
        raise ValueError(f"the {library.variant} build has no bf16 dot products ({BF16_DOT})")
    rows = torch.bfloat16 if kind == BF16_DOT else torch.float32
    if x.dtype != rows or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"rows must be 2-d {rows} on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    y = torch.zeros(x.shape[0], n) if _leaves_gaps(spans, x.shape[0]) else torch.empty(x.shape[0], n)
    table = (ctypes.c_int64 * (3 * len(spans)))(*matrices, *(s for s, _ in spans), *(e for _, e in spans))
    return _run(library, kind, x, y, table)


def product(x: Tensor, matrix: int, kind: str, n: int) -> Tensor:
    """``y [R, n]``: every row of ``x [R, K]`` times one matrix ``[n, K]`` stored as ``kind`` at address
    ``matrix``: :func:`grouped_product`'s one-matrix case (a resident matrix's decode rows), without
    its checks.

    The caller has checked once what :func:`grouped_product` checks per call (the kernel runs here,
    ``kind`` is one of :data:`CODES` that it multiplies, ``K`` is whole blocks, ``x`` is float32 on the
    CPU, bfloat16 for :data:`BF16_DOT`, with at most :func:`max_rows` rows), as
    :meth:`runahead.models.products.ExpertProducts.dense` does per matrix: a decode group calls this
    several times, where the checks cost as much as a small product.
    """
    library = _library()
    assert library is not None
    x = x.contiguous()
    return _run(library, kind, x, torch.empty(x.shape[0], n), (ctypes.c_int64 * 3)(matrix, 0, x.shape[0]))


def _run(library: _Library, kind: str, x: Tensor, y: Tensor, table: ctypes.Array[ctypes.c_int64]) -> Tensor:
    """The C call: ``x`` (contiguous float32, or bfloat16) into ``y [rows, n]`` over ``table``, every
    segment's matrix address, then every start, then every stop (``3 * segments`` int64s)."""
    count = len(table) // 3
    base = ctypes.addressof(table)
    status = library.runahead_grouped_product(
        CODES[kind], x.data_ptr(), y.data_ptr(), y.shape[1], x.shape[1], count,
        base, base + 8 * count, base + 16 * count, torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"quantized product refused its arguments: {kind} rows of {x.shape[1]} weights")
    return y


def _leaves_gaps(spans: Sequence[tuple[int, int]], rows: int) -> bool:
    covered = sorted(spans)
    at = 0
    for start, stop in covered:
        if start != at:
            return True
        at = stop
    return at != rows


class _Library(ctypes.CDLL):
    variant: str


@functools.cache
def _library() -> _Library | None:
    """The kernel build for this CPU and ``RUNAHEAD_QUANT_KERNEL``, or None (and why, logged once)."""
    mode = os.environ.get("RUNAHEAD_QUANT_KERNEL", "on").lower()
    if mode in ("off", "0", "false", "no"):
        log.info("quantized product kernel off: RUNAHEAD_QUANT_KERNEL is off; stored experts are dequantized")
        return None
    why = "RUNAHEAD_QUANT_KERNEL is portable" if mode == "portable" else native.cpu_lacks(CPU_FLAGS)
    if why:
        log.info("quantized product kernel: the portable build (%s)", why)
        return load("portable")
    if mode != "avx2" and not native.cpu_lacks(BF16_DOT_FLAGS):
        return load("avx512bf16") or load("avx2")  # a compiler without -mavx512bf16: the AVX2 build
    return load("avx2")


@functools.cache
def load(name: str, source: Path = SOURCE) -> _Library | None:
    """The ``name`` build (one of :data:`BUILDS`), compiled on first use; None if it cannot be built.

    For benchmarks that compare the builds, or another ``source`` of the same C interface (an earlier
    commit's ``qkernel.c``); the runtime uses the one chosen for the CPU from :data:`SOURCE`.
    """
    if name not in BUILDS:
        raise ValueError(f"kernel builds are {', '.join(BUILDS)}, not {name!r}")
    try:
        library = _Library(str(native.build(source, (*FLAGS, *BUILDS[name]))))
    except (OSError, subprocess.SubprocessError) as error:
        log.info("quantized product kernel off: build failed (%s); stored experts are dequantized", error)
        return None
    library.variant = name
    function = library.runahead_grouped_product
    function.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 3]
    function.argtypes += [*[ctypes.c_void_p] * 3, ctypes.c_int]
    function.restype = ctypes.c_int
    return library
