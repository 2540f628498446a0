"""A floor under the time of any grouping without prediction: the overlap relaxation (issue 11).

NOTE (the argument). With the step barrier on, a decode step computes every request's entry job and
then one job per layer in order, a job's experts known only once the job before it has computed.
Take any schedule of a step and, for each *level* (the entry jobs, then each layer), whether it
computed the level's jobs as one group (*whole*) or in two or more groups (*split*):

* compute: a whole level costs ``g(all)``; a split one at least the least sum of two groups over
  every way to cut the level in two, for a cost where merging two groups never costs more (the
  cost model's: the shared weights and the overheads once, an expert both need once, the roofline's
  ``max`` of sums at most the sum of ``max``);
* link: while a whole level's group computes, every request is at that level: every read revealed
  so far has landed and none of the next level is revealed yet, so the link idles for ``g(all)``.
  The step's first group (entry jobs: nothing is revealed before it ends) and its last (last layer:
  every read has landed, every other job is done) idle the link as well, each for at least the
  cheapest one-job group of its level. These are different groups, so their times add up; a read
  revealed by a group's end moves its first byte a read latency later (``latency_s``), counted
  only where the next level must read an expert: its jobs then start no sooner, so the latency
  never overlaps a later whole level's idle time (with nothing to read it would, and counting it
  twice would lift the floor above schedules that exist).

So a step takes at least ``max(compute, reads + idle)`` for the schedule's choices, and at least
the least of that over every choice. :func:`floor` takes the least over *fractional* choices (a
linear relaxation: lower still, so still a floor), solved greedily. Steps pool: the sum of each
step's ``max`` is at least the ``max`` of the sums, so a run's levels can be passed together with
its total reads. Any fetch order, any cache: only the schedule's link busy time (``reads_s``) enters.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

from runahead.jobs import ENTRY_LAYER, ExpertKey, Job

if TYPE_CHECKING:
    from runahead.bound import SmallCase

GroupSeconds = Callable[[Sequence[Job]], float]


@dataclass(frozen=True, slots=True)
class Level:
    """One level of one step: ``whole`` is ``g(all)``; ``split`` the least cost of two or more groups
    (``inf`` for a single job: it cannot be split); ``idle_whole`` and ``idle_split`` the link idle
    each forces (see the module NOTE: ``whole`` plus the read latency before the next level's first
    read can move, or for a split level 0, but at the step's first and last levels)."""

    whole: float
    split: float
    idle_whole: float
    idle_split: float = 0.0


def level(
    jobs: Sequence[Job],
    group_s: GroupSeconds,
    *,
    first: bool = False,
    last: bool = False,
    latency_s: float = 0.0,
) -> Level:
    """The :class:`Level` of ``jobs`` (one level's jobs of one step) at ``group_s``'s costs.

    ``split`` tries every way to cut the jobs in two (``2 ** (n - 1) - 1`` of them: meant for up to
    ~10 jobs). ``first`` and ``last`` mark the step's entry and last levels; ``latency_s`` is the
    time from a read's start to its first byte, to pass only where the next level must read an
    expert (the module NOTE; after the step's last level nothing is read).
    """
    if not jobs:
        raise ValueError("a level needs at least one job")
    whole = group_s(jobs)
    split = math.inf
    head, rest = jobs[0], list(jobs[1:])
    for size in range(len(rest)):  # ``head`` and ``size`` others against the remaining ones
        for chosen in combinations(range(len(rest)), size):
            picked = set(chosen)
            one = [head, *(rest[i] for i in chosen)]
            other = [job for i, job in enumerate(rest) if i not in picked]
            split = min(split, group_s(one) + group_s(other))
    reveal = 0.0 if last else latency_s
    cheapest = min(group_s([job]) for job in jobs) if first or last else 0.0
    return Level(whole, split, whole + reveal, cheapest + reveal if first else cheapest)


def floor(levels: Iterable[Level], reads_s: float) -> float:
    """The least time over every (fractional) whole/split choice of ``levels``: at least
    ``max(compute, reads_s + link idle)`` whatever the choice (see the module NOTE)."""
    return relax(levels).floor(reads_s)


@dataclass(frozen=True, slots=True)
class Relaxed:
    """Levels prepared for :meth:`floor`: every level split (``compute``, ``idle``) and the trades
    ``(saves, costs)`` that make one whole, best first."""

    compute: float
    idle: float
    trades: tuple[tuple[float, float], ...]

    def floor(self, reads_s: float, compute_s: float = 0.0) -> float:
        """:func:`floor` of these levels, with ``compute_s`` more compute that no choice changes.

        All split is the start (compute ``sum(split)``, link ``reads_s + sum(idle_split)``); making a
        level whole lowers compute by ``split - whole`` and raises the link side by ``idle_whole -
        idle_split``. The optimum takes levels by that ratio, the last one in part, until the two
        sides meet.
        """
        compute, link = self.compute + compute_s, reads_s + self.idle
        for saves, costs in self.trades:
            if compute <= link:
                break
            if compute - saves >= link + costs:
                compute, link = compute - saves, link + costs
            else:  # the sides meet inside this level's trade
                part = (compute - link) / (saves + costs)
                return compute - saves * part
        return max(compute, link)


def relax(levels: Iterable[Level]) -> Relaxed:
    """``levels`` prepared for :meth:`Relaxed.floor` (a level that cannot split is always whole)."""
    compute, idle = 0.0, 0.0
    trades = []
    for item in levels:
        if item.whole > item.split + 1e-15:
            raise ValueError(f"a level's whole group ({item.whole}) costs more than its split ({item.split})")
        if math.isinf(item.split):  # a single job: always whole
            compute += item.whole
            idle += item.idle_whole
            continue
        compute += item.split
        idle += item.idle_split
        trades.append((item.split - item.whole, item.idle_whole - item.idle_split))
    trades.sort(key=lambda t: -t[0] / t[1] if t[1] > 0 else -math.inf)
    return Relaxed(compute, idle, tuple(trades))


def case_levels(case: SmallCase, step: int) -> list[Level]:
    """The levels of one step of a :class:`runahead.bound.SmallCase`: its entry jobs, then each layer
    (a read's latency after a level where the next one reads an expert: one neither resident nor
    needed at an earlier step, as the case's model reads each missing expert once)."""
    requests = range(case.requests)
    earlier = {
        ExpertKey(layer, e)
        for r in requests
        for before in case.selections[r][:step]
        for layer, row in enumerate(before)
        for e in row
    }
    jobs = [
        [Job(r, step, layer, case.selections[r][step][layer], lane=r, epoch=step) for r in requests]
        for layer in range(case.layers)
    ]
    reads = [
        any(key not in case.resident and key not in earlier for job in row for key in job.keys)
        for row in jobs
    ]
    latency = [case.latency_s if read else 0.0 for read in reads]
    entry = [Job(r, step, ENTRY_LAYER, lane=r, epoch=step) for r in requests]
    levels = [level(entry, case.group_s, first=True, latency_s=latency[0])]
    for layer, row in enumerate(jobs):
        last = layer == case.layers - 1
        levels.append(level(row, case.group_s, last=last, latency_s=0.0 if last else latency[layer + 1]))
    return levels


def case_floor(case: SmallCase) -> float:
    """:func:`floor` of a :class:`runahead.bound.SmallCase` (its model reads each missing expert once)."""
    levels = [item for step in range(case.steps) for item in case_levels(case, step)]
    missing = {
        key
        for r in range(case.requests)
        for step in range(case.steps)
        for layer in range(case.layers)
        for key in Job(r, step, layer, case.selections[r][step][layer]).keys
        if key not in case.resident
    }
    return floor(levels, len(missing) * case.fetch_s)
