"""The paper's Algorithm 1, as pure code: which group computes next, which job's experts fetch next.

NOTE (Algorithm 1 of the paper):
- ``SELECT_COMPUTE_GROUP(J_R) = {j in J_R | l(j) = l_min}``: one batch of every ready job at the
  lowest ready layer (*opportunistic layerwise grouping*; *lowest-layer-first*). Without a step
  barrier, "lowest" means least progress ``(step, layer)``, and jobs at that layer group across steps.
- ``SELECT_FETCH_JOB(J_B) = argmin_{j in J_B} (l(j), m(j))``: the blocked job at the lowest layer,
  then the one with the fewest remaining missing experts (*SRTF*).
The ablations swap the compute order (``fifo``), the fetch order (``global-srtf``: ``m(j)`` alone;
``fifo``: blocking order) or the grouping (``static:K:K:...``: fixed groups of request lanes that
always compute together, the baseline of the paper's C1; ``sync`` is one static group of all).

Beyond the paper, ``bottleneck`` grouping (:meth:`ComputeQueue.plan`; the rule itself is
:func:`runahead.bottleneck.weigh_hold`) may hold the opportunistic group back until jobs of the same
layer whose fetches are landing join it, when that saves more compute than the wait idles and the
link has enough revealed work to stay busy meanwhile (plain ``runahead`` uses it).

No ``await``, no I/O, no clock: the actors wrap these classes, and the tests drive them directly.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from runahead.bottleneck import (
    HOLD_LINK_SLACK,
    HOLD_MIN_COMPUTE_SHARE,
    HOLD_MIN_MEASURED_SHARE,
    HOLD_MIN_TAIL_SHARE,
    Hold,
    Outlook,
    PricedGroup,
    group_pricer,
    landing_order,
    landing_times,
    tail_waits,
    weigh_hold,
)
from runahead.cache import ExpertCache
from runahead.jobs import ExpertId, Group, Job
from runahead.landing import HOLD_LANDING_WINDOW, LANDED_AFTER_S, MergeSaving, imminent


class ComputeOrder(enum.Enum):
    LOWEST_LAYER = "lowest-layer"
    FIFO = "fifo"


class FetchOrder(enum.Enum):
    LOWEST_LAYER_SRTF = "lowest-layer-srtf"
    GLOBAL_SRTF = "global-srtf"
    FIFO = "fifo"


@dataclass(frozen=True, slots=True)
class Grouping:
    """``opportunistic`` (not static, not bottleneck), ``bottleneck``, or static groups of request lanes.

    ``static`` with ``sizes=None`` is one group of every lane (``sync``). With sizes ``(2, 2, 2)``,
    lanes 0-1, 2-3 and 4-5 form the groups; further lanes repeat the pattern. ``bottleneck`` is
    opportunistic grouping that may hold a group back for jobs of its layer about to be ready.
    ``adaptive`` (with ``bottleneck``) also measures running ahead against one group of every lane
    and keeps the faster, on backends whose costs are measured (:mod:`runahead.mode`).
    """

    static: bool = False
    sizes: tuple[int, ...] | None = None
    bottleneck: bool = False
    adaptive: bool = False

    @classmethod
    def parse(cls, text: str) -> Grouping:
        """Parse ``opportunistic``, ``bottleneck``, ``adaptive``, ``static:all`` or ``static:K:K:...``."""
        if text == "opportunistic":
            return cls()
        if text == "bottleneck":
            return cls(bottleneck=True)
        if text == "adaptive":
            return cls(bottleneck=True, adaptive=True)
        parts = text.split(":")
        if parts[0] != "static" or len(parts) < 2:
            raise ValueError(
                f"grouping {text!r}: expected 'opportunistic', 'bottleneck', 'adaptive', 'static:all' "
                "or 'static:K:K:...'"
            )
        if parts[1:] == ["all"]:
            return cls(static=True)
        try:
            sizes = tuple(int(p) for p in parts[1:])
        except ValueError:
            raise ValueError(f"grouping {text!r}: group sizes must be integers") from None
        if any(s < 1 for s in sizes):
            raise ValueError(f"grouping {text!r}: group sizes must be >= 1")
        return cls(static=True, sizes=sizes)

    def group_of_lane(self, lane: int) -> int:
        """The static group a request lane belongs to."""
        if self.sizes is None:
            return 0
        total = sum(self.sizes)
        offset = lane % total
        for index, bound in enumerate(itertools.accumulate(self.sizes)):
            if offset < bound:
                return (lane // total) * len(self.sizes) + index
        raise AssertionError("unreachable")

    def __str__(self) -> str:
        if not self.static:
            return "adaptive" if self.adaptive else "bottleneck" if self.bottleneck else "opportunistic"
        return "static:" + ("all" if self.sizes is None else ":".join(map(str, self.sizes)))


class ComputeQueue:
    """The ready jobs ``J_R`` and the choice of the next group to compute."""

    def __init__(self, order: ComputeOrder, grouping: Grouping) -> None:
        self.order = order
        self.grouping = grouping
        self._ready: dict[int, tuple[tuple[int, ...], int, Job]] = {}  # request -> (rank, arrival, job)
        self._seq = itertools.count()
        self._group_of: dict[int, int] = {}  # lane -> its static group, worked out once

    def __len__(self) -> int:
        return len(self._ready)

    def add(self, job: Job) -> None:
        """``job`` has every expert resident (pinned) and may compute."""
        self.add_all((job,))

    def add_all(self, jobs: Iterable[Job]) -> None:
        """:meth:`add` each of ``jobs`` in turn (a ``Ready`` message's: one call, not one a job)."""
        ready, seqs, fifo = self._ready, self._seq, self.order is ComputeOrder.FIFO
        for job in jobs:
            request = job.request
            if request in ready:
                raise RuntimeError(f"request {request} already has a ready job")
            seq = next(seqs)
            ready[request] = ((seq,) if fifo else (job.epoch, job.layer, seq), seq, job)

    def discard(self, request: int) -> Job | None:
        """Drop a request's ready job (cancellation); return it if there was one."""
        entry = self._ready.pop(request, None)
        return None if entry is None else entry[2]

    def select_group(
        self, positions: Mapping[int, tuple[int, int]], lanes: Mapping[int, int]
    ) -> Group | None:
        """Remove and return the next group, or None if no group may compute now.

        ``positions`` maps every active request that has a job in flight (ready, blocked or
        computing; not one held at the step barrier) to its progress ``(epoch, layer)``;
        ``lanes`` maps every active request to its lane. Only static grouping needs them.
        """
        ready = self._ready
        if not ready:
            return None
        members = self._static_candidate(positions, lanes) if self.grouping.static else self._lowest()
        return self._take(members) if members else None

    def _lowest(self) -> list[tuple[tuple[int, ...], int, Job]]:
        """The ready entries of the lowest-ranked ready job's layer (the opportunistic group)."""
        ready = self._ready
        layer = min(ready.values(), key=_rank_of)[2].layer
        return [entry for entry in ready.values() if entry[2].layer == layer]

    def _take(self, members: list[tuple[tuple[int, ...], int, Job]]) -> Group:
        """Remove ``members`` from the ready jobs: one group, in order of arrival."""
        members.sort(key=_arrival_of)
        ready = self._ready
        for _, _, job in members:
            del ready[job.request]
        return Group(members[0][2].layer, tuple([job for _, _, job in members]))

    def plan(
        self, positions: Mapping[int, tuple[int, int]], lanes: Mapping[int, int], outlook: Outlook | None
    ) -> Group | Hold | None:
        """The next group, a :class:`Hold` (wait for jobs about to be ready), or None (nothing ready).

        Without ``bottleneck`` grouping, or without an ``outlook``, this is :meth:`select_group`.
        With it, the opportunistic group may be held back for blocked jobs of its layer, as
        :func:`weigh_hold` decides, while the compute unit is near enough to the bottleneck:
        ``compute_share >= HOLD_MIN_COMPUTE_SHARE`` (``HOLD_MIN_MEASURED_SHARE`` with measured costs),
        or ``HOLD_MIN_TAIL_SHARE`` at the tail layer
        (``outlook.tail_layer``: its reveals give the link nothing before the step barrier). Before
        that, where the outlook knows when reads in flight land (``outlook.lands``: a modelled link),
        it is held for a blocked job of its layer or a lower one about to be ready (:func:`imminent`),
        below the gates too, and at or above ``HOLD_MIN_COMPUTE_SHARE`` also for one whose merge
        with the group pays for the wait (:class:`runahead.landing.MergeSaving`). And first of all,
        a tail group waits while a job of its step is behind it, where the costs are a model
        (:func:`tail_waits`). Every hold ends ``LANDED_AFTER_S`` after the landing it waits for. The
        caller gives an outlook only at a share :func:`may_hold` allows. A group returned is the
        opportunistic one.
        """
        ready = self._ready
        if ready and outlook is not None and self.grouping.bottleneck and outlook.blocked:
            entries = self._lowest()
            layer, members = entries[0][2].layer, [entry[2] for entry in entries]
            # a prefill wave before the last reveals its next wave's experts: not a tail group
            tail = layer == outlook.tail_layer and not any(job.remaining for job in members)
            if tail and not outlook.measured:  # the tail waits for its step (tail_waits)
                until = tail_waits(outlook, members)
                if until is not None:
                    return Hold(until + LANDED_AFTER_S)
            # the ready group is priced once for the decision, where it is first needed
            pricer = group_pricer(outlook.pricer, outlook.group_s)
            priced = PricedGroup(members, pricer)
            if outlook.lands is not None:  # a job of this layer or a lower one about to be ready
                window = HOLD_LANDING_WINDOW * outlook.fetch_s
                # near enough the compute bottleneck, also a job whose merge pays for the wait
                saving = (
                    MergeSaving(members, outlook.group_s, priced.seconds)
                    if outlook.compute_share >= HOLD_MIN_COMPUTE_SHARE
                    else None
                )
                until = imminent(
                    outlook.now, layer, outlook.blocked, outlook.resident, outlook.lands, window, saving
                )
                if until is not None:
                    return Hold(until + LANDED_AFTER_S)
            below = HOLD_MIN_MEASURED_SHARE if outlook.measured else HOLD_MIN_COMPUTE_SHARE
            gate = HOLD_MIN_TAIL_SHARE if tail else below
            same = [job for job in outlook.blocked if job.layer == layer]
            if same and outlook.compute_share >= gate:
                landing, link_free_at = landing_times(
                    outlook.now, outlook.blocked, outlook.resident, outlook.in_flight, outlook.fetch_s
                )
                waiting = sorted(((landing[job.request], job) for job in same), key=landing_order)
                deadline = weigh_hold(
                    outlook.now,
                    members,
                    waiting,
                    link_free_at,
                    outlook.group_s,
                    tail=tail,
                    pricer=pricer,
                    slack=0.0 if outlook.measured else HOLD_LINK_SLACK,
                    priced=priced,
                ).deadline
                if deadline is not None:  # when the job it waits for should land: just after
                    return Hold(deadline + LANDED_AFTER_S)
            return self._take(entries)  # the opportunistic group, as select_group would take it
        return self.select_group(positions, lanes)

    def _static_candidate(
        self, positions: Mapping[int, tuple[int, int]], lanes: Mapping[int, int]
    ) -> list[tuple[tuple[int, ...], int, Job]]:
        """Static groups wait for every member at the group's least progress to be ready.

        Runs at every decision, over every active request: the per-request work is done by C
        iterators (``filter``, ``map``, ``compress``), and ``sync`` (one group) needs no grouping.
        """
        members: Iterable[list[int]]
        if self.grouping.sizes is None:  # one group of every lane not held at the step barrier
            members = [list(filter(positions.__contains__, lanes))]
        else:
            by_group: dict[int, list[int]] = {}
            group_of = self._group_of
            for request, lane in lanes.items():
                if request not in positions:
                    continue  # held at the step barrier
                group = group_of.get(lane)
                if group is None:
                    group = group_of[lane] = self.grouping.group_of_lane(lane)
                requests = by_group.get(group)
                if requests is None:
                    by_group[group] = [request]
                else:
                    requests.append(request)
            members = by_group.values()
        ready = self._ready
        candidates: list[list[tuple[tuple[int, ...], int, Job]]] = []
        for requests in members:
            if not requests:
                continue
            progress = list(map(positions.__getitem__, requests))
            laggards = list(itertools.compress(requests, map(min(progress).__eq__, progress)))
            if all(map(ready.__contains__, laggards)):
                candidates.append(list(map(ready.__getitem__, laggards)))
        if not candidates:
            return []
        return min(candidates, key=lambda members: min(entry[0] for entry in members))


_rank_of = operator.itemgetter(0)  # of a ready entry (rank, arrival, job)
_arrival_of = operator.itemgetter(1)


@dataclass(slots=True)
class _Blocked:
    seq: int
    job: Job
    unstarted: list[ExpertId]  # missing experts no read has started for, in gate order
    remaining: int  # m(j): missing experts not yet resident
    rank: tuple[int, ...] = ()  # the fetch order's key, kept current as ``remaining`` shrinks


class FetchQueue:
    """The blocked jobs ``J_B`` and the choice of the next expert to fetch.

    The fetcher reports every read it starts and every read that lands (demand or prefetch), so
    ``m(j)`` and each job's not-yet-started experts stay current without rescanning the cache.
    A job leaves the queue once a read has started for every one of its missing experts. Each
    job's rank is rebuilt when its ``m(j)`` changes, so a choice is one C-level ``min``. Experts
    are :data:`ExpertId` here, as in the cache's hot path.
    """

    def __init__(self, order: FetchOrder) -> None:
        self.order = order
        self._rank = _FETCH_RANKS[order]
        self._blocked: dict[int, _Blocked] = {}
        self._by_key: dict[ExpertId, list[int]] = {}  # missing expert -> blocked requests
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._blocked)

    def add(self, job: Job, missing: Iterable[ExpertId], cache: ExpertCache) -> None:
        """``job`` waits for ``missing`` experts (not resident; some may already be on their way)."""
        missing = tuple(missing)
        unstarted = list(filter(cache.is_wanted_id, missing))
        if not unstarted:
            return
        blocked = self._blocked[job.request] = _Blocked(next(self._seq), job, unstarted, len(missing))
        blocked.rank = self._rank(blocked)
        by_key = self._by_key
        for key in missing:
            waiting = by_key.get(key)
            if waiting is None:
                by_key[key] = [job.request]
            else:
                waiting.append(job.request)

    def discard(self, request: int) -> None:
        """Forget a request's blocked job (it was cancelled, or it ended)."""
        blocked = self._blocked.pop(request, None)
        if blocked is None:
            return
        for key in blocked.job.ids:
            waiting = self._by_key.get(key)
            if waiting is not None and request in waiting:
                waiting.remove(request)
                if not waiting:
                    del self._by_key[key]

    def started(self, key: ExpertId) -> None:
        """A read of ``key`` began: no blocked job needs to start it again."""
        for request in self._by_key.get(key, ()):
            blocked = self._blocked.get(request)
            if blocked is not None and key in blocked.unstarted:
                blocked.unstarted.remove(key)
                if not blocked.unstarted:
                    del self._blocked[request]

    def failed(self, key: ExpertId) -> None:
        """The read of ``key`` failed for good: the jobs waiting on it are failed by the issuer."""
        self._by_key.pop(key, None)

    def landed(self, key: ExpertId) -> None:
        """``key`` became resident: every job waiting on it has one fewer missing expert."""
        for request in self._by_key.pop(key, ()):
            blocked = self._blocked.get(request)
            if blocked is not None:
                blocked.remaining -= 1
                blocked.rank = self._rank(blocked)

    def select(self, cache: ExpertCache) -> ExpertId | None:
        """SELECT_FETCH_JOB, then that job's first expert no read has started for; None if none.

        The cache decides what is still wanted. A job cancelled after it blocked has its pins
        released by the JobIssuer at once, but the ExpertFetcher hears of it (``Forget``) a moment
        later; meanwhile its experts nobody else pins are no longer ``WANTED``. Those are dropped
        here, never read.
        """
        while self._blocked:
            best = min(self._blocked.values(), key=_rank_of_blocked)
            unstarted = best.unstarted
            while unstarted:
                if cache.is_wanted_id(unstarted[0]):
                    return unstarted[0]
                unstarted.pop(0)  # stale: its job went away
            self.discard(best.job.request)
        return None


_rank_of_blocked = operator.attrgetter("rank")


def _lowest_layer_srtf(blocked: _Blocked) -> tuple[int, ...]:
    job = blocked.job
    return (job.epoch, job.layer, blocked.remaining, blocked.seq)


def _global_srtf(blocked: _Blocked) -> tuple[int, ...]:
    return (blocked.remaining, blocked.seq)


def _blocking_order(blocked: _Blocked) -> tuple[int, ...]:
    return (blocked.seq,)


_FETCH_RANKS = {
    FetchOrder.LOWEST_LAYER_SRTF: _lowest_layer_srtf,
    FetchOrder.GLOBAL_SRTF: _global_srtf,
    FetchOrder.FIFO: _blocking_order,
}


class PrefetchQueue:
    """Prefetch hints, at most one per request (a newer hint replaces an older, now stale one).

    Served lowest progress first, only for experts the cache knows nothing of: a wanted expert is
    the demand queue's, a pending or resident one needs no read.
    """

    def __init__(self) -> None:
        self._hints: dict[int, tuple[tuple[tuple[int, int], int], tuple[ExpertId, ...]]] = {}

    def __len__(self) -> int:
        return len(self._hints)

    def add(self, request: int, progress: tuple[int, int], keys: Iterable[ExpertId]) -> None:
        """Hint that ``request`` will need ``keys`` at ``progress``; replaces its older hint."""
        hint = tuple(keys)
        if hint:
            self._hints[request] = ((progress, request), hint)
        else:
            self._hints.pop(request, None)

    def discard(self, request: int) -> None:
        self._hints.pop(request, None)

    def select(self, cache: ExpertCache) -> tuple[ExpertId, int] | None:
        """The next expert to prefetch and the request it is predicted for, or None: lowest
        progress first (then request id)."""
        hints = self._hints
        while hints:
            (_, request), keys = min(hints.values(), key=_rank_of)
            for key in keys:
                if cache.state_id(key) is None:
                    return key, request
            del hints[request]
        return None


class StepBarrier:
    """Holds each token's entry job until every request of the current round finished its token.

    With the barrier on (the paper's setting), step ``t+1`` starts for all requests together; new
    requests join at the next round. Released jobs carry the round number as their ``epoch``.
    Off, entry jobs pass through at once, unchanged.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.round = -1
        self._members: set[int] = set()
        self._held: list[Job] = []

    def arrive(self, jobs: Iterable[Job]) -> list[Job]:
        """New requests' entry jobs; returns the jobs released now."""
        jobs = list(jobs)
        if not self.enabled:
            return jobs
        self._held.extend(jobs)
        return self._release() if not self._members else []

    def token_done(self, request: int, next_job: Job | None) -> list[Job]:
        """``request`` finished its token; ``next_job`` is its next entry job (None if it ended)."""
        if not self.enabled:
            return [] if next_job is None else [next_job]
        self._members.discard(request)
        if next_job is not None:
            self._held.append(next_job)
        return self._release() if not self._members else []

    def forget(self, request: int) -> list[Job]:
        """Drop a cancelled request; returns the jobs its leaving releases."""
        self._members.discard(request)
        self._held = [job for job in self._held if job.request != request]
        return self._release() if self.enabled and not self._members and self._held else []

    def is_held(self, request: int) -> bool:
        return any(job.request == request for job in self._held)

    def _release(self) -> list[Job]:
        self.round += 1
        released = [job.at_epoch(self.round) for job in self._held]
        self._held = []
        self._members = {job.request for job in released}
        return released
