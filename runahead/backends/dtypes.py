"""The torch backend's compute dtype: named by the user, or measured on the machine it runs on.

CPUs differ by two orders of magnitude here: with AMX or AVX-512 BF16 a bfloat16 product is 2-5x
faster than a float32 one (half the bytes of weights to read, and native bf16 dot products); without
them it can be ~100x slower. ``auto`` therefore times the products the model will run (its expert's
``gate``/``up`` matrix ``[I, H]`` against the row counts of decode and of a small batch, over more
weights than the last-level cache holds, so memory is read as in a real step) in float32 and in
bfloat16, and takes the faster. The measurement runs once per process and shape (a few tens of
milliseconds); on CUDA ``auto`` is bfloat16 without measuring.
"""

from __future__ import annotations

import time
from functools import cache

import torch
import torch.nn.functional as F

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Compute dtypes a user may name (``auto`` aside)."""

DTYPE_CHOICES = ("auto", *DTYPES)
"""What ``--dtype`` accepts."""

CANDIDATES = (torch.float32, torch.bfloat16)
"""What ``auto`` chooses between on CPU (float16 products have no fast CPU path worth the range loss)."""

_ROWS = (1, 8, 32)  # decode (one request), a decode group, a small batch or prompt chunk
_COLD_BYTES = 64 << 20  # weights cycled through per timing: beyond a last-level cache


def resolve_dtype(
    dtype: torch.dtype | str, device: str | torch.device, shape: tuple[int, int] | None = None
) -> torch.dtype:
    """The compute dtype for ``dtype``: a ``torch.dtype`` or one of :data:`DTYPE_CHOICES`.

    ``auto``: bfloat16 on CUDA; on CPU the faster of float32 and bfloat16 at ``shape``
    ``(hidden, expert width)`` (:func:`fastest_cpu_dtype`; 1024 x 512 when not given). Raises
    ``ValueError`` naming the accepted values for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported compute dtype {dtype}; expected one of {', '.join(DTYPE_CHOICES)}")
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return fastest_cpu_dtype(*(shape or (1024, 512)))
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


@cache
def fastest_cpu_dtype(hidden: int, inter: int) -> torch.dtype:
    """The faster of :data:`CANDIDATES` for ``x [rows, hidden] @ W [inter, hidden].T`` on this CPU.

    Measured once per process and shape: each candidate's best of three passes over
    :data:`_ROWS` row counts, each pass cycling through ~64 MiB of float32-sized weights. A
    candidate already 4x slower than the best after its first pass is not measured further.
    """
    timings: dict[torch.dtype, float] = {}
    for dtype in CANDIDATES:
        slowest = 4 * min(timings.values(), default=float("inf"))
        timings[dtype] = _time_products(dtype, hidden, inter, give_up=slowest)
    return min(timings, key=lambda d: timings[d])


def cpu_dtype_timings(hidden: int, inter: int) -> dict[str, float]:
    """Seconds per pass of the products :func:`fastest_cpu_dtype` compares, per candidate (no give-up)."""
    return {str(d).removeprefix("torch."): _time_products(d, hidden, inter) for d in CANDIDATES}


def _time_products(dtype: torch.dtype, hidden: int, inter: int, give_up: float = float("inf")) -> float:
    count = max(2, min(64, _COLD_BYTES // (4 * hidden * inter)))
    weights = torch.full((count, inter, hidden), 0.01, dtype=dtype)
    inputs = [torch.full((rows, hidden), 0.5, dtype=dtype) for rows in _ROWS]
    best = float("inf")
    with torch.inference_mode():
        F.linear(inputs[0], weights[0])  # first-call set-up (kernel selection) is not measured
        for _ in range(3):
            start = time.perf_counter()
            for x in inputs:
                for w in weights:
                    F.linear(x, w)
                if time.perf_counter() - start > give_up:
                    return time.perf_counter() - start  # hopeless: stop measuring it
            best = min(best, time.perf_counter() - start)
    return best
