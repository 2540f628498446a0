"""The small-case bound: branch and bound over group/wait decisions, checked on hand-worked cases."""

from __future__ import annotations

import itertools

import pytest

from runahead.bound import SmallCase, best_schedule, run_policy
from runahead.jobs import ExpertKey, Job
from runahead.scheduling import Grouping


def one_layer_case(fetch_s: float) -> SmallCase:
    """Two requests, one step, one MoE layer; request 0's expert is resident, request 1's is read.

    A group costs 1 s + 0.5 s per job. Both entry jobs compute together (0-2 s); then request 0
    is ready and request 1's read runs 2 s -> 2 + fetch_s.
    """

    def group_s(jobs: object) -> float:
        return 1.0 + 0.5 * len(jobs)  # type: ignore[arg-type]

    return SmallCase([[[(0,)]], [[(1,)]]], frozenset({ExpertKey(0, 0)}), fetch_s, group_s)


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
    layers, experts = 4, 6
    picks = list(itertools.combinations(range(experts), 2))
    selections = [
        [[picks[(7 * r + 5 * layer + 3) % len(picks)] for layer in range(layers)]] for r in range(3)
    ]
    resident = frozenset(ExpertKey(layer, e) for layer in range(layers) for e in range(0, experts, 2))

    def group_s(jobs: list[Job]) -> float:
        return 0.3 + 0.05 * len({e for job in jobs for e in job.experts})

    case = SmallCase(selections, resident, 0.2, group_s)
    best = best_schedule(case)
    for grouping in (Grouping(), Grouping(static=True), Grouping(bottleneck=True)):
        assert best.makespan <= run_policy(case, grouping).makespan + 1e-12
    assert best.fetch_s == pytest.approx(
        0.2
        * sum(  # every missing expert read once
            1
            for layer in range(layers)
            for e in {e for r in range(3) for e in selections[r][0][layer]}
            if ExpertKey(layer, e) not in resident
        )
    )


def test_a_case_too_big_for_the_search_is_refused() -> None:
    with pytest.raises(RuntimeError, match="smaller case"):
        best_schedule(one_layer_case(0.4), max_nodes=1)
