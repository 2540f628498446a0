"""Bottleneck-aware grouping's inputs and rule, as pure code (no clock, no I/O).

When the compute unit frees up, the scheduler actor builds an :class:`Outlook` (what it knows: the
blocked jobs, the cache's state of their experts, the link's and the compute unit's costs) and
:meth:`runahead.scheduling.ComputeQueue.plan` asks :func:`hold_until` whether to compute the
paper's opportunistic group now or :class:`Hold` it for jobs of the same layer whose reads are
landing (:func:`landing_times`). :class:`ComputeFit` estimates a group's compute time for backends
without a cost model. Beyond the paper; ``runahead/grouping=bottleneck`` selects it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from runahead.cache import EntryState
from runahead.jobs import ExpertKey, Job


@dataclass(frozen=True, slots=True)
class Outlook:
    """What the runtime knows when the compute unit frees up (``bottleneck`` grouping's inputs).

    ``blocked``: every job the JobIssuer holds for missing experts; ``state``: the expert cache's
    state of a key; ``fetch_s``: link seconds one expert's read holds the link; ``reveal_s``: link
    seconds of misses one computed job reveals on average; ``group_s``: compute seconds of one group
    of the given jobs (one backend call). Times come from the caller's clock; nothing here reads one.
    """

    now: float
    blocked: Sequence[Job]
    state: Callable[[ExpertKey], EntryState | None]
    fetch_s: float
    reveal_s: float
    group_s: Callable[[Sequence[Job]], float]
    compute_share: float = 1.0
    """Compute busy time over link busy time so far: above 1 the compute unit is the bottleneck."""
    tail_layer: int | None = None
    """The layer whose computed jobs reveal no read the link could start before the step barrier
    releases the next token (the last layer, with the barrier on); None without a barrier."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Compute nothing now: wait until a job becomes ready, or until ``deadline`` at the latest."""

    deadline: float


HOLD_COMPUTE_WEIGHT = 0.25
"""What a second of compute saved is worth against a second of the window's makespan (hold_until)."""

HOLD_STARVE_ALLOWANCE = 0.5
"""A hold may starve the link longer than computing now would by at most this share of its group's
compute (hold_until)."""

HOLD_MIN_COMPUTE_SHARE = 1.1
"""Groups below the tail layer are held only while compute busy time is at least this share of link
busy time so far: short of that, the link's own idle time at each step's start and end outweighs
the compute saved, and the paper's rule keeps the link fed best (tail-layer groups are always
considered: their reveals give the link nothing)."""


def landing_times(
    now: float,
    blocked: Iterable[Job],
    state: Callable[[ExpertKey], EntryState | None],
    fetch_s: float,
) -> tuple[dict[int, float], float]:
    """When each blocked job should become ready, and when the link runs out of revealed work.

    NOTE (a model of the ExpertFetcher, not a copy of its state): the reads in flight (``PENDING``)
    land first, all of them by ``now + pending * fetch_s``; the other missing experts are read one
    after another in ``SELECT_FETCH_JOB`` order (lowest progress, then fewest missing), an expert
    two jobs need once. Returns ``{request: ready time}`` and the time the last read lands.
    """
    pending: set[ExpertKey] = set()
    order = []
    for job in blocked:
        keys = [key for key in job.keys if state(key) is not EntryState.RESIDENT]
        pending.update(key for key in keys if state(key) is EntryState.PENDING)
        order.append(((job.epoch, job.layer, len(keys), job.request), job, keys))
    cursor = now + len(pending) * fetch_s
    lands = dict.fromkeys(pending, cursor)
    ready_at = {}
    for _, job, keys in sorted(order, key=_first):
        for key in keys:
            if key not in lands:
                cursor += fetch_s
                lands[key] = cursor
        ready_at[job.request] = max((lands[key] for key in keys), default=now)
    return ready_at, cursor


def hold_until(
    now: float,
    ready: Sequence[Job],
    waiting: Sequence[tuple[float, Job]],
    link_free_at: float,
    group_s: Callable[[Sequence[Job]], float],
    reveal_s: float,
    *,
    reveals: bool = True,
) -> float | None:
    """Whether to hold the ready group back: None (compute it now) or the time to wait until.

    NOTE (bottleneck-aware grouping, beyond the paper's opportunistic rule). ``ready`` are the
    ready jobs of the lowest ready layer; ``waiting`` the blocked jobs of that layer with the time
    each should become ready, soonest first. Option ``k`` waits for the first ``k`` of them and
    computes one group; the others follow as one group once the last is ready (``k = 0`` is the
    paper's rule). Each option is scored over that window: when the compute unit is done, and when
    the link is: it runs out of revealed reads at ``link_free_at`` and gets ``reveal_s`` of new
    reads per job once that job's gate has run, so a link starved by a held group shows in the
    score. Score = ``max(compute done, link done) + HOLD_COMPUTE_WEIGHT * compute busy``; an option
    that starves the link longer than computing now would, by more than
    ``HOLD_STARVE_ALLOWANCE`` of its group's compute, is not taken (run ahead only as far as it
    keeps the link busy; otherwise batch). Ties keep the shorter wait. Pure and deterministic.

    ``reveals=False`` (the tail layer: the jobs' reveals give the link nothing before the step
    barrier releases) scores the same window with no reads revealed and no starvation limit, so the
    layer's groups finish as early as they can: the paper's rule there often computes the layer in
    two or three groups, each reading the layer's (and the output head's) shared weights again.
    """
    best_k, best = 0, math.inf
    if not reveals:
        reveal_s = 0.0
    starved_now = max(0.0, now + group_s(ready) - link_free_at)
    for k in range(len(waiting) + 1):
        start = now if k == 0 else max(now, waiting[k - 1][0])
        first = [*ready, *(job for _, job in waiting[:k])]
        busy = group_s(first)
        done = start + busy
        if reveals and k and done - link_free_at > starved_now + HOLD_STARVE_ALLOWANCE * busy:
            continue
        link = max(link_free_at, done) + len(first) * reveal_s
        if k < len(waiting):
            rest = [job for _, job in waiting[k:]]
            rest_busy = group_s(rest)
            done = max(done, waiting[-1][0]) + rest_busy
            link = max(link, done) + len(rest) * reveal_s
            busy += rest_busy
        score = max(done, link) + HOLD_COMPUTE_WEIGHT * busy
        if score < best - 1e-12:
            best_k, best = k, score
    return None if best_k == 0 else max(now, waiting[best_k - 1][0])


def landing_order(entry: tuple[float, Job]) -> tuple[float, int]:
    """Sort key of ``(ready time, job)`` pairs: soonest first, then by request."""
    return (entry[0], entry[1].request)


class ComputeFit:
    """Compute seconds of a group as ``shared + per_job * jobs``, least squares over observed groups.

    For backends without a cost model: the scheduler observes every group it computes.
    """

    def __init__(self) -> None:
        self.observed = 0
        self._sums = [0.0, 0.0, 0.0, 0.0]  # sum x, sum y, sum x^2, sum xy

    def observe(self, jobs: int, seconds: float) -> None:
        self.observed += 1
        sums = self._sums
        sums[0] += jobs
        sums[1] += seconds
        sums[2] += jobs * jobs
        sums[3] += jobs * seconds

    def __call__(self, jobs: int) -> float:
        """Estimated seconds for a group of ``jobs`` (0 before anything was observed)."""
        n = self.observed
        if not n:
            return 0.0
        sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        if spread <= 1e-12:  # one group size seen so far: scale its mean
            return sy / sx * jobs
        per_job = max(0.0, (n * sxy - sx * sy) / spread)
        shared = max(0.0, (sy - per_job * sx) / n)
        return shared + per_job * jobs


_first = operator.itemgetter(0)
