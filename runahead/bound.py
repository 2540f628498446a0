"""The best schedule reachable without prediction on a small case, by branch and bound.

NOTE (the model). At 2-4 requests no schedule reaches the overlap limit ``(C + F) / max(C, F)``:
overlap needs split groups, and each split group reads the shared weights again. This module
finds what *is* reachable on a short trace, so a grouping's gain can be stated as a share of it.
The model is the runtime's, made small and exact:

* each request runs its jobs in order (entry job, then one job per layer, per step), a job's
  experts known only once the job before it has computed (no prediction); a step barrier holds
  every request's next token until all finished the current one;
* an expert is missing unless it is in the (fixed) resident set or was read earlier in the case
  (the cache is large enough that nothing read is evicted within it); the link is the sim
  backend's (:class:`runahead.landing.LinkModel`): up to ``queue_depth`` reads in flight, each
  chosen in ``SELECT_FETCH_JOB`` order when it is issued (when it is revealed, or when a read
  lands and frees its worker), carried one at a time for ``fetch_s``, no sooner than
  ``latency_s`` after its issue; an expert two jobs need is read once. The defaults (one read in
  flight, no latency) are the model's first link, where a read is chosen only when the link
  frees: with hindsight a schedule can do no better on any link, so the bound on it is a bound
  for every link of that pace;
* a group is every ready job of one layer that the schedule chooses; it costs ``group_s(jobs)``.

A schedule decides, each time the compute unit is free and a job is ready, which layer's ready
jobs to compute, or to wait for the next job to become ready. :mod:`runahead.bound_search`
searches every such decision for the shortest makespan; :func:`run_policy` plays a grouping rule of
:mod:`runahead.scheduling` through the same model, so the two compare like with like, and
:func:`pilot_schedule` improves on a rule by playing it out from every option.
Grouping only: the search does not choose fetch order, and it never splits one layer's ready jobs.
"Without prediction" says what a schedule does (no read before its job is revealed), not how it was
found: the search and the pilot choose with the whole case's routing in view, which no runtime has;
:mod:`runahead.bound_online` plays the pilot method without that hindsight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from runahead.bottleneck import Hold, Outlook, may_hold
from runahead.jobs import ENTRY_LAYER, ExpertId, ExpertKey, Group, Job, expert_id
from runahead.scheduling import ComputeOrder, ComputeQueue, Grouping

GroupSeconds = Callable[[Sequence[Job]], float]


@dataclass(frozen=True, slots=True)
class SmallCase:
    """A short trace: ``selections[request][step][layer]``, what is resident, and the costs."""

    selections: Sequence[Sequence[Sequence[tuple[int, ...]]]]
    resident: frozenset[ExpertKey]
    fetch_s: float
    group_s: GroupSeconds
    measured: bool = False
    """The costs are a real backend's, measured: the bottleneck rule plays as it does there
    (``Outlook.measured``); the search and the floor do not depend on it."""
    latency_s: float = 0.0
    """From a read's issue to the earliest its transfer starts (the profile's ``link_latency_s``)."""
    queue_depth: int = 1
    """Reads in flight at once (the profile's ``link_queue_depth``)."""

    def __post_init__(self) -> None:
        if self.fetch_s <= 0 or self.latency_s < 0:
            raise ValueError(
                f"a case's link needs fetch_s > 0 and latency_s >= 0: {self.fetch_s}, {self.latency_s}"
            )
        if self.queue_depth < 1:
            raise ValueError(f"a case's link needs queue_depth >= 1, got {self.queue_depth}")

    @property
    def requests(self) -> int:
        return len(self.selections)

    @property
    def steps(self) -> int:
        return len(self.selections[0])

    @property
    def layers(self) -> int:
        return len(self.selections[0][0])


@dataclass(slots=True)
class _State:
    """Where a schedule stands when the compute unit is free (``now``).

    Experts are bits (:attr:`_Model.keys` names them): the search copies and compares states
    millions of times, and an int copies, hashes and intersects in one C call.
    """

    now: float
    jobs: dict[int, Job]  # each request's current job (absent: at the barrier, or finished), in
    # the order they were revealed: the fetch order's last tie-break, as the JobIssuer blocks them
    ready: dict[int, None]  # the requests whose job is ready, in the order they became ready
    held: list[int]  # finished the step, waiting at the barrier, in the order they came
    landed: int = 0  # experts read during the case (the resident set is the case's)
    requested: int = 0  # landed, or being read
    in_flight: tuple[tuple[int, float], ...] = ()  # the reads issued (bit, when it lands), in order
    link_free: float = 0.0  # when the link finishes the last read issued
    fresh: int = 0  # of ``in_flight``, the last reads issued by the reveal at ``now`` (see _play)
    step: int = 0
    link_busy: float = 0.0
    compute_busy: float = 0.0
    computed: int = 0
    reads: int = 0
    trail: _Trail = None  # the groups so far, newest first: (earlier, (start, layer, requests))

    def copy(self) -> _State:
        return _State(
            self.now,
            dict(self.jobs),
            dict(self.ready),
            list(self.held),
            self.landed,
            self.requested,
            self.in_flight,
            self.link_free,
            self.fresh,
            self.step,
            self.link_busy,
            self.compute_busy,
            self.computed,
            self.reads,
            self.trail,
        )


_Trail = tuple["_Trail", tuple[float, int, tuple[int, ...]]] | None


def _groups(trail: _Trail) -> tuple[tuple[float, int, tuple[int, ...]], ...]:
    """A trail's groups, oldest first."""
    groups = []
    while trail is not None:
        trail, group = trail
        groups.append(group)
    return tuple(reversed(groups))


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule's makespan, busy times and groups ``(start, layer, requests)``."""

    makespan: float
    compute_s: float
    fetch_s: float
    """The link's transfer time: reads times the case's ``fetch_s`` (no latency)."""
    groups: tuple[tuple[float, int, tuple[int, ...]], ...]
    explored: int = 0


def sync_link_s(sync: Schedule) -> float:
    """The link time of sync's schedule as the sim's rows count it: the union of its reads' spans,
    each from its issue to its landing, latency included (:func:`runahead.metrics.summarize`).

    Sync computes every request's job of a layer as one group, so it never computes while a read
    is in flight, and never idles with none in flight: that union is its makespan less its compute.
    The overlap limit of the issues and figures is ``(compute + this) / max(compute, this)``
    (:func:`runahead.metrics.overlap_limit`). With ``fetch_s`` (transfers alone) instead, the limit
    would not be the one the sim's rows report, while every speedup over sync would still count the
    latency sync pays. (Neither is a bound on a speedup: running ahead can hide one read's latency
    under other reads, which sync cannot.)
    """
    return sync.makespan - sync.compute_s


class _Model:
    """The small case's dynamics: reads, readiness, groups, the barrier.

    Per-job facts are tables built once, indexed ``[request][step][layer + 1]`` (0: the entry
    job): the job itself, its missing experts in the order it names them (bits) and as a mask.
    """

    def __init__(self, case: SmallCase, *, lowest_first: bool = False) -> None:
        self.case = case
        self.last = case.layers - 1
        self.lowest_first = lowest_first  # offer only the lowest ready layer (and waiting)
        self.lanes = {r: r for r in range(case.requests)}  # each request its own lane (the rules' input)
        self._prepare()

    def start(self) -> _State:
        state = _State(0.0, {}, {}, [])
        for request in range(self.case.requests):
            state.jobs[request] = self._jobs[request][0][0]
            state.ready[request] = None
        return state

    def unlanded(self, state: _State, job: Job) -> int:
        """The experts ``job`` still waits for (a mask)."""
        return self._masks[job.request][job.step][job.layer + 1] & ~state.landed

    @staticmethod
    def blocked(state: _State) -> list[Job]:
        return [job for r, job in state.jobs.items() if r not in state.ready]

    def _next_read(self, state: _State) -> int | None:
        """``SELECT_FETCH_JOB`` (lowest progress, then fewest missing): its first expert not read."""
        best: tuple[tuple[int, int, int], Job, int] | None = None
        landed, requested, masks = state.landed, state.requested, self._masks
        for request, job in state.jobs.items():
            if request in state.ready:
                continue
            mask = masks[request][job.step][job.layer + 1]
            unread = mask & ~requested
            if unread:
                rank = (job.epoch, job.layer, (mask & ~landed).bit_count())
                if best is None or rank < best[0]:  # the first revealed of equals
                    best = (rank, job, unread)
        if best is None:
            return None
        _, job, unread = best
        return next(b for b in self._orders[job.request][job.step][job.layer + 1] if unread >> b & 1)

    def link_at(self, state: _State) -> float:
        """The earliest a read not yet issued can land, less its transfer: after the reads issued,
        and a latency after now."""
        return max(state.link_free, state.now + self.case.latency_s)

    def advance_link(self, state: _State, until: float) -> None:
        """Run the link to ``until``: issue reads, land them, mark the jobs that became ready.

        A worker issues a read at ``state.now`` (the last reveal) or when its own read lands.
        """
        case = self.case
        fetch_s, latency, depth = case.fetch_s, case.latency_s, case.queue_depth
        issue = state.now
        while True:
            while len(state.in_flight) < depth:
                bit = self._next_read(state)
                if bit is None:
                    break
                lands = state.link_free = max(issue + latency, state.link_free) + fetch_s
                state.requested |= 1 << bit
                state.in_flight += ((bit, lands),)
                state.link_busy += fetch_s
                state.reads += 1
            if not state.in_flight:
                return
            bit, lands = state.in_flight[0]
            if lands > until:
                return
            state.landed |= 1 << bit
            state.in_flight = state.in_flight[1:]
            issue = lands
            for request, job in state.jobs.items():  # in the order they were blocked
                if request not in state.ready and not self.unlanded(state, job):
                    state.ready[request] = None

    def compute(self, state: _State, layer: int) -> None:
        """Compute every ready job at ``layer`` as one group, then reveal what each needs next."""
        members = [r for r in state.ready if state.jobs[r].layer == layer]  # in the order they came
        jobs = [state.jobs[r] for r in members]
        requests = tuple(sorted(members))
        busy = self._level_cost(jobs[0].step, layer, requests)
        state.trail = (state.trail, (state.now, layer, requests))
        end = state.now + busy
        state.compute_busy += busy
        state.computed += len(jobs)
        self.advance_link(state, end)
        state.now = end
        for job in jobs:
            request = job.request
            del state.ready[request], state.jobs[request]
            if job.layer == self.last:
                state.held.append(request)
                continue
            nxt = state.jobs[request] = self._jobs[request][job.step][job.layer + 2]  # revealed last
            if not self.unlanded(state, nxt):
                state.ready[request] = None
        if not state.jobs:  # everyone reached the barrier
            state.step += 1
            if state.step < self.case.steps:
                for request in state.held:  # released in the order they came
                    state.jobs[request] = self._jobs[request][state.step][0]
                    state.ready[request] = None
                state.held.clear()
        issued = len(state.in_flight)
        self.advance_link(state, state.now)
        state.fresh = len(state.in_flight) - issued

    def wait(self, state: _State, until: float | None = None) -> bool:
        """Let time pass until the next job becomes ready (or ``until``); False if none can (then
        ``state`` is left as it was, but for the link's reads up to ``state.now``)."""
        count = len(state.ready)
        state.fresh = 0
        if until is not None and until <= state.now:
            until = None
        self.advance_link(state, state.now)
        while state.in_flight:
            lands = state.in_flight[0][1]
            if until is not None and lands > until:
                self.advance_link(state, until)
                state.now = until
                return True
            state.now = lands
            self.advance_link(state, lands)
            if len(state.ready) > count:
                return True
        return False

    def cache_view(self, state: _State) -> tuple[set[ExpertId], set[ExpertId]]:
        """What the runtime's cache would say (by id, as :class:`Outlook` asks): the resident experts
        (the case's and those landed) and those being read."""
        landed = {key for bit, key in enumerate(self.keys) if state.landed >> bit & 1}
        resident = set(map(expert_id, self.case.resident | landed))
        return resident, set(self.landings(state))

    def landings(self, state: _State) -> dict[ExpertId, float]:
        """When each read in flight lands, by id (the runtime's ``ModelledLink.landings``: the case's
        costs are a model, so the rule knows them), but those the reveal at ``now`` issued: the
        runtime's scheduler decides before its ExpertFetcher has heard of them."""
        seen = state.in_flight[: len(state.in_flight) - state.fresh]
        return {expert_id(self.keys[bit]): lands for bit, lands in seen}

    @staticmethod
    def done(state: _State) -> bool:
        return not state.jobs

    @staticmethod
    def result(state: _State, explored: int = 0) -> Schedule:
        return Schedule(state.now, state.compute_busy, state.link_busy, _groups(state.trail), explored)

    def _level_cost(self, step: int, layer: int, requests: tuple[int, ...]) -> float:
        """The cost of one group of ``requests``' jobs at ``layer`` of ``step`` (cached)."""
        key = (step, layer, requests)
        cost = self._costs.get(key)
        if cost is None:
            jobs = [self._jobs[r][step][layer + 1] for r in requests]
            cost = self._costs[key] = self.case.group_s(jobs)
        return cost

    def _prepare(self) -> None:
        """The job tables (each job, its missing experts as bits in the order it names them, and
        as a mask) and the cache of group costs."""
        case = self.case
        steps, levels = range(case.steps), range(ENTRY_LAYER, case.layers)
        picks = case.selections
        self._jobs = [
            [
                [
                    Job(r, step, layer, picks[r][step][layer] if layer >= 0 else (), lane=r, epoch=step)
                    for layer in levels
                ]
                for step in steps
            ]
            for r in range(case.requests)
        ]
        bits: dict[ExpertKey, int] = {}
        self._orders: list[list[list[tuple[int, ...]]]] = []  # a job's missing experts, as it names them
        for rows in self._jobs:
            self._orders.append([])
            for row in rows:
                orders = []
                for job in row:
                    missing = [key for key in dict.fromkeys(job.keys) if key not in case.resident]
                    orders.append(tuple(bits.setdefault(key, len(bits)) for key in missing))
                self._orders[-1].append(orders)
        self.keys = list(bits)  # bit i is expert keys[i]
        self._masks = [[[sum(1 << b for b in order) for order in row] for row in rs] for rs in self._orders]
        self._costs: dict[tuple[int, int, tuple[int, ...]], float] = {}

    def children(self, state: _State) -> Iterator[_State]:
        """The states each of :meth:`options` leads to (a wait nothing can end is left out)."""
        for choice in self.options(state):
            child = self.child(state, choice)
            if child is not None:
                yield child

    def child(self, state: _State, choice: int | None) -> _State | None:
        """The state ``choice`` (a layer to compute, or None: wait) leads to from ``state`` (left as
        it is); None for a wait nothing can end."""
        child = state.copy()
        if choice is None:
            return child if self.wait(child) else None
        self.compute(child, choice)
        return child

    def options(self, state: _State) -> list[int | None]:
        """The layers whose ready jobs may compute now, lowest first (only the lowest with
        ``lowest_first``), and None (wait) if useful."""
        layers = sorted({state.jobs[r].layer for r in state.ready})
        choices: list[int | None] = list(layers[:1] if self.lowest_first else layers)
        if self.blocked(state) and (state.in_flight or self._next_read(state) is not None):
            choices.append(None)
        return choices


def run_policy(case: SmallCase, grouping: Grouping) -> Schedule:
    """Play a grouping rule (opportunistic, bottleneck, static) through the small case's model."""
    model = _Model(case)
    return _play(model, model.start(), grouping)


def pilot_schedule(case: SmallCase, grouping: Grouping) -> Schedule:
    """A schedule at least as short as ``grouping``'s, found by the pilot method: at each decision,
    every option is followed by ``grouping`` to the end, and the option whose schedule ends first is
    taken (the first such: lowest layer, waiting last). Not a bound: a schedule reachable without
    prediction, for cases too big for :func:`best_schedule`. ``explored`` counts the schedules played.
    """
    model = _Model(case)
    state = model.start()
    best = _play(model, state.copy(), grouping)
    played = 1
    while not model.done(state):
        options = []
        for child in model.children(state):
            schedule = _play(model, child.copy(), grouping)
            played += 1
            if schedule.makespan < best.makespan - 1e-12:
                best = schedule
            options.append((schedule.makespan, child))
        state = min(options, key=_first)[1]
    return Schedule(best.makespan, best.compute_s, best.fetch_s, best.groups, played)


def _first(option: tuple[float, _State]) -> float:
    return option[0]


def rule_choice(model: _Model, state: _State, grouping: Grouping) -> Group | Hold | None:
    """What ``grouping`` decides at ``state`` (left as it is), as the runtime's scheduler would: a
    group to compute, a hold, or None (nothing ready)."""
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, grouping)
    queue.add_all([state.jobs[request] for request in state.ready])  # in the order they came
    positions = {r: job.progress for r, job in state.jobs.items()}
    return queue.plan(positions, model.lanes, _outlook(model, state))


def _play(model: _Model, state: _State, grouping: Grouping) -> Schedule:
    """Play ``grouping`` from ``state`` (changed in place) to the end of the case."""
    while not model.done(state):
        choice = rule_choice(model, state, grouping)
        if isinstance(choice, Group):
            model.compute(state, choice.layer)
        elif isinstance(choice, Hold):
            if not model.wait(state, choice.deadline):
                raise RuntimeError("a hold with nothing to wait for")
        elif not model.wait(state):
            raise RuntimeError(f"nothing ready and nothing to wait for at {state.now}")
    return model.result(state)


def _outlook(model: _Model, state: _State) -> Outlook | None:
    """What the runtime's scheduler would give the rule here (its ``_outlook``): None with nothing
    blocked, or at a share :func:`may_hold` refuses, the share being compute so far over the link
    time of the reads landed so far."""
    blocked = model.blocked(state)
    if not blocked:
        return None
    case = model.case
    landed = state.landed.bit_count() * case.fetch_s
    share = state.compute_busy / landed if landed else 1.0
    if not may_hold(share):
        return None
    resident, in_flight = model.cache_view(state)
    return Outlook(
        state.now,
        blocked,
        resident,
        in_flight,
        case.fetch_s,
        case.group_s,
        share,
        case.layers - 1,
        measured=case.measured,
        lands=None if case.measured else model.landings(state),
    )
