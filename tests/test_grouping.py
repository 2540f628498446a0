"""Bottleneck-aware grouping: the pure hold rule, its inputs, its name, and runs that use it."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from functools import partial

import pytest
from groupinghelpers import Resident, job, shared_plus_per_job, states
from hypothesis import given, settings
from hypothesis import strategies as st

from runahead.actors.scheduler import ComputeScheduler
from runahead.backends.sim import FixedCosts, sim_token
from runahead.bottleneck import (
    HOLD_MIN_COMPUTE_SHARE,
    HOLD_MIN_MEASURED_SHARE,
    HOLD_MIN_TAIL_SHARE,
    ComputeFit,
    Hold,
    LineFit,
    Outlook,
    PricedGroup,
    landing_order,
    weigh_hold,
)
from runahead.cache import ExpertCache
from runahead.clock import Clock
from runahead.costs import CostModel, GroupCost
from runahead.jobs import (
    ENTRY_LAYER,
    ExpertId,
    ExpertKey,
    Group,
    Job,
    RequestSpec,
    distinct_experts,
)
from runahead.landing import LANDED_AFTER_S, MergeSaving
from runahead.loops import loop_factory
from runahead.mailbox import Mailbox
from runahead.messages import Ready
from runahead.metrics import Recorder, total, union
from runahead.mode import Mode
from runahead.policy import parse_policy
from runahead.scheduling import ComputeOrder, ComputeQueue, Grouping, StepBarrier
from runahead.specs import load_model_spec, load_profile

from simhelpers import random_trace, simulate

# -- parsing -----------------------------------------------------------------------------------


def test_bottleneck_grouping_parses_and_prints_its_name() -> None:
    grouping = Grouping.parse("bottleneck")
    assert grouping.bottleneck and not grouping.static and str(grouping) == "bottleneck"
    assert str(Grouping.parse("opportunistic")) == "opportunistic"
    policy = parse_policy("runahead/grouping=bottleneck")
    assert policy.grouping.bottleneck and not policy.grouping.adaptive
    assert parse_policy(policy.spec) == policy and policy.spec == "runahead/grouping=bottleneck"
    paper = parse_policy("runahead/grouping=opportunistic")
    assert not paper.grouping.bottleneck and parse_policy(paper.spec) == paper
    # plain runahead is the bottleneck-aware grouping, adaptive (measured against batching on a real
    # backend); the rule alone and the paper's grouping keep their names as knobs
    adaptive = parse_policy("runahead")
    assert adaptive.grouping == Grouping.parse("adaptive") and str(adaptive.grouping) == "adaptive"
    assert adaptive.grouping.bottleneck and adaptive.grouping.adaptive and adaptive.spec == "runahead"
    assert parse_policy("runahead/grouping=adaptive") == adaptive
    assert paper.spec == "runahead/grouping=opportunistic"


def test_an_unknown_grouping_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'opportunistic', 'bottleneck'"):
        parse_policy("runahead/grouping=patient")


def outlook(
    blocked: list[Job],
    view: tuple[Resident, set[ExpertId]],
    share: float = HOLD_MIN_COMPUTE_SHARE,
    now: float = 0.0,
    tail: int | None = None,
) -> Outlook:
    resident, in_flight = view
    return Outlook(now, blocked, resident, in_flight, 0.1, shared_plus_per_job(1.0, 0.1), share, tail)


def test_plan_holds_for_a_same_layer_job_whose_read_is_landing() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    ready, blocked = job(0, 3), job(1, 3, (4,))
    queue.add(ready)
    busy_link = [job(2 + i, 9, (i,)) for i in range(40)]  # 4 s of reads queued behind it
    view = states(pending={ExpertKey(3, 4)}, wanted={ExpertKey(9, i) for i in range(40)})
    choice = queue.plan({}, {}, outlook([blocked, *busy_link], view))
    assert isinstance(choice, Hold) and choice.deadline == pytest.approx(0.1 + LANDED_AFTER_S)
    assert len(queue) == 1  # nothing was taken off the ready queue


def test_plan_groups_as_the_paper_when_compute_is_far_from_the_bottleneck() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    queue.add(job(0, 3))
    view = states(pending={ExpertKey(3, 4)})
    choice = queue.plan({}, {}, outlook([job(1, 3, (4,))], view, share=HOLD_MIN_COMPUTE_SHARE / 2))
    assert isinstance(choice, Group) and [j.request for j in choice.jobs] == [0]


def test_plan_holds_more_cautiously_on_measured_costs() -> None:
    # a share between the two gates below the tail: a cost model's outlook holds, a measured one
    # (a fit, a real link) computes now; and the measured one gives the link no slack
    busy_link = [job(2 + i, 9, (i,)) for i in range(40)]
    view = states(pending={ExpertKey(3, 4)}, wanted={ExpertKey(9, i) for i in range(40)})
    share = (HOLD_MIN_COMPUTE_SHARE + HOLD_MIN_MEASURED_SHARE) / 2
    for measured, expected in ((False, Hold), (True, Group)):
        queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
        queue.add(job(0, 3))
        modelled = outlook([job(1, 3, (4,)), *busy_link], view, share=share)
        seen = dataclasses.replace(modelled, measured=measured)
        assert isinstance(queue.plan({}, {}, seen), expected)
    # the link idle but for one read landing at 0.2: holding ends the group at 1.4, 0.3 s after the
    # link runs dry (computing now would end at 1.1), for 0.8 s of compute saved: within the slack
    # of a cost model, not allowed on measured costs
    for measured, expected in ((False, Hold), (True, Group)):
        queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
        queue.add(job(0, 3))
        late = outlook([job(1, 3, (4,))], states(pending={ExpertKey(3, 4)}), share=2.0)
        landing = dataclasses.replace(late, fetch_s=0.2, measured=measured)
        assert isinstance(queue.plan({}, {}, landing), expected)


def test_plan_holds_tail_groups_nearer_the_link_bound_than_others() -> None:
    # the link idle but for one read landing at 0.1. Compute share between the two gates: below the
    # tail the paper's group goes now, at the tail layer (the last, under the step barrier) it waits
    view = states(pending={ExpertKey(3, 4)})
    share = (HOLD_MIN_TAIL_SHARE + HOLD_MIN_COMPUTE_SHARE) / 2
    for tail, expected in ((None, Group), (3, Hold)):
        queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
        queue.add(job(0, 3))
        choice = queue.plan({}, {}, outlook([job(1, 3, (4,))], view, share=share, tail=tail))
        assert isinstance(choice, expected)
    assert isinstance(choice, Hold) and choice.deadline == pytest.approx(0.1 + LANDED_AFTER_S)
    # far from the compute bottleneck even a tail group goes now
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    queue.add(job(0, 3))
    view_far = outlook([job(1, 3, (4,))], view, share=HOLD_MIN_TAIL_SHARE / 2, tail=3)
    assert isinstance(queue.plan({}, {}, view_far), Group)


def test_a_prefill_wave_at_the_tail_layer_is_no_tail_group() -> None:
    # a wave before the last reveals its next wave's experts: the gate below the tail applies
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    queue.add(Job(0, 0, 3, (1,), lane=0, remaining=(2,)))
    view = states(pending={ExpertKey(3, 4)})
    share = (HOLD_MIN_TAIL_SHARE + HOLD_MIN_COMPUTE_SHARE) / 2
    choice = queue.plan({}, {}, outlook([job(1, 3, (4,))], view, share=share, tail=3))
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


QWEN_THOR = CostModel(load_model_spec("qwen3.6-35b-a3b"), load_profile("thor"))
JOB_SPEC = st.tuples(
    st.lists(st.integers(0, 255), min_size=1, max_size=8, unique=True),  # experts
    st.integers(0, 3),  # step
    st.sampled_from([1, 1, 1, 64, 256]),  # tokens: decode or a prefill chunk
)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([0, 7, 20, 38, 39]),  # the layer (39: the last)
    st.lists(JOB_SPEC, min_size=1, max_size=4),  # ready
    st.lists(st.tuples(st.floats(0.0, 0.006), JOB_SPEC), min_size=1, max_size=8),  # waiting
    st.floats(0.0, 0.02),  # when the link runs out of revealed reads
    st.booleans(),  # the tail
)
def test_candidates_priced_job_by_job_decide_as_whole_groups(  # type: ignore[no-untyped-def]
    layer, ready_spec, waiting_spec, link_free_at, tail
) -> None:
    """The scheduler's pricer (the cost model job by job) gives the rule the prices the whole groups
    have, bit for bit, so it holds (or not) until the same time as pricing each candidate anew."""
    requests = {r: RequestSpec(r, 8, prompt_tokens=97 * r) for r in range(12)}

    def context(job: Job) -> int:
        return requests[job.request].prompt_tokens + job.step + job.num_tokens

    def whole(jobs: Sequence[Job]) -> float:  # the scheduler's group_s: each group in one call
        contexts = list(map(context, jobs))
        return QWEN_THOR.compute_time(layer, [j.num_tokens for j in jobs], contexts, distinct_experts(jobs))

    def make(request: int, spec: tuple[list[int], int, int]) -> Job:
        experts, step, tokens = spec
        return Job(request, step, layer, tuple(experts), lane=request, num_tokens=tokens)

    ready = [make(r, spec) for r, spec in enumerate(ready_spec)]
    waiting = sorted(
        ((at, make(len(ready) + i, spec)) for i, (at, spec) in enumerate(waiting_spec)), key=landing_order
    )
    pricer = partial(GroupCost, QWEN_THOR, context)
    everyone = [*ready, *(j for _, j in waiting)]
    assert pricer(everyone).seconds().hex() == whole(everyone).hex()
    plain = weigh_hold(0.0, ready, waiting, link_free_at, whole, tail=tail)
    assert weigh_hold(0.0, ready, waiting, link_free_at, whole, tail=tail, pricer=pricer) == plain
    # the ready group priced once for the decision (the merge's saving first, as plan does): the
    # same cost, bit for bit, and the same verdict from the group weigh_hold then grows
    built = []

    def counted(jobs):  # type: ignore[no-untyped-def]
        built.append(list(jobs))
        return pricer(built[-1])

    priced = PricedGroup(ready, counted)
    assert MergeSaving(ready, whole, priced.seconds).most.hex() == whole(ready).hex()
    verdict = weigh_hold(0.0, ready, waiting, link_free_at, whole, tail=tail, pricer=counted, priced=priced)
    assert verdict == plain
    assert built.count(ready) == 1  # priced once (the other groups priced are the tail's rest)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=5),  # ready jobs' layers
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.booleans()), max_size=6),
    st.floats(0.01, 2.0),
    st.sampled_from([0.5, HOLD_MIN_TAIL_SHARE, HOLD_MIN_COMPUTE_SHARE, 2.0]),
    st.one_of(st.none(), st.integers(0, 4)),
)
def test_every_hold_has_a_job_that_will_wake_it_and_a_deadline(  # type: ignore[no-untyped-def]
    ready_layers, blocked_spec, fetch_s, share, tail
) -> None:
    """No deadlock: a hold names a finite deadline no earlier than now, and a blocked job of the
    held layer or a lower one exists (its landing sends the scheduler a message: a tail group waits
    for the jobs of its step behind it); the ready jobs stay queued."""
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
        *states(pending=pending, wanted=wanted),
        fetch_s,
        shared_plus_per_job(1.0, 0.2),
        share,
        tail,
    )
    before = len(queue)
    choice = queue.plan({}, {}, view)
    if isinstance(choice, Hold):
        assert math.isfinite(choice.deadline) and choice.deadline >= 3.0
        lowest = min(ready_layers)
        assert any(j.layer == lowest for j in blocked) or (
            lowest == tail and any(j.layer < lowest for j in blocked)
        )
        assert len(queue) == before
    else:
        assert isinstance(choice, Group) and choice.layer == min(ready_layers)


def test_a_line_fit_recovers_shared_and_slope() -> None:
    fit = LineFit()
    assert fit(3) == 0.0
    fit.observe(1, 1.5)
    assert fit(2) == pytest.approx(3.0)  # one size seen: its mean, scaled
    for size in (1, 2, 4, 8):
        fit.observe(size, 1.0 + 0.5 * size)
    assert fit(6) == pytest.approx(4.0, rel=0.05)


def spread_jobs(layer: int, count: int, top_k: int = 2) -> list[Job]:
    """Jobs of ``layer`` whose experts are all different (``top_k`` each)."""
    return [job(r, layer, tuple(range(r * top_k, (r + 1) * top_k))) for r in range(count)]


def test_compute_fit_leaves_prefill_groups_out() -> None:
    fit = ComputeFit(last_layer=5)
    decode = spread_jobs(2, 8)
    prefill = Job(9, 0, 2, (30, 31), lane=9, num_tokens=256, prefill=True)
    for size in (1, 2, 4, 8):
        fit.observe_group(decode[:size], 0.010 + 0.002 * 2 * size)
        fit.observe_group([prefill, *decode[:size]], 0.200)  # a chunk of 256 tokens in the group
    assert fit.observed == 4
    assert fit(decode[:1]) == pytest.approx(0.014) and fit(decode) == pytest.approx(0.042)


def test_compute_fit_prices_a_group_by_its_distinct_experts() -> None:
    """Each distinct expert's weights are read once per group: jobs that share experts cost less
    together than jobs that do not, so holding for a job that shares the ready group's experts
    saves more."""
    fit = ComputeFit(last_layer=5)
    for size in (1, 2, 3, 4, 6):
        fit.observe_group(spread_jobs(2, size), 0.004 + 0.001 * 2 * size)
    sharing = [job(0, 3, (0, 1)), job(1, 3, (1, 2)), job(2, 3, (0, 2))]  # 3 distinct experts
    assert fit(sharing) == pytest.approx(0.007)
    assert fit(spread_jobs(3, 3)) == pytest.approx(0.010)
    saved = fit(sharing[:2]) + fit(sharing[2:]) - fit(sharing)
    assert saved == pytest.approx(0.004 + 0.002)  # the shared part and the two experts read once


def test_compute_fit_prices_each_kind_of_layer_by_its_own_groups() -> None:
    """Entry groups (no experts) are cheap and always whole; the last layer carries the output
    head. Measured on the medium torch model, one line over all of them put the middle layers'
    shared part at twice their own: each kind has its own fit."""
    fit = ComputeFit(last_layer=5)
    entry = [job(r, ENTRY_LAYER) for r in range(8)]
    middle, last = spread_jobs(2, 8), spread_jobs(5, 8)
    assert fit(last[:2]) == 0.0
    for size in (1, 2, 3, 4, 5, 8):
        fit.observe_group(middle[:size], 0.008 + 0.0025 * 2 * size)
    assert fit(last[:2]) == pytest.approx(0.018)  # the last layer not seen yet: the middle's price
    for step in range(6):
        fit.observe_group(entry, 0.008)
        fit.observe_group(last[: 1 + step], 0.020 + 0.003 * 2 * (1 + step))
    assert fit(middle[:1]) == pytest.approx(0.013) and fit(middle[:4]) == pytest.approx(0.028)
    assert fit(last[:3]) == pytest.approx(0.038)
    assert fit(entry) == pytest.approx(0.008)
    assert fit.observed == 18
    one_line = LineFit()  # one fit over the same groups, by job count: what it says a hold saves
    for size in (1, 2, 3, 4, 5, 8):
        one_line.observe(size, 0.008 + 0.005 * size)
    for step in range(6):
        one_line.observe(8, 0.008)
        one_line.observe(1 + step, 0.020 + 0.006 * (1 + step))
    assert one_line(0) > 1.5 * 0.008  # its shared part, far off the middle layers' 8 ms


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


def test_the_links_busy_time_counts_reads_in_flight_together_once() -> None:
    recorder = Recorder()
    recorder.read_started(0.0)
    recorder.read_started(1.0)
    recorder.read_ended(2.0)  # one of the two failed: the other keeps the link busy
    recorder.read_ended(3.0)
    recorder.read_started(5.0)  # the link idled from 3 to 5
    recorder.fetch(5.0, 6.0, ExpertKey(1, 0), False)  # this one landed
    assert recorder.link_seconds == 4.0 and recorder.reads == 1
    # in a run, two reads in flight: the union of the reads' intervals, less than their sum
    trace = random_trace(requests=4, steps=3, layers=5, experts=16, top_k=2, seed=1)
    runtime = simulate(trace, policy="runahead", slots=10, requests=[RequestSpec(r, 3) for r in range(4)])
    reads = [(record.start, record.end) for record in runtime.recorder.fetches]
    assert runtime.recorder.link_seconds == pytest.approx(total(union(reads)), abs=1e-9)
    assert runtime.recorder.link_seconds < 0.9 * runtime.recorder.read_seconds


class _Unpriced:
    """A backend without a cost model (the torch and MLX backends): the scheduler measures."""

    num_layers = 4


def measuring_scheduler(recorder: Recorder) -> ComputeScheduler:
    """A scheduler actor on its own, over a backend without a cost model."""
    return ComputeScheduler(
        backend=_Unpriced(),  # type: ignore[arg-type]
        cache=ExpertCache(4),
        queue=ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True)),
        barrier=StepBarrier(True),
        inbox=Mailbox(),
        issuer=asyncio.Queue(),
        clock=Clock(),
        recorder=recorder,
        sink=None,  # type: ignore[arg-type]
    )


async def test_without_a_cost_model_the_rule_reads_the_links_busy_time_per_read() -> None:
    recorder = Recorder()
    for start in (0.0, 0.0, 0.01, 0.01):  # two reads in flight at a time: 10 ms each, 5 ms of link
        recorder.read_started(start)
    for end in (0.01, 0.01, 0.02, 0.02):
        recorder.fetch(end - 0.01, end, ExpertKey(1, 0), False)  # landed: the read ends there
    recorder.compute(0.0, 0.006, 1, (0,))
    recorder.compute(0.006, 0.024, 2, (0, 1, 2))
    scheduler = measuring_scheduler(recorder)
    scheduler._fit.observe_group(spread_jobs(1, 1), 0.006)
    scheduler._fit.observe_group(spread_jobs(2, 3), 0.018)
    scheduler.blocked[1] = job(1, 3, (4,))
    view = scheduler._outlook()
    assert view is not None
    assert view.fetch_s == pytest.approx(0.005)  # 20 ms of link for 4 reads, not 40 ms of reads
    assert view.compute_share == pytest.approx(0.024 / 0.02)


async def test_without_a_cost_model_the_rule_waits_for_a_fit_of_the_middle_layers() -> None:
    """Entry groups alone (no experts, one size) say nothing of what a hold saves at a middle layer:
    until two middle-layer groups are measured the scheduler groups as the paper does."""
    recorder = Recorder()
    recorder.read_started(0.0)
    recorder.fetch(0.0, 0.01, ExpertKey(1, 0), False)
    recorder.compute(0.01, 0.02, 1, (0,))
    scheduler = measuring_scheduler(recorder)
    scheduler.blocked[1] = job(1, 2, (4,))
    for _ in range(3):
        scheduler._fit.observe_group([job(r, ENTRY_LAYER) for r in range(4)], 0.004)
    assert scheduler._outlook() is None
    scheduler._fit.observe_group(spread_jobs(1, 1), 0.006)
    assert scheduler._outlook() is None
    scheduler._fit.observe_group(spread_jobs(2, 3), 0.018)
    assert scheduler._outlook() is not None


def test_a_hold_whose_timer_fires_early_still_waits_to_its_deadline() -> None:
    """uvloop rounds a timer of 0.3 ms to none (and 2.3 ms to 2): a hold still lasts until its
    deadline, or a message, and counts once."""

    async def holds() -> list[int]:
        recorder = Recorder()
        scheduler, clock, counts = measuring_scheduler(recorder), Clock(), []
        for wait in (0.0023, 0.0003):
            deadline = clock.now() + wait
            await scheduler._hold(deadline)
            assert clock.now() >= deadline - 1e-6
            counts.append(recorder.holds)
        scheduler.inbox.put_nowait(Ready(()))  # a message ends a hold at once
        start = clock.now()
        await scheduler._hold(start + 1.0)
        assert clock.now() - start < 0.5
        counts.append(recorder.holds)
        return counts

    for factory in {loop_factory(), None}:
        with asyncio.Runner(loop_factory=factory) as runner:
            assert runner.run(holds()) == [1, 2, 3], factory


def test_without_a_cost_model_the_compute_share_is_the_last_steps() -> None:
    """A real run starts with a cold cache (link-bound); the share the rule gates on must follow
    the steps since, not stay below the gate for the whole run."""
    recorder = Recorder()
    scheduler = measuring_scheduler(recorder)
    scheduler.requests = {0: RequestSpec(0, 8), 1: RequestSpec(1, 8)}
    shares = []
    for step in range(8):  # a cold first step (1 s of compute, 10 s of link), then 2 s / 1 s
        recorder.compute_seconds += 1.0 if step == 0 else 2.0
        recorder.link_seconds += 10.0 if step == 0 else 1.0
        recorder.token_count += 2
        shares.append(scheduler._recent_share(recorder.compute_seconds, recorder.link_seconds))
    assert shares[0] == pytest.approx(0.1)
    assert shares[-1] == pytest.approx(2.0)  # the last SHARE_WINDOW_STEPS steps
    assert recorder.compute_seconds / recorder.link_seconds < HOLD_MIN_COMPUTE_SHARE  # since the start


async def test_steps_batched_by_adaptive_grouping_are_left_out_of_what_the_rule_measures() -> None:
    """While batching the compute is small beside the link: counted, it would keep the rule from
    holding for several steps after a switch back to running ahead, and the read time it prices
    would be batching's."""
    recorder = Recorder()
    scheduler = measuring_scheduler(recorder)
    scheduler.requests = {0: RequestSpec(0, 8), 1: RequestSpec(1, 8)}
    scheduler._fit.observe_group(spread_jobs(1, 1), 0.006)
    scheduler._fit.observe_group(spread_jobs(2, 3), 0.018)
    scheduler.blocked[1] = job(1, 3, (4,))

    def step(compute: float, link: float, reads: int) -> Outlook | None:
        recorder.compute_seconds += compute
        recorder.link_seconds += link
        recorder.reads += reads
        recorder.token_count += 2
        return scheduler._outlook()

    for _ in range(6):
        step(2.0, 1.0, 10)  # running ahead: compute-bound, 0.1 s of link a read
    scheduler._set_mode(Mode.BATCH)
    for _ in range(6):
        recorder.compute_seconds += 0.2  # batching: link-bound, 0.5 s a read (not asked: no rule)
        recorder.link_seconds += 1.0
        recorder.reads += 2
        recorder.token_count += 2
    scheduler._set_mode(Mode.AHEAD)
    assert scheduler.queue.grouping == Grouping(bottleneck=True) and recorder.mode_switches == 2
    view = step(2.0, 1.0, 10)
    assert view is not None
    assert view.compute_share == pytest.approx(2.0)
    assert view.fetch_s == pytest.approx(0.1)
