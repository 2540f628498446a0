"""The pilot method without hindsight: a schedule a scheduler could reach from what it knows.

NOTE (why). :func:`runahead.bound.pilot_schedule` and :func:`runahead.bound_search.best_schedule`
choose each decision knowing the routing of every layer, revealed or not: a wait is taken because
the search sees that it pays later. No scheduler without prediction knows that, so part of their
gain over a rule may be hindsight, not a better decision the rule could have made. Here each option
is followed by the grouping rule to the end of the case on sampled *completions* of the routing: the
layers each request has revealed are the case's, the rest are drawn from ``history`` (other steps of
the same request, as a runtime has seen them). The option with the shortest mean makespan over the
samples is taken (the same samples for every option of a decision). Its decisions never depend on a
layer not yet revealed (``tests/test_bound_online.py``), so the schedule is one a runtime could reach
knowing the routing's distribution; with the case's own step as the only history it is the pilot
schedule. It is a reference, not a bound: ``samples`` rollouts per option are an estimate, and a
better non-anticipating policy may exist.

:func:`partings` plays the same reference and names each decision where a rule would have chosen
otherwise, with what the rule saw: where to look for a decision the rule could make better without
hindsight (``bench/grouping_partings.py``; docs/results-core.md, "Where the reference without
hindsight parts from the rule at 4 requests").
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from runahead.bound import Schedule, SmallCase, _Model, _outlook, _play, _State, rule_choice
from runahead.jobs import Group
from runahead.landing import last_landing
from runahead.scheduling import Grouping

StepRouting = Sequence[tuple[int, ...]]  # one step of one request: the experts of each layer


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision of :func:`sampled_pilot_schedule`: at ``state`` of ``model``, each option (a
    layer to compute, or None: wait) with the state it leads to, the mean makespan of the grouping's
    rollouts from it over the samples, and the index of the option taken (the least mean)."""

    model: _Model
    state: _State
    options: list[tuple[int | None, _State]]
    means: list[float]
    taken: int


def sampled_pilot_schedule(
    case: SmallCase,
    grouping: Grouping,
    history: Sequence[Sequence[StepRouting]],
    samples: int,
    seed: int = 0,
    observe: Callable[[Decision], object] | None = None,
) -> Schedule:
    """The pilot method on sampled completions of the routing (module note). ``history[request]``:
    steps of that request's routing to draw its unrevealed layers from, each a step's experts by
    layer; ``samples``: completions drawn at each decision; ``seed``: the draws'; ``observe``: called
    with each :class:`Decision` that had a choice, before the option is taken. ``explored`` counts
    the schedules played."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if len(history) != case.requests or not all(history):
        raise ValueError(f"history needs at least one step for each of the case's {case.requests} requests")
    for steps in history:
        for step in steps:
            if len(step) != case.layers:
                raise ValueError(f"a history step has {len(step)} layers, the case {case.layers}")
    model = _Model(case)
    state = model.start()
    draws = random.Random(seed)
    played = 0
    while not model.done(state):
        options = _options(model, state)
        if len(options) == 1:
            state = options[0][1]
            continue
        totals = [0.0] * len(options)
        for _ in range(samples):
            completed = _Model(completion(case, state, history, draws))
            here = _translated(state, model, completed)
            for index, (choice, _) in enumerate(options):
                child = completed.child(here, choice)
                assert child is not None  # the same revealed state offers the same options
                totals[index] += _play(completed, child, grouping).makespan
                played += 1
        taken = min(range(len(options)), key=totals.__getitem__)
        if observe is not None:
            observe(Decision(model, state, options, [total / samples for total in totals], taken))
        state = options[taken][1]
    return model.result(state, played)


@dataclass(frozen=True, slots=True)
class Parting:
    """A decision where the pilot without hindsight and a grouping rule choose differently.

    ``ready``: ``(layer, request)`` of each ready job; ``blocked``: ``(layer, request, experts
    missing, seconds until the last of them lands)`` of each blocked job, ``inf`` where a read has
    not started; ``rule`` and ``reference``: the layer each computes, None where it waits (the
    rule's hold, whatever its deadline, and the reference's wait for the next event count alike);
    ``means``: each option's mean makespan over the samples; ``compute_share``: the rule's (None
    where it builds no outlook)."""

    now: float
    ready: tuple[tuple[int, int], ...]
    blocked: tuple[tuple[int, int, int, float], ...]
    rule: int | None
    reference: int | None
    means: dict[int | None, float]
    compute_share: float | None

    @property
    def regret(self) -> float:
        """How much longer the rule's option is than the reference's, in mean makespan."""
        return self.means[self.rule] - self.means[self.reference]


def partings(
    case: SmallCase,
    grouping: Grouping,
    history: Sequence[Sequence[StepRouting]],
    samples: int,
    seed: int = 0,
) -> tuple[Schedule, list[Parting]]:
    """:func:`sampled_pilot_schedule` with ``grouping`` as its rollouts' rule, and each decision on its
    way where ``grouping`` itself would choose otherwise (where to look for what the rule lacks)."""
    found: list[Parting] = []

    def note(decision: Decision) -> None:
        model, state = decision.model, decision.state
        choice = rule_choice(model, state, grouping)
        rule = choice.layer if isinstance(choice, Group) else None
        choices = [option for option, _ in decision.options]
        if rule == choices[decision.taken] or rule not in choices:
            return
        lands = model.landings(state)
        resident, _ = model.cache_view(state)
        outlook = _outlook(model, state)
        found.append(
            Parting(
                state.now,
                tuple(sorted((state.jobs[r].layer, r) for r in state.ready)),
                tuple(
                    sorted(
                        (
                            job.layer,
                            job.request,
                            model.unlanded(state, job).bit_count(),
                            last_landing(job, state.now, resident, lands) - state.now,
                        )
                        for job in model.blocked(state)
                    )
                ),
                rule,
                choices[decision.taken],
                dict(zip(choices, decision.means, strict=True)),
                None if outlook is None else outlook.compute_share,
            )
        )

    schedule = sampled_pilot_schedule(case, grouping, history, samples, seed, observe=note)
    return schedule, found


def completion(
    case: SmallCase, state: _State, history: Sequence[Sequence[StepRouting]], draws: random.Random
) -> SmallCase:
    """``case`` with every layer no request has revealed at ``state`` drawn from ``history`` (one
    drawn step per request and step of the case)."""
    selections = []
    for request in range(case.requests):
        step, layer = revealed(case, state, request)
        rows = []
        for s, row in enumerate(case.selections[request]):
            if s < step:
                rows.append(row)
                continue
            drawn = draws.choice(history[request])
            rows.append([row[i] if s == step and i <= layer else tuple(drawn[i]) for i in range(case.layers)])
        selections.append(rows)
    return replace(case, selections=selections)


def revealed(case: SmallCase, state: _State, request: int) -> tuple[int, int]:
    """The step and layer of the last job ``request`` has revealed at ``state`` (its current job;
    at the barrier, the step's last layer)."""
    job = state.jobs.get(request)
    if job is None:
        return state.step, case.layers - 1
    return job.step, job.layer


def _options(model: _Model, state: _State) -> list[tuple[int | None, _State]]:
    """Each option of ``state`` and the state it leads to (a wait nothing can end left out)."""
    options = []
    for choice in model.options(state):
        child = model.child(state, choice)
        if child is not None:
            options.append((choice, child))
    return options


def _translated(state: _State, source: _Model, target: _Model) -> _State:
    """``state`` of ``source`` as a state of ``target``, whose case agrees on every revealed layer:
    the experts read or being read renamed from one model's bits to the other's."""
    bit_of = {key: bit for bit, key in enumerate(target.keys)}
    renamed = [bit_of.get(key, -1) for key in source.keys]

    def mask(bits: int) -> int:
        out = 0
        while bits:
            low = bits & -bits
            out |= 1 << renamed[low.bit_length() - 1]
            bits ^= low
        return out

    copy = state.copy()
    copy.landed = mask(state.landed)
    copy.requested = mask(state.requested)
    copy.in_flight = tuple((renamed[bit], lands) for bit, lands in state.in_flight)
    return copy
