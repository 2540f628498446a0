"""The small-case bound: branch and bound over group/wait decisions, checked on hand-worked cases."""

from __future__ import annotations

import random

import pytest

from runahead.backends.sim import FixedCosts
from runahead.bench import BenchPoint, run_point
from runahead.bound import _Model, _State, pilot_schedule, run_policy, sync_link_s
from runahead.bound_search import _SearchModel, best_holds, best_schedule
from runahead.jobs import ExpertKey, RequestSpec
from runahead.metrics import total, union
from runahead.scheduling import Grouping

from benchhelpers import load_bench_script
from boundhelpers import one_layer_case, random_case, three_request_case, traced_case
from simhelpers import random_trace, simulate


def test_a_short_read_is_worth_waiting_for() -> None:
    # wait until 2.4 and compute both (2 s): 4.4; running request 0 ahead gives 2-3.5, then 3.5-5.0
    case = one_layer_case(0.4)
    assert best_schedule(case).makespan == pytest.approx(4.4)
    assert run_policy(case, Grouping()).makespan == pytest.approx(5.0)
    assert run_policy(case, Grouping(static=True)).makespan == pytest.approx(4.4)


def test_a_long_read_is_not() -> None:
    # the read lands at 5: waiting gives 5-7; running ahead gives 2-3.5, then 5-6.5
    case = one_layer_case(3.0)
    best = best_schedule(case)
    assert best.makespan == pytest.approx(6.5)
    assert [(layer, requests) for _, layer, requests in best.groups] == [(-1, (0, 1)), (0, (0,)), (0, (1,))]
    assert run_policy(case, Grouping()).makespan == pytest.approx(6.5)
    assert run_policy(case, Grouping(static=True)).makespan == pytest.approx(7.0)


def test_the_bound_is_never_above_any_grouping_it_could_have_chosen() -> None:
    case = three_request_case()
    best = best_schedule(case)
    for grouping in (Grouping(), Grouping(static=True), Grouping(bottleneck=True)):
        assert best.makespan <= run_policy(case, grouping).makespan + 1e-12
    selections, layers = case.selections, case.layers
    assert best.fetch_s == pytest.approx(
        0.2
        * sum(  # every missing expert read once
            1
            for layer in range(layers)
            for e in {e for r in range(3) for e in selections[r][0][layer]}
            if ExpertKey(layer, e) not in case.resident
        )
    )


def test_a_case_too_big_for_the_search_is_refused() -> None:
    with pytest.raises(RuntimeError, match="smaller case"):
        best_schedule(one_layer_case(0.4), max_nodes=1)


def test_the_pilot_schedule_lies_between_the_bound_and_the_rule_it_follows() -> None:
    case = three_request_case()
    best = best_schedule(case)
    for grouping in (Grouping(), Grouping(bottleneck=True)):
        played = run_policy(case, grouping)
        pilot = pilot_schedule(case, grouping)
        assert best.makespan - 1e-12 <= pilot.makespan <= played.makespan + 1e-12
        assert pilot.fetch_s == pytest.approx(best.fetch_s)  # the same reads, whatever the grouping
    # on a case where following the paper's rule loses, the pilot finds the better schedule
    case = one_layer_case(0.4)
    assert pilot_schedule(case, Grouping()).makespan == pytest.approx(4.4)


def test_the_search_lower_bound_counts_the_compute_after_the_last_read() -> None:
    # request 1's read lands at 5; its last-layer job (1.5 s alone) ends no sooner than 6.5, which
    # is the best schedule's makespan (reads alone would say 5, compute alone 2 + 2)
    case = one_layer_case(3.0)
    model = _SearchModel(case)
    state = model.start()
    model.compute(state, -1)  # both entry jobs: 0-2 s, then request 1's read starts
    assert model.lower_bound(state) == pytest.approx(5.0 + 1.5)
    assert model.lower_bound(state) <= best_schedule(case).makespan + 1e-12


def test_a_known_schedule_seeds_the_search_without_changing_its_answer() -> None:
    case = three_request_case()
    plain = best_schedule(case)
    seeded = best_schedule(case, known=pilot_schedule(case, Grouping()))
    assert seeded.makespan == pytest.approx(plain.makespan)
    assert seeded.explored <= plain.explored
    # an optimal known schedule is the answer when nothing shorter exists
    assert best_schedule(case, known=plain).makespan == plain.makespan


def shortest(model: _Model, state: _State) -> float:
    """The shortest makespan from ``state`` over every decision, nothing pruned: the search's oracle."""
    if model.done(state):
        return state.now
    return min(shortest(model, child) for child in model.children(state))


CASES = [(seed, False) for seed in range(24)] + [(seed, True) for seed in range(24)]


@pytest.mark.parametrize(("seed", "linked"), CASES)
def test_pruning_never_loses_the_best_schedule(seed: int, linked: bool) -> None:
    # the lower bound and the dominance test cut branches; on random cases small enough to try
    # every decision, what is left still holds the shortest schedule
    case = random_case(seed, linked)
    model = _SearchModel(case)
    assert best_schedule(case).makespan == pytest.approx(shortest(model, model.start()), abs=1e-12)


@pytest.mark.parametrize(
    ("seed", "linked"), [(seed, linked) for seed in range(8) for linked in (False, True)]
)
def test_the_lower_bound_holds_at_every_decision(seed: int, linked: bool) -> None:
    # not only where the search went: at every state a schedule can reach, no completion ends
    # before the lower bound
    model = _SearchModel(random_case(seed, linked))
    states = [model.start()]
    while states:
        state = states.pop()
        if not model.done(state):
            assert model.lower_bound(state) <= shortest(model, state.copy()) + 1e-12
            states.extend(model.children(state))


@pytest.mark.parametrize(("seed", "linked"), CASES)
def test_best_holds_is_the_best_lowest_layer_first_schedule(seed: int, linked: bool) -> None:
    # only the waits are searched: the shortest schedule that computes lowest layer first, found
    # with the same pruning; between the full optimum and the paper's grouping (which never waits)
    case = random_case(seed, linked)
    model = _Model(case, lowest_first=True)
    holds = best_holds(case)
    assert holds.makespan == pytest.approx(shortest(model, model.start()), abs=1e-12)
    assert best_schedule(case).makespan <= holds.makespan + 1e-12
    assert holds.makespan <= run_policy(case, Grouping()).makespan + 1e-12
    # and its groups replay through the model, each the lowest ready layer's when it starts
    full = _Model(case)
    state = full.start()
    for start, layer, members in holds.groups:
        while state.now < start - 1e-12:
            assert full.wait(state)
        ready = {r: state.jobs[r].layer for r in state.ready}
        assert layer == min(ready.values())
        assert members == tuple(sorted(r for r, at in ready.items() if at == layer))
        full.compute(state, layer)
    assert full.done(state) and state.now == pytest.approx(holds.makespan, abs=1e-12)


def test_computing_a_higher_layer_first_can_beat_every_hold() -> None:
    # a case (found among the random ones) where the full search's best schedule computes a higher
    # ready layer first, which no lowest-layer-first schedule can match
    case = random_case(220)
    full, holds = best_schedule(case), best_holds(case)
    assert full.makespan < holds.makespan - 1e-3


@pytest.mark.parametrize("seed", range(64))
def test_the_model_plays_each_grouping_as_the_sim_runs_it(seed: int) -> None:
    # on the sim's link (latency, reads in flight) and a cache that never evicts, the model takes the
    # sim's own makespan for sync, the paper's grouping and the bottleneck rule, to the tick: its
    # bound speaks for the sim's runtime, not for a simpler link (costs in whole ticks, 1 us).
    # Seeds 9 and 13 caught the runtime's hold for a landing ending before the job was ready
    # (runahead.landing.LANDED_AFTER_S); seed 43 the same for a hold until a landing the rule's own
    # model of the link priced exactly, and seed 48 (with longer holds) a timer due 1 ns after the
    # landing, which fires in the landing's own tick of the virtual clock
    rng = random.Random(seed)
    requests, steps, layers = rng.choice([(2, 3, 4), (3, 2, 4), (4, 2, 4), (4, 3, 3), (6, 2, 3)])
    costs = FixedCosts(
        *(rng.randint(low, high) * 1e-6 for low, high in ((500, 1500), (100, 400), (200, 800), (0, 300)))
    )
    depth = rng.choice([1, 2, 4])
    trace = random_trace(requests, steps, layers, experts=12, top_k=2, seed=seed)
    case = traced_case(trace, costs, latency_s=costs.latency_s, queue_depth=depth)
    specs = [RequestSpec(r, steps) for r in range(requests)]
    for policy, grouping in (
        ("sync", Grouping(static=True)),
        ("runahead/grouping=opportunistic", Grouping()),
        ("runahead/grouping=bottleneck", Grouping(bottleneck=True)),
    ):
        runtime = simulate(
            trace, policy=policy, slots=12 * layers, requests=specs, costs=costs, link_queue_depth=depth
        )
        assert runtime.cache.stats.evictions == 0
        makespan = max(t for _, _, t in runtime.recorder.tokens)
        played = run_policy(case, grouping)
        assert played.makespan == pytest.approx(makespan, abs=1e-9), policy
        if policy == "sync":  # the link time the sim's row counts, from which the limit comes
            link = total(union([(f.start, f.end) for f in runtime.recorder.fetches]))
            assert sync_link_s(played) == pytest.approx(link, abs=1e-9)


def test_the_small_case_reads_as_many_experts_as_the_sims_steady_state() -> None:
    # bench/grouping_bound.py judges the rule where the sim's figures are measured: its case's cache
    # (the warm-up's most used experts) leaves a step as many reads as a long sim run averages;
    # after 8 warm-up steps (the rows before the 43rd session) a step read about 30% more here
    bound = load_bench_script("grouping_bound")
    model, profile, requests = "qwen3.6-35b-a3b", "thor", 4

    def reads(warmup: int) -> float:
        cases = [
            bound.small_case(model, profile, requests, None, 0.3, seed, warmup=warmup) for seed in range(6)
        ]
        sync = [run_policy(case, Grouping(static=True)) for case in cases]
        return sum(s.fetch_s / case.fetch_s for s, case in zip(sync, cases, strict=True)) / len(cases)

    row = run_point(BenchPoint(model, profile, "sync", requests, 0.3, 128))
    steady = row["fetches_per_step"]
    assert abs(reads(bound.WARMUP) / steady - 1) < 0.1, (reads(bound.WARMUP), steady)
    assert reads(8) / steady > 1.2, (reads(8), steady)
