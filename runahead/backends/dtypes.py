"""The torch backend's compute dtype: named by the user, or measured on the machine it runs on.

CPUs differ by two orders of magnitude here: with AMX or AVX-512 BF16 a bfloat16 product is 2-5x
faster than a float32 one (half the bytes of weights to read, and native bf16 dot products); without
them it can be ~100x slower. ``auto`` therefore times the products the model will run (its expert's
``gate``/``up`` matrix ``[I, H]`` against the row counts of decode and of a small batch, over more
weights than the last-level cache holds, so memory is read as in a real step) in float32 and in
bfloat16, and takes the faster. The measurement runs once per process and shape (a few tens of
milliseconds); on CUDA ``auto`` is bfloat16 without measuring. For a bfloat16 checkpoint whose
experts the CPU kernel multiplies as stored, the race is the kernel's own (:func:`faster_expert_rows`):
float32 rows over the stored bf16 weights against bfloat16 rows with the CPU's bf16 dot products.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import cache

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger("runahead.backends")

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
    :data:`_ROWS` row counts, each pass cycling through ~64 MiB of float32-sized weights, the
    candidates taking turns (:func:`_race`). A candidate 4x slower than the other in the first
    round is not measured further (bfloat16 without the CPU's support: ~100x).
    """
    timings = _products_times(hidden, inter, give_up=4.0)
    chosen = min(timings, key=lambda d: timings[d])
    _log_race("torch's products", chosen, timings, hidden, inter)
    return chosen


def cpu_dtype_timings(hidden: int, inter: int) -> dict[str, float]:
    """Seconds per pass of the products :func:`fastest_cpu_dtype` compares, per candidate (no give-up)."""
    return _by_name(_products_times(hidden, inter))


Pass = Callable[[float], None]
"""One timed pass of a candidate's products; it may stop early once :data:`_clock` passes the
deadline it is given (a candidate already out of the race)."""

_clock = time.perf_counter
"""What the races time with (a test puts a fake clock here)."""


def _race(
    passes: dict[torch.dtype, Pass], rounds: int, give_up: float = math.inf
) -> dict[torch.dtype, float]:
    """Each candidate's best pass (seconds) over ``rounds`` rounds in which the candidates take turns,
    the order reversed every other round.

    NOTE (why turns). Timed one candidate after the other, a pause of the machine (another process,
    a hypervisor) or a warming cache that lasts through one candidate's passes hands the race to the
    other. On an Intel Xeon with AMX and AVX-512 BF16 (2026-12-05, ten fresh processes each, the
    medium model's 1024 x 512 experts) the kernel's race gave bfloat16 rows 0.61-1.11x float32's time
    one after the other, so one run in ten took float32 (and computed float32's tokens); taking turns,
    0.78-0.91x, bfloat16 in all ten. A pause now has to outlast a pass of each candidate to tilt the
    best of every round. After the first round a candidate more than ``give_up`` times the fastest
    one's first pass is not measured again, and its first pass stops at that time (it is out of the
    race either way).
    """
    best: dict[torch.dtype, float] = {}
    live = list(passes)
    for round_ in range(rounds):
        for dtype in live if round_ % 2 == 0 else live[::-1]:
            bar = give_up * min(best.values(), default=math.inf) if round_ == 0 else math.inf
            start = _clock()
            passes[dtype](start + bar)
            best[dtype] = min(best.get(dtype, math.inf), _clock() - start)
        if round_ == 0 and give_up < math.inf:
            fastest = min(best.values())
            live = [dtype for dtype in live if best[dtype] <= give_up * fastest]
    return best


def _products_times(hidden: int, inter: int, give_up: float = math.inf) -> dict[torch.dtype, float]:
    """:func:`_race` of torch's products in each of :data:`CANDIDATES`, three rounds."""
    count = max(2, min(64, _COLD_BYTES // (4 * hidden * inter)))

    def products(dtype: torch.dtype) -> Pass:
        weights = torch.full((count, inter, hidden), 0.01, dtype=dtype)
        inputs = [torch.full((rows, hidden), 0.5, dtype=dtype) for rows in _ROWS]
        with torch.inference_mode():
            F.linear(inputs[0], weights[0])  # first-call set-up (kernel selection) is not timed

        def run(deadline: float) -> None:
            with torch.inference_mode():
                for x in inputs:
                    for w in weights:
                        F.linear(x, w)
                    if _clock() > deadline:
                        return  # out of the race: no need to finish

        return run

    return _race({dtype: products(dtype) for dtype in CANDIDATES}, 3, give_up)


BF16_ROWS_WIN = 0.95
""":func:`faster_expert_rows` takes bfloat16 rows only when their products take at most this share of
float32 rows' time: float32 decodes token for token as transformers' float32 does, so a gain within the
timing's noise is not worth giving that up."""

_EXPERT_GROUPS = ((1, 8), (2, 8))
"""(rows per expert, experts) of the groups :func:`faster_expert_rows` times: decode's. One request's
token gives each of its experts one row, and a decode group of a few requests (runahead's 1-3 jobs,
sync's 8 over the medium model's 64 experts) one or two. NOTE: until 2026-12-05 the second group had
four rows per expert, where bf16 dot products win on any CPU that has them (0.72-0.77x float32's time
on a Zen 4); at one or two rows a Zen 4 core's bf16 dot products take 1.23-1.32x float32 rows' time,
so the race chose bfloat16 there (0.94-1.02x) while whole runs decoded 5-35% slower in it
(docs/results-torch.md, "The dtype race at decode's rows")."""
_EXPERT_COLD_BYTES = 128 << 20  # a model's experts are read from memory, never from a cache
_MOST_EXPERTS = 256  # small experts: enough calls to time, not seconds of them (64 x 32 took 1.3 s)


@cache
def faster_expert_rows(hidden: int, inter: int) -> torch.dtype:
    """float32 or bfloat16: the rows that multiply a bfloat16 checkpoint's experts faster on this CPU's
    kernel (:mod:`runahead.models.qkernel`), at expert shape ``gate | up [2 inter, hidden]``,
    ``down [hidden, inter]``.

    Both keep the experts as the file stores them; float32 rows widen each weight in registers (the
    ``BF16`` pass), bfloat16 rows use the CPU's bf16 dot products (``BF16*bf16``), in the build that
    has them (else float32, unmeasured). Each is timed as a decode group runs it (gate and up as one
    product, the gated unit, down) over ~128 MiB of experts (256 at most), best of five passes each,
    the two taking turns (:func:`_race`; ~0.2 s on 1024 x 512 experts); bfloat16 is chosen when it
    takes at most :data:`BF16_ROWS_WIN` of float32's time, as measured once per process and shape
    (one thread or many: torch's count, as the compute runs it, since
    :meth:`~runahead.backends.torch.TorchBackend.open` sets it first). On an Intel Xeon with AMX and
    AVX-512 BF16 (2026-12-05) bfloat16 rows took 0.78-0.91x the time at 1024 x 512 (0.86-0.90x at
    2048 x 768, timed one after the other; then with four rows per expert in the second group) and the
    medium model decoded 1.08x (one request) and 1.19x (eight) faster; docs/results-torch.md, "A
    bfloat16 checkpoint on an AMX Xeon". On a Zen 4 EPYC with AVX-512 BF16 they take 1.23-1.32x at
    decode's rows (:data:`_EXPERT_GROUPS`), and float32 it is ("The dtype race at decode's rows").
    """
    from runahead.models import qkernel

    if not qkernel.bf16_dot() or hidden % qkernel.BLOCK or inter % qkernel.BLOCK:
        return torch.float32
    timings = _expert_rows_times(hidden, inter)
    wins = timings[torch.bfloat16] <= BF16_ROWS_WIN * timings[torch.float32]
    chosen = torch.bfloat16 if wins else torch.float32
    _log_race("the kernel's rows over stored bf16 experts", chosen, timings, hidden, inter)
    return chosen


def _by_name(timings: dict[torch.dtype, float]) -> dict[str, float]:
    """``timings`` keyed by the dtypes' names (``float32``, ``bfloat16``), as the log shows them."""
    return {str(d).removeprefix("torch."): t for d, t in timings.items()}


def _log_race(
    race: str, chosen: torch.dtype, timings: dict[torch.dtype, float], hidden: int, inter: int
) -> None:
    """Say once per process and shape what ``auto`` chose on this CPU, and the times it chose from
    (a bfloat16 compute's tokens are not float32's: the user should be able to see why)."""
    ms = {name: round(t * 1e3, 2) for name, t in _by_name(timings).items()}
    log.info(
        "compute dtype timed",
        race=race,
        chose=str(chosen).removeprefix("torch."),
        ms=ms,
        shape=(hidden, inter),
    )


def expert_rows_timings(hidden: int, inter: int) -> dict[str, float]:
    """Seconds per pass of the products :func:`faster_expert_rows` compares, per candidate."""
    return _by_name(_expert_rows_times(hidden, inter))


def _expert_rows_times(hidden: int, inter: int) -> dict[torch.dtype, float]:
    """:func:`_race` of the kernel's float32 and bfloat16 rows over the same bf16 experts, five rounds."""
    from runahead.models import qkernel

    size = 3 * inter * hidden
    most = max(n for _, n in _EXPERT_GROUPS)
    count = most * max(1, min(_MOST_EXPERTS, _EXPERT_COLD_BYTES // (2 * size)) // most)
    experts = torch.full((count, size), 0.01, dtype=torch.bfloat16)
    down_at = 2 * inter * hidden * 2  # bytes into an expert: gate | up, then down

    def rows(dtype: torch.dtype) -> Pass:
        kind = "BF16" if dtype == torch.float32 else qkernel.BF16_DOT

        def run(_deadline: float) -> None:
            with torch.inference_mode():
                for per, n in _EXPERT_GROUPS:
                    x = torch.full((per * n, hidden), 0.5, dtype=dtype)
                    runs = [(i * per, (i + 1) * per) for i in range(n)]
                    for first in range(0, count, n):
                        at = [experts[first + i].data_ptr() for i in range(n)]
                        gate_up = qkernel.grouped_product(x, at, runs, kind, 2 * inter).to(dtype)
                        unit = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
                        qkernel.grouped_product(unit, [a + down_at for a in at], runs, kind, hidden)

        return run

    return _race({dtype: rows(dtype) for dtype in CANDIDATES}, 5)
