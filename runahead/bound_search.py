"""The shortest schedule of a small case, by branch and bound over its decisions.

NOTE (the search). :mod:`runahead.bound` models a small case; here every decision it allows (which
ready layer to compute, or to wait for the next job to become ready) is searched depth first, pruned
by a lower bound and by dominance:

* the lower bound (:meth:`_SearchModel.lower_bound`): the remaining compute with every layer in one
  group; the reads not yet started back to back after the link's current one, then the compute
  some job must do after the last read lands; in the last step, the overlap relaxation's floor
  (:mod:`runahead.relaxation`) over the levels ahead of every request;
* dominance: a state with the same progress, readiness and reads, reached no earlier, with each
  read in flight landing no earlier and the link free no earlier, cannot end sooner than one seen
  before.

:func:`best_schedule` returns the shortest makespan; :func:`best_holds` the shortest with groups
computed lowest layer first (what hold decisions alone can reach). Experts are bits of an int, and
what the lower bound needs of each combination of layers is built once: the search visits millions
of states.
"""

from __future__ import annotations

import math

from runahead.bound import Schedule, SmallCase, _Model, _State
from runahead.jobs import ENTRY_LAYER
from runahead.relaxation import Relaxed, case_levels, relax

_Remaining = tuple[float, float, int, Relaxed | None]  # see _SearchModel._remaining


class _SearchModel(_Model):
    """A small case's model with what the search needs: the lower bound, its tables, and the
    states' signatures for dominance. ``lowest_first`` as :class:`runahead.bound._Model`'s (what
    :func:`best_holds` searches)."""

    def __init__(self, case: SmallCase, *, lowest_first: bool = False) -> None:
        super().__init__(case, lowest_first=lowest_first)
        self._prepare_bound()

    def lower_bound(self, state: _State) -> float:
        """No schedule from ``state`` ends sooner: the remaining compute with each layer in one
        group, or the reads not yet started back to back after those issued, the first a latency
        after now at the earliest (then, in
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
        unread = (needed & ~state.requested).bit_count() * case.fetch_s
        link = self.link_at(state) + unread if unread else max(state.link_free, state.now)
        if state.step + 1 < case.steps:
            return max(state.now + compute, link)
        best = max(state.now + compute, link + self._after_last_read(state))
        if floor is not None:  # the link's busy time alone: the floor counts its idle itself
            now, fetch_s = state.now, case.fetch_s
            busy = unread + sum(min(fetch_s, lands - now) for _, lands in state.in_flight)
            best = max(best, now + floor.floor(busy, behind))
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

    def _tail_cost(self, step: int, first: int, requests: tuple[int, ...]) -> float:
        """Whole groups of ``requests`` at every layer from ``first`` to the last, in ``step``."""
        key = (step, first, requests)
        cost = self._tails.get(key)
        if cost is None:
            cost = sum(self._level_cost(step, layer, requests) for layer in range(first, self.case.layers))
            self._tails[key] = cost
        return cost

    def _prepare_bound(self) -> None:
        """What the lower bound looks up: the compute of whole groups from each step on, each
        request's missing experts from a point on, the relaxation of the last step's levels from
        each level on, and each request's compute left after its layers that miss an expert."""
        case = self.case
        steps, levels = range(case.steps), range(ENTRY_LAYER, case.layers)
        everyone = tuple(range(case.requests))
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
        flight = tuple(bit for bit, _ in state.in_flight)
        # the orders that break ties: the fetch order's (blocked), the groups' (ready, held)
        blocked = tuple(r for r in state.jobs if r not in state.ready)
        return (state.step, progress, state.requested, flight, blocked, tuple(state.ready), tuple(state.held))

    def marks(self, state: _State) -> tuple[float, ...]:
        """The times a state of a signature is judged by (no later in each, no worse): now, when
        each read in flight lands, and when the link can land the next."""
        return (state.now, self.link_at(state), *(lands for _, lands in state.in_flight))


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
    schedule of the case (a policy's, :func:`runahead.bound.pilot_schedule`'s): only shorter ones
    are searched for, and it is the answer if there is none. Raises RuntimeError when the search
    visits more than ``max_nodes`` decisions (the case is too big).

    ``lowest_first``: the groups compute lowest layer first (``ComputeOrder.LOWEST_LAYER``, the
    groupings' default order), so only the waits are searched (see :func:`best_holds`). Never
    shorter than the full search's answer.
    """
    model = _SearchModel(case, lowest_first=lowest_first)
    best: list[Schedule | None] = [known]
    bound = [incumbent if known is None else min(incumbent, known.makespan)]
    seen: dict[tuple[object, ...], list[tuple[float, ...]]] = {}
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
        times = model.marks(state)
        front = seen.get(key)
        if front is None:
            seen[key] = [times]
        elif any(_no_later(mark, times) for mark in front):
            return
        else:  # the marks this one dominates go: the list stays a front
            front[:] = [mark for mark in front if not _no_later(times, mark)]
            front.append(times)
        for child in model.children(state):
            visit(child)

    visit(model.start())
    if best[0] is None:
        raise RuntimeError("the search found no schedule (the incumbent was already optimal?)")
    found = best[0]
    return Schedule(found.makespan, found.compute_s, found.fetch_s, found.groups, explored)


def _no_later(mark: tuple[float, ...], times: tuple[float, ...]) -> bool:
    """Every time of ``mark`` at most the same time of ``times``: ``mark``'s state dominates."""
    return all(a <= b + 1e-12 for a, b in zip(mark, times, strict=True))


def best_holds(
    case: SmallCase,
    incumbent: float = math.inf,
    max_nodes: int = 2_000_000,
    known: Schedule | None = None,
) -> Schedule:
    """The shortest makespan when groups compute lowest layer first (the groupings' default
    ``ComputeOrder.LOWEST_LAYER``) over every decision to wait (:func:`best_schedule` with
    ``lowest_first``, the same arguments): what a hold rule's decisions alone can reach, with
    hindsight, and a strong ``known`` schedule to seed the full search with. The paper's grouping
    (never waiting) is one of its schedules, so it may seed this one. Far fewer decisions than the
    full search: 4 and 8 requests over every layer of the paper models take seconds, where the full
    search takes up to an hour at 4."""
    return best_schedule(case, incumbent, max_nodes, known, lowest_first=True)
