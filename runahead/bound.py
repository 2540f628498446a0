"""The best schedule reachable without prediction on a small case, by branch and bound.

NOTE (the model). At 2-4 requests no schedule reaches the overlap limit ``(C + F) / max(C, F)``:
overlap needs split groups, and each split group reads the shared weights again. This module
finds what *is* reachable on a short trace, so a grouping's gain can be stated as a share of it.
The model is the runtime's, made small and exact:

* each request runs its jobs in order (entry job, then one job per layer, per step), a job's
  experts known only once the job before it has computed (no prediction); a step barrier holds
  every request's next token until all finished the current one;
* an expert is missing unless it is in the (fixed) resident set or was read earlier in the case
  (the cache is large enough that nothing read is evicted within it); one read at a time holds
  the link ``fetch_s`` (no latency), served in ``SELECT_FETCH_JOB`` order; an expert two jobs
  need is read once;
* a group is every ready job of one layer that the schedule chooses; it costs ``group_s(jobs)``.

A schedule decides, each time the compute unit is free and a job is ready, which layer's ready
jobs to compute, or to wait for the next job to become ready. :func:`best_schedule` searches every
such decision (depth first, pruned by a lower bound: the remaining compute with every layer in one
group, and the remaining reads back to back; and by dominance: the same progress and reads reached
no later) and returns the shortest makespan. :func:`run_policy` plays a grouping rule of
:mod:`runahead.scheduling` through the same model, so the two compare like with like.
Grouping only: the search does not choose fetch order, and it never splits one layer's ready jobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from runahead.bottleneck import Hold, Outlook
from runahead.jobs import ENTRY_LAYER, ExpertId, ExpertKey, Group, Job, expert_id
from runahead.relaxation import Relaxed, case_levels, relax
from runahead.scheduling import ComputeOrder, ComputeQueue, Grouping

GroupSeconds = Callable[[Sequence[Job]], float]


@dataclass(frozen=True, slots=True)
class SmallCase:
    """A short trace: ``selections[request][step][layer]``, what is resident, and the costs."""

    selections: Sequence[Sequence[Sequence[tuple[int, ...]]]]
    resident: frozenset[ExpertKey]
    fetch_s: float
    group_s: GroupSeconds

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
    jobs: dict[int, Job]  # each request's current job (absent: at the barrier, or finished)
    ready: set[int]
    held: set[int]  # finished the step, waiting at the barrier
    landed: int = 0  # experts read during the case (the resident set is the case's)
    requested: int = 0  # landed, or being read
    in_flight: tuple[int, float] | None = None  # the read on the link (its bit) and when it lands
    link_free: float = 0.0  # when the link finished its last read
    step: int = 0
    link_busy: float = 0.0
    compute_busy: float = 0.0
    computed: int = 0
    reads: int = 0
    trail: _Trail = None  # the groups so far, newest first: (earlier, (start, layer, requests))

    def link_at(self) -> float:
        """When the link can start its next read: when the one on it lands, else now (a read
        revealed from now on starts at once; the link has been idle since ``link_free``)."""
        return max(self.link_free, self.now) if self.in_flight is None else self.in_flight[1]

    def copy(self) -> _State:
        return _State(
            self.now,
            dict(self.jobs),
            set(self.ready),
            set(self.held),
            self.landed,
            self.requested,
            self.in_flight,
            self.link_free,
            self.step,
            self.link_busy,
            self.compute_busy,
            self.computed,
            self.reads,
            self.trail,
        )


_Trail = tuple["_Trail", tuple[float, int, tuple[int, ...]]] | None
_Remaining = tuple[float, float, int, Relaxed | None]  # see _Model._remaining


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
    groups: tuple[tuple[float, int, tuple[int, ...]], ...]
    explored: int = 0


class _Model:
    """The small case's dynamics: reads, readiness, groups, the barrier.

    Per-job facts are tables built once, indexed ``[request][step][layer + 1]`` (0: the entry
    job): the job itself, its missing experts in the order it names them (bits) and as a mask.
    """

    def __init__(self, case: SmallCase, *, lowest_first: bool = False) -> None:
        self.case = case
        self.last = case.layers - 1
        self.lowest_first = lowest_first  # offer only the lowest ready layer (and waiting)
        self._prepare()

    def start(self) -> _State:
        state = _State(0.0, {}, set(), set())
        for request in range(self.case.requests):
            state.jobs[request] = self._jobs[request][0][0]
            state.ready.add(request)
        return state

    def unlanded(self, state: _State, job: Job) -> int:
        """The experts ``job`` still waits for (a mask)."""
        return self._masks[job.request][job.step][job.layer + 1] & ~state.landed

    @staticmethod
    def blocked(state: _State) -> list[Job]:
        return [job for r, job in state.jobs.items() if r not in state.ready]

    def _next_read(self, state: _State) -> int | None:
        """``SELECT_FETCH_JOB`` (lowest progress, then fewest missing): its first expert not read."""
        best: tuple[tuple[int, int, int, int], Job, int] | None = None
        landed, requested, masks = state.landed, state.requested, self._masks
        for request, job in state.jobs.items():
            if request in state.ready:
                continue
            mask = masks[request][job.step][job.layer + 1]
            unread = mask & ~requested
            if unread:
                rank = (job.epoch, job.layer, (mask & ~landed).bit_count(), request)
                if best is None or rank < best[0]:
                    best = (rank, job, unread)
        if best is None:
            return None
        _, job, unread = best
        return next(b for b in self._orders[job.request][job.step][job.layer + 1] if unread >> b & 1)

    def advance_link(self, state: _State, until: float) -> None:
        """Run the link to ``until``: land reads, start the next, mark the jobs that became ready.

        Reads start when the link is free, or at ``state.now`` (when the last reveal happened).
        """
        fetch_s = self.case.fetch_s
        while True:
            if state.in_flight is None:
                bit = self._next_read(state)
                if bit is None:
                    return
                lands = state.link_at() + fetch_s
                state.requested |= 1 << bit
                state.in_flight = (bit, lands)
                state.link_busy += fetch_s
                state.reads += 1
            bit, lands = state.in_flight
            if lands > until:
                return
            state.landed |= 1 << bit
            state.in_flight = None
            state.link_free = lands
            for request, job in state.jobs.items():
                if request not in state.ready and not self.unlanded(state, job):
                    state.ready.add(request)

    def compute(self, state: _State, layer: int) -> None:
        """Compute every ready job at ``layer`` as one group, then reveal what each needs next."""
        members = sorted(r for r in state.ready if state.jobs[r].layer == layer)
        jobs = [state.jobs[r] for r in members]
        busy = self._level_cost(jobs[0].step, layer, tuple(members))
        state.trail = (state.trail, (state.now, layer, tuple(members)))
        end = state.now + busy
        state.compute_busy += busy
        state.computed += len(jobs)
        self.advance_link(state, end)
        state.now = end
        state.ready.difference_update(members)
        for job in jobs:
            if job.layer == self.last:
                state.held.add(job.request)
                del state.jobs[job.request]
                continue
            nxt = self._jobs[job.request][job.step][job.layer + 2]
            state.jobs[job.request] = nxt
            if not self.unlanded(state, nxt):
                state.ready.add(job.request)
        if not state.jobs:  # everyone reached the barrier
            state.step += 1
            if state.step < self.case.steps:
                for request in state.held:
                    state.jobs[request] = self._jobs[request][state.step][0]
                    state.ready.add(request)
                state.held.clear()
        self.advance_link(state, state.now)

    def wait(self, state: _State, until: float | None = None) -> bool:
        """Let time pass until the next job becomes ready (or ``until``); False if none can (then
        ``state`` is left as it was, but for the link's reads up to ``state.now``)."""
        count = len(state.ready)
        if until is not None and until <= state.now:
            until = None
        self.advance_link(state, state.now)
        while state.in_flight is not None:
            lands = state.in_flight[1]
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
        (the case's and those landed) and the one being read, if any."""
        landed = {key for bit, key in enumerate(self.keys) if state.landed >> bit & 1}
        resident = set(map(expert_id, self.case.resident | landed))
        flight = state.in_flight
        return resident, set() if flight is None else {expert_id(self.keys[flight[0]])}

    @staticmethod
    def done(state: _State) -> bool:
        return not state.jobs

    @staticmethod
    def result(state: _State, explored: int = 0) -> Schedule:
        return Schedule(state.now, state.compute_busy, state.link_busy, _groups(state.trail), explored)

    # -- search --------------------------------------------------------------------------------

    def lower_bound(self, state: _State) -> float:
        """No schedule from ``state`` ends sooner: the remaining compute with each layer in one
        group, or the reads not yet started back to back after the link's current one (then, in
        the last step, the compute after its last read); in the last step with every request in
        it, also the overlap relaxation's floor (:mod:`runahead.relaxation`) over the levels
        ahead of every request, those some have left behind at their cost."""
        case = self.case
        jobs = state.jobs
        at = (state.step, tuple(job.layer if (job := jobs.get(r)) else None for r in range(case.requests)))
        ahead = self._ahead_of.get(at)
        if ahead is None:
            ahead = self._ahead_of[at] = self._remaining(state)
        compute, behind, needed, floor = ahead
        link = state.link_at() + (needed & ~state.requested).bit_count() * case.fetch_s
        if state.step + 1 < case.steps:
            return max(state.now + compute, link)
        best = max(state.now + compute, link + self._after_last_read(state))
        if floor is not None:
            best = max(best, state.now + floor.floor(link - state.now, behind))
        return best

    def _remaining(self, state: _State) -> _Remaining:
        """What :meth:`lower_bound` needs of where each request stands (the same for every state
        with the same step and layers): the compute left with each layer in one group, of it the
        layers some requests have left behind, the missing experts of every job left, and the
        relaxation of the levels ahead of every request (in the last step, with everyone in it)."""
        case = self.case
        later = state.step + 1 < case.steps
        compute = self._future_compute[state.step + 1] if later else 0.0
        needed = 0
        for request in range(case.requests):
            job = state.jobs.get(request)
            if job is not None:
                needed |= self._suffix_masks[request][state.step][job.layer + 1]
            if later:
                needed |= self._suffix_masks[request][state.step + 1][0]
        behind = 0.0
        at = sorted((job.layer, request) for request, job in state.jobs.items())
        if at:
            for i, (layer, _) in enumerate(at[:-1]):
                requests = tuple(sorted(r for _, r in at[: i + 1]))
                for between in range(layer, at[i + 1][0]):
                    behind += self._level_cost(state.step, between, requests)
            compute += behind + self._tail_cost(state.step, at[-1][0], tuple(sorted(state.jobs)))
        everyone = not later and len(state.jobs) == case.requests
        # level i of the floor's is layer i - 1 (0: the entry jobs)
        return compute, behind, needed, self._ahead[at[-1][0] + 1] if everyone else None

    def _after_last_read(self, state: _State) -> float:
        """The least compute some job must do after the step's last read lands: the step's rest of
        the request owning that read, each layer alone (a group costs at least its one job). The last
        read is not known; the least over every unlanded read's request and layer is."""
        landed, step = state.landed, state.step
        least = math.inf
        for request, job in state.jobs.items():
            for layer, mask, tail in self._reads_from_last[request][step]:
                if layer < job.layer:
                    break
                if mask & ~landed:  # this request's latest layer still waiting on a read
                    least = min(least, tail)
                    break
        return 0.0 if least == math.inf else least

    def _level_cost(self, step: int, layer: int, requests: tuple[int, ...]) -> float:
        key = (step, layer, requests)
        cost = self._costs.get(key)
        if cost is None:
            jobs = [self._jobs[r][step][layer + 1] for r in requests]
            cost = self._costs[key] = self.case.group_s(jobs)
        return cost

    def _tail_cost(self, step: int, first: int, requests: tuple[int, ...]) -> float:
        """Whole groups of ``requests`` at every layer from ``first`` to the last, in ``step``."""
        key = (step, first, requests)
        cost = self._tails.get(key)
        if cost is None:
            cost = sum(self._level_cost(step, layer, requests) for layer in range(first, self.case.layers))
            self._tails[key] = cost
        return cost

    def _prepare(self) -> None:
        """The job tables, the experts' bits, per-level costs of whole groups, and each request's
        missing experts from a point on."""
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
        everyone = tuple(range(case.requests))
        self._costs: dict[tuple[int, int, tuple[int, ...]], float] = {}
        self._tails: dict[tuple[int, int, tuple[int, ...]], float] = {}
        self._ahead_of: dict[tuple[int, tuple[int | None, ...]], _Remaining] = {}
        per_step = [sum(self._level_cost(step, layer, everyone) for layer in levels) for step in steps]
        self._future_compute = [sum(per_step[step:]) for step in steps]
        # _suffix_masks[r][step][i]: missing experts of request r's jobs at layers >= i - 1 of
        # ``step`` and every later step (i = layer + 1, so i = 0 is the entry job).
        self._suffix_masks: list[list[list[int]]] = []
        for masks in self._masks:
            rows_m: list[list[int]] = [[] for _ in steps]
            tail = 0
            for step in reversed(steps):
                suffix = [tail] * (case.layers + 2)
                for i in reversed(range(case.layers + 1)):
                    tail |= masks[step][i]
                    suffix[i] = tail
                rows_m[step] = suffix
            self._suffix_masks.append(rows_m)
        last_levels = case_levels(case, case.steps - 1)  # the overlap relaxation's (the floor)
        self._ahead = [relax(last_levels[i:]) for i in range(len(last_levels) + 1)]
        # _solo_tails[r][step][layer]: the compute of r's jobs from ``layer`` to the step's end, each alone
        self._solo_tails = []
        for r in range(case.requests):
            rows_s = []
            for step in steps:
                tails = [0.0] * (case.layers + 1)
                for layer in reversed(range(case.layers)):
                    tails[layer] = tails[layer + 1] + self._level_cost(step, layer, (r,))
                rows_s.append(tails)
            self._solo_tails.append(rows_s)
        # _reads_from_last[r][step]: (layer, its missing experts, _solo_tails there) of r's layers
        # that miss any expert, last layer first
        self._reads_from_last = [
            [
                [
                    (layer, masks[step][layer + 1], tails[layer])
                    for layer in reversed(range(case.layers))
                    if masks[step][layer + 1]
                ]
                for step, tails in enumerate(solo)
            ]
            for masks, solo in zip(self._masks, self._solo_tails, strict=True)
        ]

    def signature(self, state: _State) -> tuple[object, ...]:
        progress = tuple(
            (job.step, job.layer, r in state.ready) if (job := state.jobs.get(r)) else None
            for r in range(self.case.requests)
        )
        flight = None if state.in_flight is None else state.in_flight[0]
        return (state.step, progress, state.requested, flight)

    def children(self, state: _State) -> Iterator[_State]:
        """The states each of :meth:`options` leads to (a wait nothing can end is left out)."""
        for choice in self.options(state):
            child = state.copy()
            if choice is None:
                if not self.wait(child):
                    continue
            else:
                self.compute(child, choice)
            yield child

    def options(self, state: _State) -> list[int | None]:
        """The layers whose ready jobs may compute now, lowest first (only the lowest with
        ``lowest_first``), and None (wait) if useful."""
        layers = sorted({state.jobs[r].layer for r in state.ready})
        choices: list[int | None] = list(layers[:1] if self.lowest_first else layers)
        if self.blocked(state) and (state.in_flight is not None or self._next_read(state) is not None):
            choices.append(None)
        return choices


def best_schedule(
    case: SmallCase,
    incumbent: float = math.inf,
    max_nodes: int = 2_000_000,
    known: Schedule | None = None,
    *,
    lowest_first: bool = False,
) -> Schedule:
    """The shortest makespan over every group/wait decision (depth first, branch and bound).

    ``incumbent``: a makespan already reached (a policy's), to prune from the start; or ``known``, a
    schedule of the case (a policy's, :func:`pilot_schedule`'s): only shorter ones are searched for,
    and it is the answer if there is none. Raises RuntimeError when the search visits more than
    ``max_nodes`` decisions (the case is too big).

    ``lowest_first``: the groups compute lowest layer first (``ComputeOrder.LOWEST_LAYER``, the
    groupings' default order), so only the waits are searched (see :func:`best_holds`). Never
    shorter than the full search's answer.
    """
    model = _Model(case, lowest_first=lowest_first)
    best: list[Schedule | None] = [known]
    bound = [incumbent if known is None else min(incumbent, known.makespan)]
    seen: dict[tuple[object, ...], list[tuple[float, float]]] = {}
    explored = 0

    def visit(state: _State) -> None:
        nonlocal explored
        explored += 1
        if explored > max_nodes:
            raise RuntimeError(f"the search passed {max_nodes} decisions: use a smaller case")
        if model.done(state):
            if state.now < bound[0] or (best[0] is None and state.now <= bound[0]):
                bound[0] = state.now
                best[0] = model.result(state)
            return
        if model.lower_bound(state) >= bound[0] - 1e-12 and best[0] is not None:
            return
        key = model.signature(state)
        at, link = state.now, state.link_at()
        marks = seen.get(key)
        if marks is None:
            seen[key] = [(at, link)]
        elif any(now <= at + 1e-12 and ln <= link + 1e-12 for now, ln in marks):
            return
        else:  # the marks this one dominates go: the list stays a front
            marks[:] = [(now, ln) for now, ln in marks if now < at - 1e-12 or ln < link - 1e-12]
            marks.append((at, link))
        for child in model.children(state):
            visit(child)

    visit(model.start())
    if best[0] is None:
        raise RuntimeError("the search found no schedule (the incumbent was already optimal?)")
    found = best[0]
    return Schedule(found.makespan, found.compute_s, found.fetch_s, found.groups, explored)


def best_holds(case: SmallCase, incumbent: float = math.inf, max_nodes: int = 2_000_000) -> Schedule:
    """The shortest makespan when groups compute lowest layer first (the groupings' default
    ``ComputeOrder.LOWEST_LAYER``) over every decision to wait (:func:`best_schedule` with
    ``lowest_first``): what a hold rule's decisions alone can reach, with hindsight, and a strong
    ``known`` schedule to seed the full search with. The paper's grouping (never waiting) is one of
    its schedules. Far fewer decisions than the full search: 4 and 8 requests over every layer of
    the paper models take seconds, where the full search takes up to an hour at 4."""
    return best_schedule(case, incumbent, max_nodes, lowest_first=True)


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


def _play(model: _Model, state: _State, grouping: Grouping) -> Schedule:
    """Play ``grouping`` from ``state`` (changed in place) to the end of the case."""
    case = model.case
    lanes = {r: r for r in range(case.requests)}
    while not model.done(state):
        queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, grouping)
        for request in sorted(state.ready):
            queue.add(state.jobs[request])
        positions = {r: job.progress for r, job in state.jobs.items()}
        blocked = model.blocked(state)
        outlook = None
        if blocked:
            share = state.compute_busy / state.link_busy if state.link_busy else 1.0
            resident, in_flight = model.cache_view(state)
            outlook = Outlook(
                state.now, blocked, resident, in_flight, case.fetch_s, case.group_s, share, case.layers - 1
            )
        choice = queue.plan(positions, lanes, outlook)
        if isinstance(choice, Group):
            model.compute(state, choice.layer)
        elif isinstance(choice, Hold):
            if not model.wait(state, choice.deadline):
                raise RuntimeError("a hold with nothing to wait for")
        elif not model.wait(state):
            raise RuntimeError(f"nothing ready and nothing to wait for at {state.now}")
    return model.result(state)
