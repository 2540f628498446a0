"""What a run measured: busy intervals of the compute unit and the link, and what follows from them.

The actors append intervals as they happen (times from the injected clock). :func:`summarize`
turns them into the paper's quantities: step time, compute time (accelerator busy), fetch time
(link busy: some read in flight), the both-busy (overlap) fraction, the compute-waiting fraction,
and the physical lower bound ``max(compute, fetch)`` no schedule can beat.
"""

from __future__ import annotations

import functools
import platform
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runahead.cache import CacheStats
from runahead.jobs import ExpertKey

Interval = tuple[float, float]


@dataclass(slots=True)
class ComputeRecord:
    start: float
    end: float
    layer: int
    size: int
    requests: tuple[int, ...]


@dataclass(slots=True)
class FetchRecord:
    start: float
    end: float
    key: ExpertKey
    prefetch: bool


@dataclass(slots=True)
class Recorder:
    """Log of one run, filled by the actors, plus running totals.

    With ``keep_records`` off (a long-running server) only the totals grow, not the log.
    """

    computes: list[ComputeRecord] = field(default_factory=list)
    fetches: list[FetchRecord] = field(default_factory=list)
    tokens: list[tuple[int, int, float]] = field(default_factory=list)  # (request, step, time)
    selections: dict[int, list[tuple[int, int, tuple[int, ...]]]] = field(default_factory=dict)
    record_selections: bool = False
    keep_records: bool = True
    compute_seconds: float = 0.0
    read_seconds: float = 0.0  # summed over reads: overlapping reads count each
    link_seconds: float = 0.0  # the link busy (some read in flight), up to the last read's end
    groups: int = 0
    jobs: int = 0
    reads: int = 0
    token_count: int = 0
    holds: int = 0  # times bottleneck grouping held a ready group back
    batched_tokens: int = 0  # tokens made while adaptive grouping batched (:mod:`runahead.mode`)
    mode_switches: int = 0  # times adaptive grouping switched between running ahead and batching
    inline_groups: int = 0  # groups computed on the event loop's thread (the link idle: InlineCompute)
    _in_flight: int = 0  # reads started and not ended (:meth:`read_started` / :meth:`read_ended`)
    _link_mark: float = 0.0  # where ``link_seconds`` counts on from while a read is in flight

    def compute(self, start: float, end: float, layer: int, requests: tuple[int, ...]) -> None:
        self.compute_seconds += end - start
        self.groups += 1
        self.jobs += len(requests)
        if self.keep_records:
            self.computes.append(ComputeRecord(start, end, layer, len(requests), requests))

    def fetch(self, start: float, end: float, key: ExpertKey, prefetch: bool) -> None:
        """A read begun with :meth:`read_started` landed (it ends there: :meth:`read_ended`)."""
        self.read_ended(end)
        self.read_seconds += end - start
        self.reads += 1
        if self.keep_records:
            self.fetches.append(FetchRecord(start, end, key, prefetch))

    def read_started(self, start: float) -> None:
        """A read began (the link is busy while any read is in flight; see :meth:`read_ended`)."""
        if not self._in_flight:
            self._link_mark = start
        self._in_flight += 1

    def read_ended(self, end: float) -> None:
        """A read begun with :meth:`read_started` ended (:meth:`fetch` calls it for a landed one; the
        fetcher for one that failed): ``link_seconds`` grows by the time since the previous start or
        end while a read was in flight, so it is the union of the reads' intervals (reads in flight
        together count once), kept up to date at every end. An end before the last start or end
        (a landing the loop took late, dated by its reader) adds nothing."""
        if end > self._link_mark:
            self.link_seconds += end - self._link_mark
            self._link_mark = end
        self._in_flight -= 1

    def token(self, request: int, step: int, time: float) -> None:
        self.token_count += 1
        if self.keep_records:
            self.tokens.append((request, step, time))

    def selection(self, request: int, step: int, layer: int, experts: tuple[int, ...]) -> None:
        """The experts a request's gate chose (kept only with ``record_selections``)."""
        if self.record_selections:
            self.selections.setdefault(request, []).append((step, layer, experts))


@functools.cache
def host_cpu() -> str:
    """The model name of this machine's CPU (what ``lscpu`` calls "Model name"), for rows whose
    CPU times depend on it; ``platform.processor()`` where ``/proc/cpuinfo`` does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def union(intervals: list[Interval]) -> list[Interval]:
    """Merge overlapping intervals into disjoint ones, sorted."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def total(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection_total(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the overlap of two sorted disjoint interval lists."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if end > start:
            both += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


@dataclass(slots=True)
class RunMetrics:
    """Summary of one run. Every ``_s`` field is a per-decode-step mean in seconds."""

    tokens: int
    steps: float
    makespan_s: float
    tokens_per_s: float
    step_time_s: float
    compute_s: float
    fetch_s: float
    lower_bound_s: float
    bound_ratio: float
    overlap_fraction: float
    compute_wait_fraction: float
    link_only_fraction: float
    compute_only_fraction: float
    idle_fraction: float
    hits: int
    misses: int
    fetches: int
    fetches_per_step: float
    prefetches: int
    wasted_prefetches: int
    evictions: int
    groups: int
    mean_group_size: float
    group_sizes: dict[int, int]

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def clip(intervals: list[Interval], start: float, end: float) -> list[Interval]:
    """The parts of ``intervals`` inside ``[start, end]``."""
    return [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]


def overlap_limit(compute_s: float, fetch_s: float) -> float:
    """The most a schedule that overlaps the link with compute can gain over doing them in turn:
    ``(compute + fetch) / max(compute, fetch)`` of sync's own row (the issues' and figures' limit)."""
    return (compute_s + fetch_s) / max(compute_s, fetch_s)


def summarize(recorder: Recorder, stats: CacheStats, steps: float, *, skip_steps: int = 0) -> RunMetrics:
    """Reduce a run's log to :class:`RunMetrics`; ``steps`` is how many decode steps it made.

    ``skip_steps`` leaves the first steps out (a cold cache warming up): the window starts when
    every request has produced its token ``skip_steps - 1``. Busy times, tokens and reads are
    counted inside the window; hits and misses stay whole-run totals, and so do the groups.
    """
    if not recorder.tokens:
        raise ValueError("the run produced no tokens")
    start = min([c.start for c in recorder.computes] + [f.start for f in recorder.fetches])
    if skip_steps:
        if skip_steps >= steps:
            raise ValueError(f"cannot skip {skip_steps} of {steps} steps")
        start = max(t for _, step, t in recorder.tokens if step == skip_steps - 1)
        steps -= skip_steps
    end = max(t for _, _, t in recorder.tokens)
    tokens = sum(1 for _, step, _ in recorder.tokens if step >= skip_steps)
    fetches = sum(1 for f in recorder.fetches if f.start >= start) if skip_steps else stats.fetches
    return _window_metrics(recorder, stats, start, end, tokens, steps, fetches, recorder.computes)


def summarize_window(
    recorder: Recorder, stats: Any, start: float, end: float, concurrency: int
) -> RunMetrics:
    """:func:`runahead.metrics.summarize` over the window ``(start, end]`` of a run.

    Tokens, busy times, reads and groups are those inside the window; a "step" is ``concurrency``
    tokens. Hits, misses and prefetch counts stay whole-run totals (the cache counts them).
    """
    if not end > start:
        raise ValueError(f"empty measurement window ({start}, {end}]")
    tokens = sum(1 for _, _, t in recorder.tokens if start < t <= end)
    if not tokens:
        raise ValueError("no tokens inside the measurement window")
    fetches = sum(1 for f in recorder.fetches if start <= f.start < end)
    groups = [c for c in recorder.computes if start <= c.start < end]
    return _window_metrics(recorder, stats, start, end, tokens, tokens / concurrency, fetches, groups)


def _window_metrics(
    recorder: Recorder,
    stats: Any,
    start: float,
    end: float,
    tokens: int,
    steps: float,
    fetches: int,
    groups: list[ComputeRecord],
) -> RunMetrics:
    """:class:`RunMetrics` of the window ``[start, end]``: busy times clipped to it, per step of
    ``steps``; ``tokens``, ``fetches`` and ``groups`` as the caller counted them; the cache's
    hits, misses and prefetches as ``stats`` holds them."""
    makespan = end - start
    compute = clip(union([(c.start, c.end) for c in recorder.computes]), start, end)
    link = clip(union([(f.start, f.end) for f in recorder.fetches]), start, end)
    compute_busy, link_busy = total(compute), total(link)
    both = intersection_total(compute, link)
    per_step = 1.0 / steps
    lower_bound = max(compute_busy, link_busy) * per_step
    step_time = makespan * per_step
    sizes = Counter(c.size for c in groups)
    frac = (lambda x: x / makespan) if makespan > 0 else (lambda x: 0.0)
    return RunMetrics(
        tokens=tokens,
        steps=steps,
        makespan_s=makespan,
        tokens_per_s=tokens / makespan if makespan > 0 else float("inf"),
        step_time_s=step_time,
        compute_s=compute_busy * per_step,
        fetch_s=link_busy * per_step,
        lower_bound_s=lower_bound,
        bound_ratio=step_time / lower_bound if lower_bound > 0 else float("nan"),
        overlap_fraction=frac(both),
        compute_wait_fraction=frac(makespan - compute_busy),
        link_only_fraction=frac(link_busy - both),
        compute_only_fraction=frac(compute_busy - both),
        idle_fraction=frac(makespan - compute_busy - link_busy + both),
        hits=stats.hits,
        misses=stats.misses,
        fetches=fetches,
        fetches_per_step=fetches * per_step,
        prefetches=stats.prefetches,
        wasted_prefetches=stats.wasted_prefetches,
        evictions=stats.evictions,
        groups=len(groups),
        mean_group_size=sum(c.size for c in groups) / max(1, len(groups)),
        group_sizes=dict(sorted(sizes.items())),
    )
