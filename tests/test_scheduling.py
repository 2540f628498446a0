"""Algorithm 1 as pure code: group choice, fetch choice, prefetch hints, the step barrier, policy names."""

import dataclasses

import pytest

from runahead.cache import ExpertCache
from runahead.jobs import ENTRY_LAYER, ExpertKey, Job, expert_id, expert_key
from runahead.policy import BASE_POLICIES, parse_policy
from runahead.prefetch import HistoryPredictor
from runahead.scheduling import (
    ComputeOrder,
    ComputeQueue,
    FetchOrder,
    FetchQueue,
    Grouping,
    PrefetchQueue,
    StepBarrier,
)


def job(
    request: int, layer: int, experts: tuple[int, ...] = (), epoch: int = 0, lane: int | None = None
) -> Job:
    return Job(request, 0, layer, experts, lane=request if lane is None else lane, epoch=epoch)


def positions(*jobs: Job) -> dict[int, tuple[int, int]]:
    return {j.request: j.progress for j in jobs}


def lanes(*jobs: Job) -> dict[int, int]:
    return {j.request: j.lane for j in jobs}


def test_opportunistic_groups_every_ready_job_at_the_lowest_layer() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping())
    jobs = [job(0, 5), job(1, 3), job(2, 3), job(3, 7)]
    for j in jobs:
        queue.add(j)
    group = queue.select_group(positions(*jobs), lanes(*jobs))
    assert group is not None and group.layer == 3
    assert [j.request for j in group.jobs] == [1, 2]
    assert queue.select_group({}, {}).layer == 5  # type: ignore[union-attr]


def test_least_progress_counts_epochs_before_layers() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping())
    behind, ahead, same_layer = job(0, 9, epoch=3), job(1, 2, epoch=4), job(2, 9, epoch=4)
    for j in (ahead, behind, same_layer):
        queue.add(j)
    group = queue.select_group({}, {})
    assert group is not None and group.layer == 9
    assert {j.request for j in group.jobs} == {0, 2}  # same layer groups across steps


def test_fifo_compute_order_picks_the_oldest_ready_job_layer() -> None:
    queue = ComputeQueue(ComputeOrder.FIFO, Grouping())
    for j in (job(0, 6), job(1, 2), job(2, 6)):
        queue.add(j)
    group = queue.select_group({}, {})
    assert group is not None and group.layer == 6 and len(group.jobs) == 2


def test_static_group_waits_for_every_member_at_its_lowest_layer() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping.parse("static:2:2"))
    a, b, c, d = job(0, 1), job(1, 1), job(2, 4), job(3, 4)
    queue.add(a)
    queue.add(c)
    queue.add(d)
    everyone = positions(a, b, c, d)
    group = queue.select_group(everyone, lanes(a, b, c, d))
    assert group is not None and [j.request for j in group.jobs] == [2, 3]  # lanes 0-1 wait for b
    assert queue.select_group(everyone, lanes(a, b, c, d)) is None
    queue.add(b)
    group = queue.select_group(everyone, lanes(a, b, c, d))
    assert group is not None and [j.request for j in group.jobs] == [0, 1]


def test_static_group_ignores_members_held_at_the_barrier() -> None:
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(static=True))
    a = job(0, 3)
    queue.add(a)
    group = queue.select_group(positions(a), {0: 0, 1: 1})  # request 1 is held: no position
    assert group is not None and group.jobs == (a,)


def test_grouping_parse_and_lanes() -> None:
    grouping = Grouping.parse("static:2:1")
    assert [grouping.group_of_lane(lane) for lane in range(6)] == [0, 0, 1, 2, 2, 3]
    assert Grouping.parse("static:all").group_of_lane(99) == 0
    assert str(grouping) == "static:2:1"
    for bad in ("static", "static:0", "static:a", "batch:2"):
        with pytest.raises(ValueError, match="grouping"):
            Grouping.parse(bad)


def blocked(queue: FetchQueue, cache: ExpertCache, j: Job) -> None:
    queue.add(j, cache.pin_ids(j.ids), cache)


def chosen(queue: FetchQueue, cache: ExpertCache) -> ExpertKey | None:
    """The key of the expert the queue picks (the queue speaks ids, as the cache's hot path)."""
    expert = queue.select(cache)
    return None if expert is None else expert_key(expert)


def test_fetch_order_lowest_layer_then_fewest_missing() -> None:
    cache = ExpertCache(64)
    queue = FetchQueue(FetchOrder.LOWEST_LAYER_SRTF)
    blocked(queue, cache, job(0, 4, (1, 2)))
    blocked(queue, cache, job(1, 2, (1, 2, 3)))
    blocked(queue, cache, job(2, 2, (5,)))
    assert chosen(queue, cache) == ExpertKey(2, 5)  # layer 2, one missing


def test_global_srtf_ignores_layers_and_fifo_ignores_both() -> None:
    for order, expected in ((FetchOrder.GLOBAL_SRTF, ExpertKey(4, 9)), (FetchOrder.FIFO, ExpertKey(2, 1))):
        cache = ExpertCache(64)
        queue = FetchQueue(order)
        blocked(queue, cache, job(0, 2, (1, 2, 3)))
        blocked(queue, cache, job(1, 4, (9,)))
        assert chosen(queue, cache) == expected


def test_remaining_missing_shrinks_as_shared_reads_land() -> None:
    cache = ExpertCache(64)
    queue = FetchQueue(FetchOrder.GLOBAL_SRTF)
    blocked(queue, cache, job(0, 1, (1, 2, 3)))  # m = 3
    blocked(queue, cache, job(1, 1, (1, 2, 7, 8)))  # m = 4, shares 1 and 2
    for key in (ExpertKey(1, 1), ExpertKey(1, 2)):
        cache.reserve(key)
        queue.started(expert_id(key))
        cache.complete(key)
        queue.landed(expert_id(key))
    assert chosen(queue, cache) == ExpertKey(1, 3)  # request 0 has one missing left, request 1 has two
    cache.reserve(ExpertKey(1, 3))
    queue.started(expert_id(ExpertKey(1, 3)))  # request 0's last one is on its way: it leaves J_B
    assert len(queue) == 1
    assert chosen(queue, cache) == ExpertKey(1, 7)


def test_prefetch_hints_replace_and_skip_known_experts() -> None:
    cache = ExpertCache(8)
    hints = PrefetchQueue()
    hints.add(0, (0, 3), map(expert_id, [ExpertKey(3, 1), ExpertKey(3, 2)]))
    hints.add(1, (0, 2), [expert_id(ExpertKey(2, 4))])
    cache.pin(ExpertKey(2, 4))  # already wanted by a job: the demand queue's
    assert hints.select(cache) == (expert_id(ExpertKey(3, 1)), 0)
    hints.add(0, (0, 4), [expert_id(ExpertKey(4, 6))])  # newer hint of request 0 replaces the stale one
    assert hints.select(cache) == (expert_id(ExpertKey(4, 6)), 0)
    hints.discard(0)
    assert hints.select(cache) is None


def test_step_barrier_holds_entry_jobs_until_the_round_ends() -> None:
    barrier = StepBarrier(enabled=True)
    first = barrier.arrive([job(0, ENTRY_LAYER), job(1, ENTRY_LAYER)])
    assert [j.request for j in first] == [0, 1] and {j.epoch for j in first} == {0}
    assert barrier.token_done(0, job(0, ENTRY_LAYER)) == []
    assert barrier.arrive([job(2, ENTRY_LAYER)]) == []  # joins at the next round
    released = barrier.token_done(1, None)  # request 1 ends; the round is over
    assert sorted(j.request for j in released) == [0, 2] and {j.epoch for j in released} == {1}


def test_a_job_at_an_epoch_is_the_job_with_only_its_epoch_changed() -> None:
    """``Job.at_epoch`` builds what ``dataclasses.replace`` would (a new field must be passed on too)."""
    full = Job(3, 5, 7, (1, 2), lane=4, num_tokens=9, predicted_next=(6,), epoch=2, remaining=(8,), wave=1)
    prompt = Job(1, 0, ENTRY_LAYER, num_tokens=16, prefill=True)
    for original in (full, prompt):
        moved = original.at_epoch(11)
        assert moved == dataclasses.replace(original, epoch=11) and moved.ids == original.ids


def test_step_barrier_off_passes_jobs_through() -> None:
    barrier = StepBarrier(enabled=False)
    j = job(0, ENTRY_LAYER, epoch=7)
    assert barrier.token_done(0, j) == [j]
    assert barrier.arrive([j]) == [j]


def test_policy_names_and_knobs() -> None:
    assert set(BASE_POLICIES) == {
        "runahead",
        "runahead+prefetch",
        "sync",
        "prefetch-gate",
        "prefetch-history",
    }
    config = parse_policy("runahead/compute=fifo/fetch=global-srtf/grouping=static:2:2:2")
    assert config.compute_order is ComputeOrder.FIFO
    assert config.fetch_order is FetchOrder.GLOBAL_SRTF
    assert config.grouping == Grouping(static=True, sizes=(2, 2, 2))
    assert parse_policy(config.spec) == config
    assert parse_policy("sync").grouping.static and parse_policy("prefetch-history").prefetch == "history"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fastest", "unknown policy 'fastest'"),
        ("runahead/compute=random", "'random' is not one of lowest-layer, fifo"),
        ("runahead/speed=2", "unknown knob 'speed'"),
        ("runahead/fifo", "not of the form key=value"),
    ],
)
def test_bad_policy_specs_are_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policy(spec)


def test_a_cancelled_jobs_experts_are_dropped_not_selected() -> None:
    """The issuer unpins a cancelled blocked job before the fetcher hears of it (``Forget``).

    Until then the queue still lists the job; its experts nobody else wants must not be chosen,
    while an expert another job also waits for still is.
    """
    cache = ExpertCache(64)
    queue = FetchQueue(FetchOrder.LOWEST_LAYER_SRTF)
    gone = job(0, 1, (1, 2))
    blocked(queue, cache, gone)
    blocked(queue, cache, job(1, 1, (2, 5)))
    cache.unpin_all(gone.keys)  # the issuer's cancellation: expert (1, 1) is forgotten
    assert cache.state(ExpertKey(1, 1)) is None
    assert chosen(queue, cache) == ExpertKey(1, 2)  # still wanted by request 1's job
    cache.unpin_all(job(1, 1, (2, 5)).keys)
    assert chosen(queue, cache) is None and len(queue) == 0  # nothing left that anyone wants
    queue.discard(0)
    queue.discard(1)
    assert not queue._by_key  # no per-request leftovers once both are forgotten


def test_history_prediction_takes_the_most_similar_past_token_and_ties_go_to_the_latest() -> None:
    """Similarity is the overlap at the job's layer and the one before; the prediction is that
    past token's experts one layer on."""
    predictor = HistoryPredictor(num_layers=4, history=3)
    past = [((1, 2), (3, 4), (5, 6), (7, 8)), ((1, 9), (3, 10), (11, 12), (13, 14))]
    for step, rows in enumerate(past):
        for layer, experts in enumerate(rows):
            predictor.predict(Job(0, step, layer, experts))
    # layer 0 {1, 2}: token 0 overlaps by 2, token 1 by 1
    assert predictor.predict(Job(0, 2, 0, (1, 2))) == (3, 4)
    # then layer 1 {3, 10}: token 0 scores 2 + 1, token 1 scores 1 + 2: the later one
    assert predictor.predict(Job(0, 2, 1, (3, 10))) == (11, 12)
    assert predictor.predict(Job(0, 2, 3, (7,))) == ()  # the last layer: nothing follows
    assert predictor.predict(Job(1, 0, 0, (1, 2))) == ()  # another request has no history
