"""The overlap relaxation: a floor under every grouping's time, checked by hand and against the search."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from runahead.bound import run_policy
from runahead.bound_search import best_schedule
from runahead.jobs import Job, RequestSpec
from runahead.relaxation import Level, case_floor, case_levels, floor, level
from runahead.scheduling import Grouping

from boundhelpers import one_layer_case, three_request_case, traced_case
from simhelpers import COSTS, random_trace, simulate


def experts_cost(jobs: Sequence[Job]) -> float:
    return 0.3 + 0.05 * len({e for job in jobs for e in job.experts})


def test_a_level_splits_where_the_fewest_experts_are_read_twice() -> None:
    a, b, c = (Job(r, 0, 2, experts) for r, experts in enumerate([(0, 1), (0, 1), (2, 3)]))
    made = level([a, b, c], experts_cost)
    assert made.whole == pytest.approx(0.5)
    assert made.split == pytest.approx(0.8)  # {a, b} | {c}; cutting a from b reads 0 and 1 twice: 0.9
    assert (made.idle_whole, made.idle_split) == pytest.approx((0.5, 0.0))
    first = level([a, b, c], experts_cost, first=True, latency_s=0.1)
    assert (first.idle_whole, first.idle_split) == pytest.approx((0.6, 0.5))  # + latency
    last = level([a, b, c], experts_cost, last=True, latency_s=0.1)
    assert (last.idle_whole, last.idle_split) == pytest.approx((0.5, 0.4))  # nothing after
    assert math.isinf(level([a], experts_cost).split)


def test_the_floor_trades_compute_for_link_idle_fractionally() -> None:
    # all split: compute 3.0, link 2.0; one level whole: 2.5 vs 3.0; both: 2.0 vs 4.0. The best
    # whole choice gives 3.0; two thirds of one level whole makes the sides meet at 2.667
    levels = [Level(1.0, 1.5, 1.0), Level(1.0, 1.5, 1.0)]
    assert floor(levels, 2.0) == pytest.approx(3.0 - 0.5 * 2 / 3)
    assert floor(levels, 5.0) == pytest.approx(5.0)  # the link bounds it: nothing to trade
    assert floor([Level(1.0, math.inf, 1.0)], 0.5) == pytest.approx(1.5)  # one job: whole, idle


@pytest.mark.parametrize("case", [one_layer_case(0.4), one_layer_case(3.0), three_request_case()])
def test_no_schedule_beats_the_floor(case) -> None:  # type: ignore[no-untyped-def]
    best = best_schedule(case)
    assert case_floor(case) <= best.makespan + 1e-12
    for grouping in (Grouping(), Grouping(static=True), Grouping(bottleneck=True)):
        assert case_floor(case) <= run_policy(case, grouping).makespan + 1e-12


def test_the_floor_is_tight_where_the_whole_schedule_idles_one_side() -> None:
    # one_layer_case(3.0): the best schedule runs request 0 ahead (compute 6.0 over both levels
    # split) and the link reads 3 s between the first and last groups (1.5 s each): both sides 6.0
    assert case_floor(one_layer_case(3.0)) == pytest.approx(6.0)


def test_bad_levels_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one job"):
        level([], experts_cost)
    with pytest.raises(ValueError, match="costs more than its split"):
        floor([Level(2.0, 1.0, 2.0)], 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sims_schedules_never_beat_the_floor(seed: int) -> None:
    # the runtime itself (read latency, four reads in flight, a small cache that evicts and reads
    # again), every grouping: its makespan is never below the floor of its trace and its reads
    requests, steps, layers = 4, 5, 4
    trace = random_trace(requests, steps, layers, experts=12, top_k=2, seed=seed)
    case = traced_case(trace, COSTS)
    levels = [item for step in range(steps) for item in case_levels(case, step)]
    specs = [RequestSpec(r, steps) for r in range(requests)]
    for policy in ("runahead", "runahead/grouping=opportunistic", "sync", "runahead/grouping=static:2:2"):
        runtime = simulate(trace, policy=policy, slots=10, requests=specs)
        recorder = runtime.recorder
        makespan = max(t for _, _, t in recorder.tokens)
        assert floor(levels, recorder.reads * COSTS.transfer_s) <= makespan + 1e-9, policy
