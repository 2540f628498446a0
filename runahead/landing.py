"""When the reads in flight should land, and which blocked jobs are about to be ready (issue 11).

Pure code: no clock, no I/O; times come in as arguments.

NOTE (why the rule waits a moment for a job about to be ready). Searched with hindsight in the
small-case model (docs/results-core.md, "Reads about to land"), the best schedule at 2 requests
where the rule was furthest from it (Mac/Gemma4) waits where bottleneck grouping computes: for a
microsecond or two, while the one read a job of the ready group's layer, or of a lower one, still
waits for lands. Computing the ready group first
pushes that job (a laggard, or a partner that would have joined the group) back by a whole group, so
its next reads reach the link a group later, or its layer is paid for twice. The rule's own model of
the link (:func:`runahead.bottleneck.landing_times`) cannot see such a wait: it prices a read in
flight as a whole read from now. A backend whose link is a cost model (the sim) says more: each read
takes ``transfer_s`` on a link that carries one at a time, ``latency_s`` after it starts
(:class:`LinkModel`, the sim backend's own arithmetic), so the runtime knows when each read in flight
lands. :func:`imminent` then names the moment to hold until, when every missing expert of such a job
is in flight and lands within :data:`HOLD_LANDING_WINDOW` of one read's link time. A real backend's
reads have no such model (their times are measured and drift): the rule does not wait for them.

NOTE (how long is "about to"). A fixed share of a read's link time was the first window. The pilot
method without hindsight (:mod:`runahead.bound_online`: each option followed by the rule on
completions of the routing drawn from the requests' history) showed where that misjudges: at 2
requests on the Thor (Qwen3.6), where a group's shared work is 80% of it and a read carries in
0.18 ms, it waits for the other request's last read whenever it lands within one transfer (~0.1-0.18
ms), while 0.3 reads is 0.05 ms; on the Mac (shared work 56% of a group, 0.35 ms a read) it waits as
the rule does. What the wait buys is the merge's saving, and what it costs is the compute unit's
idle and the reveals of every ready job pushed back, so the window is also priced by both: a job is
about to be ready when its reads land within :data:`HOLD_MERGE_SHARE` of the compute its merge with
the ready group saves (:class:`MergeSaving`), divided by the ready jobs whose reveals wait, while
the compute unit is near enough the bottleneck for the compute saved to count
(:data:`runahead.bottleneck.HOLD_MIN_COMPUTE_SHARE`, the hold rule's own gate).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import filterfalse

from runahead.jobs import ExpertId, Job

HOLD_LANDING_WINDOW = 0.3
"""How soon, in reads' link times, every missing expert of a blocked job at or below the ready
group's layer must land for the rule to wait for it. On the sim (both profiles and paper models,
chat, 2-16 requests, 30% cache) 0.3 was at or above the rule without it at every point (and at 10%
and 70% cache too), 0.5 fell 0.02% below at one, 1.0 lost up to 12% at 16 requests, 0.1 gained
about half as much."""

HOLD_MERGE_SHARE = 0.5
"""A blocked job at or below the ready group's layer whose reads land within this share of the
compute its merge with the group saves, per job of the group, is waited for too (module note). In
the small-case model at the sim's steady state (both profiles and paper models; 2 and 4 requests
over twelve steps, 8 over six) 0.4-0.7 gained at every concurrency, 0.3 lost the 2-request gain,
1.0 lost at Thor/Gemma4; without the per-job division 0.5 lost at 8 requests; below the hold rule's
compute-share gate it cost the sim 0.006% at Mac/Gemma4/8 (docs/results-core.md, "The pilot without
hindsight")."""

LANDED_AFTER_S = 1e-6
"""How long after the landing it waits for a hold for a job about to be ready ends. At the landing's
own instant the job is not ready yet: the read's worker, then the JobIssuer, then the scheduler
each take the news in turn, and a timer due at that instant wakes the scheduler first (virtual
time runs every callback of an instant before it moves on). A hold due a moment later ends with
the job's ``Ready`` instead. The moment is one tick of the sim's virtual clock
(:data:`runahead.clock.TICKS_PER_S`): a timer due less than a tick later fires in the landing's own
tick (1e-9 s did, once holds grew longer with :data:`HOLD_MERGE_SHARE`: tests/test_bound.py)."""


class LinkModel:
    """When each read in flight lands on a modelled link: one read at a time on the link, each
    ``transfer_s`` long and starting no sooner than ``latency_s`` after it was issued (what the sim
    backend charges a read: its ``fetch`` reports each read here as it starts and ends, so the two
    cannot drift apart). :attr:`lands` maps the ids in flight to their landing times."""

    def __init__(self, latency_s: float, transfer_s: float) -> None:
        if latency_s < 0 or transfer_s < 0:
            raise ValueError(f"a link needs latency and transfer >= 0 s: got {latency_s}, {transfer_s}")
        self.latency_s = latency_s
        self.transfer_s = transfer_s
        self.lands: dict[ExpertId, float] = {}
        self._free = 0.0  # when the link finishes the last read issued

    def started(self, expert: ExpertId, now: float) -> float:
        """A read of ``expert`` was issued at ``now``; return when it lands."""
        self._free = max(now + self.latency_s, self._free) + self.transfer_s
        self.lands[expert] = self._free
        return self._free

    def ended(self, expert: ExpertId) -> None:
        """The read of ``expert`` landed (or failed): it is no longer in flight."""
        self.lands.pop(expert, None)


def imminent(
    now: float,
    layer: int,
    blocked: Iterable[Job],
    resident: Container[ExpertId],
    lands: Mapping[ExpertId, float],
    window_s: float,
    saving: MergeSaving | None = None,
) -> float | None:
    """When to hold the ready group of ``layer`` until: the latest time a blocked job at ``layer`` or
    below becomes ready, over those whose every missing expert is in flight (in ``lands``) and lands
    by ``now + window_s``, or with ``saving`` (:class:`MergeSaving`) within what its merge with the
    ready group pays for (:meth:`MergeSaving.covers`); None if there is no such job (compute now, or
    ask the rule)."""
    limit, until = now + window_s, None
    for job in blocked:
        if job.layer > layer:
            continue
        # a prompt's job has tens of experts or more: stop reading them once it cannot qualify
        ready_at = last_landing(job, now, resident, lands, limit)
        if ready_at > limit:
            if saving is None or ready_at == math.inf:  # a read not started: no merge covers it
                continue
            longest = now + saving.longest_wait + _MARGIN_S  # what any merge could cover, and a margin
            if ready_at > longest:
                continue
            ready_at = last_landing(job, now, resident, lands, longest)
            if not saving.covers(job, ready_at - now):
                continue
        until = ready_at if until is None or ready_at > until else until
    return until


_MARGIN_S = 1e-9
"""How far past the longest wait a merge could cover :func:`imminent` reads a job's landings before
it stops: far above a time's float rounding (1e-14 s at 100 s), far below a read (1e-4 s), so every
job :meth:`MergeSaving.covers` would take is priced exactly."""


def last_landing(
    job: Job,
    now: float,
    resident: Container[ExpertId],
    lands: Mapping[ExpertId, float],
    beyond: float = math.inf,
) -> float:
    """When the last of ``job``'s missing experts (those not in ``resident``) lands: ``now`` if none
    is missing, ``inf`` if one is not in flight (not in ``lands``). With ``beyond``, it may stop at
    the first missing expert landing later than that (or not in flight) and return that time: any
    answer above ``beyond`` then says only that the job is not ready by ``beyond``."""
    ready_at, when = now, lands.get
    for expert in filterfalse(resident.__contains__, job.ids):
        at = when(expert, math.inf)
        if at > ready_at:
            if at > beyond:
                return at
            ready_at = at
    return ready_at


class MergeSaving:
    """The compute a blocked job's merge with the ready group (``members``) saves: ``g(ready) +
    g(job) - g(ready + job)``, the job priced at the group's layer (a laggard catches up first, then
    merges). A job is priced only when its reads land soon enough for the largest saving any merge
    could make (the ready group's own cost) to cover the wait."""

    def __init__(
        self,
        members: Sequence[Job],
        group_s: Callable[[Sequence[Job]], float],
        ready_s: Callable[[], float] | None = None,
    ) -> None:
        self.members = list(members)
        self.group_s = group_s
        self._ready_s = ready_s

    @functools.cached_property
    def most(self) -> float:
        """The ready group's cost (``ready_s()`` where the caller priced it already): no merge saves
        more (no group costs less than one of its parts)."""
        return self._ready_s() if self._ready_s is not None else self.group_s(self.members)

    def __call__(self, job: Job) -> float:
        layer = self.members[0].layer
        joined = job if job.layer == layer else replace(job, layer=layer)
        return self.most + self.group_s([joined]) - self.group_s([*self.members, joined])

    @property
    def longest_wait(self) -> float:
        """The longest wait any job's merge could cover: the share of :attr:`most`."""
        return HOLD_MERGE_SHARE / len(self.members) * self.most

    def covers(self, job: Job, wait_s: float) -> bool:
        """Whether a wait of ``wait_s`` for ``job`` lasts at most :data:`HOLD_MERGE_SHARE` of what
        its merge saves, per ready job (each one's reveals wait as long)."""
        return wait_s <= self.longest_wait and wait_s <= HOLD_MERGE_SHARE / len(self.members) * self(job)
