"""Bottleneck-aware grouping: the pure hold rule, its inputs, its name, and runs that use it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runahead.backends.sim import FixedCosts, sim_token
from runahead.bottleneck import HOLD_MIN_COMPUTE_SHARE, ComputeFit, Hold, Outlook, hold_until, landing_times
from runahead.cache import EntryState
from runahead.jobs import ExpertKey, Group, Job, RequestSpec
from runahead.policy import parse_policy
from runahead.scheduling import ComputeOrder, ComputeQueue, Grouping

from simhelpers import random_trace, simulate


def job(request: int, layer: int, experts: tuple[int, ...] = (), epoch: int = 0) -> Job:
    return Job(request, 0, layer, experts, lane=request, epoch=epoch)


def shared_plus_per_job(shared: float, per_job: float):  # type: ignore[no-untyped-def]
    return lambda jobs: shared + per_job * len(jobs)


def states(**by_state: set[ExpertKey]):  # type: ignore[no-untyped-def]
    """A cache view: keys listed under ``pending``/``wanted`` are in that state, others resident."""

    def state(key: ExpertKey) -> EntryState:
        if key in by_state.get("pending", set()):
            return EntryState.PENDING
        if key in by_state.get("wanted", set()):
            return EntryState.WANTED
        return EntryState.RESIDENT

    return state


# -- parsing -----------------------------------------------------------------------------------


def test_bottleneck_grouping_parses_and_prints_its_name() -> None:
    grouping = Grouping.parse("bottleneck")
    assert grouping.bottleneck and not grouping.static and str(grouping) == "bottleneck"
    assert str(Grouping.parse("opportunistic")) == "opportunistic"
    policy = parse_policy("runahead/grouping=bottleneck")
    assert policy.grouping.bottleneck
    assert parse_policy(policy.spec) == policy
    paper = parse_policy("runahead/grouping=opportunistic")
    assert not paper.grouping.bottleneck and parse_policy(paper.spec) == paper


def test_an_unknown_grouping_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'opportunistic', 'bottleneck'"):
        parse_policy("runahead/grouping=patient")


# -- the pure rule ------------------------------------------------------------------------------


def test_it_waits_when_the_link_stays_busy_and_the_wait_is_short() -> None:
    # a group costs 1.0 shared + 0.1 per job; the link has 5 s of revealed reads queued
    ready, late = [job(0, 3)], job(1, 3)
    deadline = hold_until(0.0, ready, [(0.2, late)], 5.0, shared_plus_per_job(1.0, 0.1), 0.3)
    assert deadline == 0.2


def test_it_runs_ahead_when_holding_would_starve_the_link() -> None:
    # nothing queued on the link: computing now reveals the next reads 1.1 s from now, while
    # holding for a job 2 s away would leave the link idle for 3 s
    ready, late = [job(0, 3)], job(1, 3)
    assert hold_until(0.0, ready, [(2.0, late)], 0.0, shared_plus_per_job(1.0, 0.1), 0.3) is None


def test_it_waits_briefly_with_an_idle_link_when_the_shared_read_saved_is_worth_more() -> None:
    # the link has nothing queued either way; the other job is ready in 0.05 s and one group
    # instead of two saves a 1 s shared read: the compute unit is the bottleneck, so wait
    ready, soon = [job(0, 3)], job(1, 3)
    assert hold_until(0.0, ready, [(0.05, soon)], 0.0, shared_plus_per_job(1.0, 0.1), 0.0) == 0.05


def test_it_may_wait_for_some_jobs_and_leave_the_late_ones() -> None:
    ready = [job(0, 3)]
    waiting = [(0.1, job(1, 3)), (0.2, job(2, 3)), (30.0, job(3, 3))]
    assert hold_until(0.0, ready, waiting, 5.0, shared_plus_per_job(1.0, 0.1), 0.0) == 0.2


def test_landing_times_follow_the_fetch_order_after_the_reads_in_flight() -> None:
    a, b, c = ExpertKey(3, 1), ExpertKey(3, 2), ExpertKey(4, 5)
    behind = job(0, 3, (1, 2))  # lowest layer: its reads go first
    ahead = job(1, 4, (5,))
    state = states(pending={a}, wanted={b, c})
    ready_at, link_free_at = landing_times(10.0, [ahead, behind], state, 0.5)
    # a is in flight (lands by 10.5), then b (11.0), then c (11.5)
    assert ready_at == {0: 11.0, 1: 11.5}
    assert link_free_at == 11.5


def test_an_expert_two_jobs_need_is_read_once() -> None:
    shared = ExpertKey(3, 7)
    ready_at, link_free_at = landing_times(
        0.0, [job(0, 3, (7,)), job(1, 3, (7,))], states(wanted={shared}), 1.0
    )
    assert ready_at == {0: 1.0, 1: 1.0} and link_free_at == 1.0


def test_a_tail_group_waits_even_when_the_link_would_idle() -> None:
    # the link has nothing queued; a group costs 1.0 + 0.1 per job and the other job lands at 0.8.
    # Below the tail, computing now reveals reads 1.1 s from now, while holding starves the link
    # until 2.0 (more than half the held group's compute longer): run ahead.
    ready, late = [job(0, 3)], job(1, 3)
    group_s = shared_plus_per_job(1.0, 0.1)
    assert hold_until(0.0, ready, [(0.8, late)], 0.0, group_s, 0.3) is None
    # At the tail layer the reveals give the link nothing: now, then the other, ends at 2.2 after
    # 2.2 s of compute; one group at 0.8 ends at 2.0 after 1.2 s.
    assert hold_until(0.0, ready, [(0.8, late)], 0.0, group_s, 0.3, reveals=False) == 0.8


def test_a_tail_group_computes_now_when_its_ready_part_overlaps_the_late_read() -> None:
    # 1.0 shared + 0.5 per job; three jobs ready, one landing at 9.5. Now (done 2.5), then the late
    # one alone: done 11.0 after 4.0 s of compute, score 11.0 + 0.25 * 4.0 = 12.0; one group at 9.5:
    # done 12.5 after 2.5 s, score 13.125. The layer ends sooner computing now.
    ready, late = [job(0, 3), job(1, 3), job(2, 3)], job(3, 3)
    group_s = shared_plus_per_job(1.0, 0.5)
    assert hold_until(0.0, ready, [(9.5, late)], 0.0, group_s, 0.3, reveals=False) is None


def outlook(  # type: ignore[no-untyped-def]
    blocked: list[Job],
    state,
    share: float = HOLD_MIN_COMPUTE_SHARE,
    now: float = 0.0,
    tail: int | None = None,
) -> Outlook:
    return Outlook(now, blocked, state, 0.1, 0.0, shared_plus_per_job(1.0, 0.1), share, tail)


def test_plan_holds_for_a_same_layer_job_whose_read_is_landing() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    ready, blocked = job(0, 3), job(1, 3, (4,))
    queue.add(ready)
    busy_link = [job(2 + i, 9, (i,)) for i in range(40)]  # 4 s of reads queued behind it
    view = states(pending={ExpertKey(3, 4)}, wanted={ExpertKey(9, i) for i in range(40)})
    choice = queue.plan({}, {}, outlook([blocked, *busy_link], view))
    assert isinstance(choice, Hold) and choice.deadline == pytest.approx(0.1)
    assert len(queue) == 1  # nothing was taken off the ready queue


def test_plan_groups_as_the_paper_when_compute_is_far_from_the_bottleneck() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    queue.add(job(0, 3))
    view = states(pending={ExpertKey(3, 4)})
    choice = queue.plan({}, {}, outlook([job(1, 3, (4,))], view, share=HOLD_MIN_COMPUTE_SHARE / 2))
    assert isinstance(choice, Group) and [j.request for j in choice.jobs] == [0]


def test_plan_holds_a_tail_group_whatever_the_compute_share() -> None:
    # compute far from the bottleneck and the link idle: below the tail the paper's group goes now,
    # at the tail layer (the last, under the step barrier) it waits for the job landing at 0.1
    view = states(pending={ExpertKey(3, 4)})
    for tail, expected in ((None, Group), (3, Hold)):
        queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
        queue.add(job(0, 3))
        choice = queue.plan({}, {}, outlook([job(1, 3, (4,))], view, share=0.5, tail=tail))
        assert isinstance(choice, expected)
    assert isinstance(choice, Hold) and choice.deadline == pytest.approx(0.1)


def test_a_prefill_wave_at_the_tail_layer_is_no_tail_group() -> None:
    # a wave before the last reveals its next wave's experts: the compute-share gate applies
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    queue.add(Job(0, 0, 3, (1,), lane=0, remaining=(2,)))
    view = states(pending={ExpertKey(3, 4)})
    choice = queue.plan({}, {}, outlook([job(1, 3, (4,))], view, share=0.5, tail=3))
    assert isinstance(choice, Group)


def test_plan_is_select_group_for_the_papers_grouping_and_without_an_outlook() -> None:
    for grouping, view in (
        (Grouping(), outlook([job(1, 3, (4,))], states())),
        (Grouping(bottleneck=True), None),
    ):
        queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, grouping)
        queue.add(job(0, 3))
        queue.add(job(2, 5))
        choice = queue.plan({}, {}, view)
        assert isinstance(choice, Group) and choice.layer == 3


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=5),  # ready jobs' layers
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.booleans()), max_size=6),
    st.floats(0.0, 5.0),
    st.floats(0.01, 2.0),
    st.sampled_from([0.5, HOLD_MIN_COMPUTE_SHARE, 2.0]),
    st.one_of(st.none(), st.integers(0, 4)),
)
def test_every_hold_has_a_job_that_will_wake_it_and_a_deadline(  # type: ignore[no-untyped-def]
    ready_layers, blocked_spec, reveal, fetch_s, share, tail
) -> None:
    """No deadlock: a hold names a finite deadline no earlier than now, and a blocked job of the
    held layer exists (its landing sends the scheduler a message); the ready jobs stay queued."""
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    for request, layer in enumerate(ready_layers):
        queue.add(job(request, layer))
    blocked, pending, wanted = [], set(), set()
    for index, (layer, missing, in_flight) in enumerate(blocked_spec):
        experts = tuple(range(10 * index, 10 * index + missing))
        blocked.append(job(100 + index, layer, experts))
        keys = {ExpertKey(layer, e) for e in experts}
        (pending if in_flight else wanted).update(keys)
    view = Outlook(
        3.0,
        blocked,
        states(pending=pending, wanted=wanted),
        fetch_s,
        reveal,
        shared_plus_per_job(1.0, 0.2),
        share,
        tail,
    )
    before = len(queue)
    choice = queue.plan({}, {}, view)
    if isinstance(choice, Hold):
        assert math.isfinite(choice.deadline) and choice.deadline >= 3.0
        lowest = min(ready_layers)
        assert any(j.layer == lowest for j in blocked)
        assert len(queue) == before
    else:
        assert isinstance(choice, Group) and choice.layer == min(ready_layers)


def test_compute_fit_recovers_shared_and_per_job_seconds() -> None:
    fit = ComputeFit()
    assert fit(3) == 0.0
    fit.observe(1, 1.5)
    assert fit(2) == pytest.approx(3.0)  # one size seen: its mean, scaled
    for jobs in (1, 2, 4, 8):
        fit.observe(jobs, 1.0 + 0.5 * jobs)
    assert fit(6) == pytest.approx(4.0, rel=0.05)


# -- runs ---------------------------------------------------------------------------------------


def test_bottleneck_grouping_holds_makes_bigger_groups_and_the_same_tokens() -> None:
    """A link-bound case (reads slow, groups costly to split): holds happen, groups grow, and every
    request still gets exactly its tokens with every pin released."""
    trace = random_trace(requests=4, steps=4, layers=6, experts=16, top_k=2, seed=3)
    costs = FixedCosts(group_s=0.002, per_expert_s=0.0001, transfer_s=0.0015, latency_s=0.0001)
    requests = [RequestSpec(r, 4) for r in range(4)]
    runs = {
        name: simulate(trace, policy=f"runahead/grouping={name}", slots=12, requests=requests, costs=costs)
        for name in ("opportunistic", "bottleneck")
    }
    for runtime in runs.values():
        assert runtime.results == {r.request: [sim_token(r, s) for s in range(4)] for r in requests}  # type: ignore[attr-defined]
        assert runtime.cache.is_idle()
    paper, new = runs["opportunistic"].recorder, runs["bottleneck"].recorder
    assert paper.holds == 0 and new.holds > 0
    assert new.jobs / new.groups > paper.jobs / paper.groups
