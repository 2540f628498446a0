"""The pilot method without hindsight (runahead.bound_online)."""

from __future__ import annotations

import random

import pytest

from runahead.bound import SmallCase, pilot_schedule, run_policy
from runahead.bound_online import partings, sampled_pilot_schedule
from runahead.jobs import ExpertKey
from runahead.scheduling import Grouping

from benchhelpers import load_bench_script
from boundhelpers import random_case, three_request_case

RULE = Grouping(bottleneck=True)


ONE_STEP = ((2, 1, 5), (3, 1, 3), (2, 1, 6))  # shapes with choices to make, one step each


def one_step_case(seed: int, linked: bool = False) -> SmallCase:
    return random_case(seed, linked, ONE_STEP)


def own_step(case: SmallCase) -> list[list[list[tuple[int, ...]]]]:
    """Each request's history: only the case's own step (the samples are then the truth)."""
    return [[list(case.selections[r][0])] for r in range(case.requests)]


@pytest.mark.parametrize(("seed", "linked"), [(s, False) for s in range(8)] + [(s, True) for s in range(8)])
def test_with_the_truth_as_its_only_sample_it_is_the_pilot_schedule(seed: int, linked: bool) -> None:
    # every completion drawn is the case itself, so each option's mean is its hindsight rollout
    case = one_step_case(seed, linked)
    for grouping in (Grouping(), RULE):
        sampled = sampled_pilot_schedule(case, grouping, own_step(case), samples=2, seed=seed)
        assert sampled.makespan == pytest.approx(pilot_schedule(case, grouping).makespan)


@pytest.mark.parametrize("seed", range(40))
def test_no_decision_depends_on_a_layer_not_yet_revealed(seed: int) -> None:
    # two cases that differ only from request 0's layer `k` on: every group up to the one that
    # reveals that layer (request 0's layer k - 1) is the same in both schedules
    case = one_step_case(seed)
    rng = random.Random(100 + seed)
    k = rng.randrange(1, case.layers)
    changed_rows = list(case.selections[0][0])
    for layer in range(k, case.layers):  # the changed layers miss the cache where they can
        missing = [e for e in range(6) if ExpertKey(layer, e) not in case.resident]
        changed_rows[layer] = tuple(rng.sample(missing if len(missing) >= 2 else range(6), 2))
    others = [list(rows) for rows in case.selections[1:]]
    changed = SmallCase([[changed_rows], *others], case.resident, case.fetch_s, case.group_s)
    history = [[list(rng.choice(case.selections)[0]) for _ in range(4)] for _ in range(case.requests)]
    first = sampled_pilot_schedule(case, RULE, history, samples=3, seed=seed).groups
    second = sampled_pilot_schedule(changed, RULE, history, samples=3, seed=seed).groups
    reveal = next(i for i, (_, layer, requests) in enumerate(first) if layer == k - 1 and 0 in requests)
    assert first[: reveal + 1] == second[: reveal + 1]


def test_the_draws_are_seeded() -> None:
    case = three_request_case()
    history = [[list(case.selections[(r + 1) % 3][0]), list(case.selections[r][0])] for r in range(3)]
    once = sampled_pilot_schedule(case, RULE, history, samples=2, seed=5)
    again = sampled_pilot_schedule(case, RULE, history, samples=2, seed=5)
    assert once == again
    assert once.explored > 0


def test_bad_arguments_are_named() -> None:
    case = three_request_case()
    with pytest.raises(ValueError, match="samples"):
        sampled_pilot_schedule(case, RULE, own_step(case), samples=0)
    with pytest.raises(ValueError, match="each of the case's 3 requests"):
        sampled_pilot_schedule(case, RULE, own_step(case)[:2], samples=1)
    with pytest.raises(ValueError, match="layers"):
        sampled_pilot_schedule(case, RULE, [[[(0, 1)]]] * 3, samples=1)


def test_the_bench_reports_it_beside_the_bound() -> None:
    bench = load_bench_script("grouping_bound")
    row = bench.measure("qwen3.6-35b-a3b", "thor", 2, 6, 0.3, True, warmup=8, online_samples=2, history=4)
    assert (row["online_samples"], row["history"]) == (2, 4)
    assert row["bound_ms"] <= row["online_ms"] + 1e-9  # no schedule beats the exact bound
    assert row["bottleneck_share_of_online"] == pytest.approx(
        (row["bottleneck_x"] - 1) / (row["online_x"] - 1)
    )
    with pytest.raises(ValueError, match="1 to 8 warm-up steps"):
        bench.measure("qwen3.6-35b-a3b", "thor", 2, 6, 0.3, False, warmup=8, online_samples=2, history=9)


@pytest.mark.parametrize(("seed", "linked"), [(s, False) for s in range(8)] + [(s, True) for s in range(8)])
def test_partings_are_the_pilots_decisions_where_the_rule_chose_otherwise(seed: int, linked: bool) -> None:
    case = one_step_case(seed, linked)
    history = own_step(case)  # the truth as the only sample: the pilot with hindsight
    schedule, found = partings(case, RULE, history, samples=2, seed=seed)
    assert schedule == sampled_pilot_schedule(case, RULE, history, samples=2, seed=seed)
    for parting in found:
        assert parting.rule != parting.reference
        assert parting.means[parting.reference] == min(parting.means.values())  # the option taken
        assert parting.regret >= 0
        assert {layer for layer, _ in parting.ready} >= {
            c for c in (parting.rule, parting.reference) if c is not None
        }
    # each decision takes the option whose rollout (the rule to the end) is shortest, and the rule's
    # own option's rollout is the rule's makespan from there: the pilot only gains where they part
    if schedule.makespan < run_policy(case, RULE).makespan - 1e-12:
        assert any(parting.regret > 0 for parting in found)


def test_partings_are_found_where_the_rule_leaves_time() -> None:
    # over these cases the pilot beats the rule somewhere, so the test above asserts something
    beaten = 0
    for seed in range(16):
        case = one_step_case(seed)
        if pilot_schedule(case, RULE).makespan < run_policy(case, RULE).makespan - 1e-12:
            beaten += 1
            assert any(parting.regret > 0 for parting in partings(case, RULE, own_step(case), samples=1)[1])
    assert beaten >= 2


def test_the_partings_bench_names_each_kind() -> None:
    bench = load_bench_script("grouping_partings")
    makespan, found = bench.step_partings("gemma4-26b-a4b", "thor", 2, seed=0, samples=2)
    assert makespan > 0
    for parting in found:
        assert bench.kind(parting) in {"wait", "runner", "lower", "compute", "runner-in-hold"}
        assert "regret=" in bench.describe(parting)
