"""Exact timelines on a hand-computed case: 2 requests, 2 layers, top-1, a 2-slot cache.

Costs: a group takes 1000 us + 200 us per distinct expert; a read holds the link 500 us (no
latency), two reads in flight. Request 0 routes to expert 0 at both layers, request 1 to expert 1.
Every time below was worked out by hand from those rules (see each test's comments).
"""

import pytest

from runahead import landing
from runahead.backends.sim import FixedCosts
from runahead.jobs import RequestSpec
from runahead.trace import RoutingTrace

from simhelpers import simulate

PAPER = "runahead/grouping=opportunistic"
"""The paper's runahead (opportunistic grouping); plain ``runahead`` is the bottleneck-aware one."""
COSTS = FixedCosts(group_s=0.001, per_expert_s=0.0002, transfer_s=0.0005, latency_s=0.0)
TRACE = RoutingTrace.from_selections([[[[0], [0]]], [[[1], [1]]]], num_experts=2)
REQUESTS = [RequestSpec(0, max_tokens=1), RequestSpec(1, max_tokens=1)]


def us(seconds: float) -> int:
    return round(seconds * 1e6)


def computes(runtime):  # type: ignore[no-untyped-def]
    return [(us(c.start), us(c.end), c.layer, c.requests) for c in runtime.recorder.computes]


def fetches(runtime):  # type: ignore[no-untyped-def]
    return [(us(f.start), us(f.end), tuple(f.key)) for f in runtime.recorder.fetches]


def tokens(runtime):  # type: ignore[no-untyped-def]
    return sorted((request, us(time)) for request, _, time in runtime.recorder.tokens)


def test_runahead_timeline() -> None:
    runtime = simulate(TRACE, policy=PAPER, slots=2, requests=REQUESTS, costs=COSTS)
    # 0: both entry jobs, one group. 1000: both layer-0 jobs miss; reads of (0,0) then (0,1)
    # share the link. 1500: request 0 is ready and runs ahead alone (1200 us: one expert).
    # 2700: its layer-1 read evicts (0,0) while request 1 computes layer 0. 3900: request 0's
    # layer 1 computes while request 1's layer-1 read (evicting (0,1)) is on the link.
    assert computes(runtime) == [
        (0, 1000, -1, (0, 1)),
        (1500, 2700, 0, (0,)),
        (2700, 3900, 0, (1,)),
        (3900, 5100, 1, (0,)),
        (5100, 6300, 1, (1,)),
    ]
    assert fetches(runtime) == [
        (1000, 1500, (0, 0)),
        (1000, 2000, (0, 1)),
        (2700, 3200, (1, 0)),
        (3900, 4400, (1, 1)),
    ]
    assert tokens(runtime) == [(0, 5100), (1, 6300)]


def test_bottleneck_grouping_batches_the_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    # the tail alone: no wait for a merge that pays below it (the next test)
    monkeypatch.setattr(landing, "HOLD_MERGE_SHARE", 0.0)
    runtime = simulate(TRACE, policy="runahead", slots=2, requests=REQUESTS, costs=COSTS)
    # As the paper's up to 3900. Layer 1 is the tail (the last layer, barrier on: its reveals give
    # the link nothing). Computing request 0 now ends the layer at 6300 (1200 + 1200 us, one after the
    # other); holding it for request 1's read (lands at 4400) and computing both as one group ends it
    # at 4400 + 1400 = 5800, and saves 1200 + 1200 - 1400 = 1000 us of compute for 500 us of waiting.
    assert computes(runtime) == [
        (0, 1000, -1, (0, 1)),
        (1500, 2700, 0, (0,)),
        (2700, 3900, 0, (1,)),
        (4400, 5800, 1, (0, 1)),
    ]
    assert fetches(runtime) == [
        (1000, 1500, (0, 0)),
        (1000, 2000, (0, 1)),
        (2700, 3200, (1, 0)),
        (3900, 4400, (1, 1)),
    ]
    assert tokens(runtime) == [(0, 5800), (1, 5800)]


def test_bottleneck_grouping_waits_for_a_merge_that_pays() -> None:
    runtime = simulate(TRACE, policy="runahead", slots=2, requests=REQUESTS, costs=COSTS)
    synced = simulate(TRACE, policy="sync", slots=2, requests=REQUESTS, costs=COSTS)
    # 1500: request 0 is ready at layer 0; request 1's read lands at 2000. Merged, the two save
    # 1200 + 1200 - 1400 = 1000 us of compute; half of that for one ready job covers the 500 us
    # wait (runahead.landing.MergeSaving), so both compute as one group at 2000, and again at the
    # tail: sync's timeline (below), whose tokens come as early as the tail's hold alone gave them
    # (5800), for 1000 us less compute.
    assert computes(runtime) == computes(synced)
    assert fetches(runtime) == fetches(synced)
    assert tokens(runtime) == [(0, 5800), (1, 5800)]
    assert runtime.recorder.holds > 0  # held, not planned as one group


def test_sync_timeline() -> None:
    runtime = simulate(TRACE, policy="sync", slots=2, requests=REQUESTS, costs=COSTS)
    # sync waits for both requests at every layer: no compute while the link works.
    assert computes(runtime) == [
        (0, 1000, -1, (0, 1)),
        (2000, 3400, 0, (0, 1)),
        (4400, 5800, 1, (0, 1)),
    ]
    assert fetches(runtime) == [
        (1000, 1500, (0, 0)),
        (1000, 2000, (0, 1)),
        (3400, 3900, (1, 0)),
        (3400, 4400, (1, 1)),
    ]
    assert tokens(runtime) == [(0, 5800), (1, 5800)]


def test_metrics_of_the_sync_timeline() -> None:
    from runahead.metrics import summarize

    runtime = simulate(TRACE, policy="sync", slots=2, requests=REQUESTS, costs=COSTS)
    metrics = summarize(runtime.recorder, runtime.cache.stats, steps=1)
    assert us(metrics.makespan_s) == 5800
    assert us(metrics.compute_s) == 1000 + 1400 + 1400
    assert us(metrics.fetch_s) == 1000 + 1000
    assert us(metrics.lower_bound_s) == 3800
    assert metrics.overlap_fraction == 0.0
    assert (metrics.hits, metrics.misses, metrics.fetches) == (0, 4, 4)
