"""Reads about to land: the modelled link's landing times, the jobs they make imminent, and the hold."""

from __future__ import annotations

import math
import random

import pytest
from groupinghelpers import job, shared_plus_per_job, states

from runahead.backend import ModelledLink
from runahead.backends.sim import SimBackend
from runahead.bottleneck import HOLD_MIN_COMPUTE_SHARE, Hold, Outlook
from runahead.jobs import ExpertId, ExpertKey, Group, RequestSpec, expert_id
from runahead.landing import (
    HOLD_LANDING_WINDOW,
    HOLD_MERGE_SHARE,
    LANDED_AFTER_S,
    LinkModel,
    MergeSaving,
    imminent,
    last_landing,
)
from runahead.scheduling import ComputeOrder, ComputeQueue, Grouping

from simhelpers import COSTS, random_trace, simulate

FETCH_S = 0.1


def test_the_link_model_carries_one_read_at_a_time_after_its_latency() -> None:
    link = LinkModel(latency_s=0.01, transfer_s=0.1)
    a, b, c = (ExpertId(i) for i in range(3))
    assert link.started(a, 0.0) == pytest.approx(0.11)
    assert link.started(b, 0.05) == pytest.approx(0.21)  # queued behind a on the link
    link.ended(a)
    assert link.lands == {b: pytest.approx(0.21)}
    assert link.started(c, 1.0) == pytest.approx(1.11)  # the link was free: latency, then transfer
    link.ended(a)  # twice, or a failed read's: nothing left to forget
    with pytest.raises(ValueError, match="latency and transfer >= 0"):
        LinkModel(0.0, -1.0)
    assert LinkModel(0.0, 0.0).started(a, 2.0) == 2.0  # a free link (the sim with no transfer cost)


def test_the_sim_lands_each_read_when_its_link_model_says() -> None:
    """The sim charges its reads through the model it shows the runtime: every read ends at the
    landing the model gave it, and nothing is left in flight after the run."""
    trace = random_trace(requests=4, steps=3, layers=4, experts=16, top_k=2, seed=3)
    runtime = simulate(trace, policy="sync", slots=12, requests=[RequestSpec(r, 3) for r in range(4)])
    backend = runtime.backend
    assert isinstance(backend, ModelledLink) and backend.landings() == {}
    replay = LinkModel(COSTS.link_latency_s, COSTS.fetch_transfer_time())
    reads = runtime.recorder.fetches
    assert reads
    for read in sorted(reads, key=lambda r: r.start):
        assert read.end == pytest.approx(replay.started(expert_id(read.key), read.start), abs=1e-12)
    zero = SimBackend(trace, COSTS, zero_cost=True)
    assert zero.landings() is None


def test_imminent_names_the_last_landing_of_jobs_at_or_below_the_layer() -> None:
    key = {e: expert_id(ExpertKey(3, e)) for e in range(6)}
    lower = expert_id(ExpertKey(2, 0))
    view = states(pending={ExpertKey(3, e) for e in range(6)} | {ExpertKey(2, 0)})[0]
    lands = {key[1]: 0.02, key[2]: 0.025, key[3]: 0.5, lower: 0.01}
    window = HOLD_LANDING_WINDOW * FETCH_S
    same, later, missing, low = job(1, 3, (1, 2)), job(2, 3, (3,)), job(3, 3, (4,)), job(4, 2, (0,))
    assert imminent(0.0, 3, [same], view, lands, window) == pytest.approx(0.025)
    assert imminent(0.0, 3, [later, missing], view, lands, window) is None  # too late; not in flight
    assert imminent(0.0, 3, [low, same], view, lands, window) == pytest.approx(0.025)
    assert imminent(0.0, 2, [same, low], view, lands, window) == pytest.approx(0.01)  # layer 3 is above
    assert imminent(0.0, 3, [job(5, 3, (5,))], states()[0], lands, window) == 0.0  # nothing missing


def test_a_job_is_about_to_be_ready_sooner_than_its_merge_pays_for() -> None:
    """Past 0.3 reads' link time a job is still waited for when its reads land within
    HOLD_MERGE_SHARE of the compute its merge with the ready group saves, per ready job (a laggard
    priced at the group's layer); never one above the group's layer."""
    view = states(pending={ExpertKey(3, 4), ExpertKey(2, 4), ExpertKey(4, 4)})[0]
    lands = {expert_id(ExpertKey(layer, 4)): 0.08 for layer in (2, 3, 4)}
    window = HOLD_LANDING_WINDOW * FETCH_S  # 0.03 s
    ready = [job(0, 3, (1,))]
    big = MergeSaving(ready, shared_plus_per_job(0.2, 0.05))  # a merge saves 0.2 s: covers 0.1 s
    small = MergeSaving(ready, shared_plus_per_job(0.1, 0.05))  # saves 0.1 s: covers 0.05 s
    same, lower, above = job(1, 3, (4,)), job(2, 2, (4,)), job(3, 4, (4,))
    assert big(same) == pytest.approx(0.2) and big(lower) == pytest.approx(0.2)
    assert HOLD_MERGE_SHARE * small(same) < 0.08 < HOLD_MERGE_SHARE * big(same)
    assert imminent(0.0, 3, [same], view, lands, window) is None  # the reads' window alone
    assert imminent(0.0, 3, [same], view, lands, window, big) == pytest.approx(0.08)
    assert imminent(0.0, 3, [lower], view, lands, window, big) == pytest.approx(0.08)
    assert imminent(0.0, 3, [same, lower], view, lands, window, small) is None
    assert imminent(0.0, 3, [above], view, lands, window, big) is None
    # with two ready jobs the same saving (0.2 s) covers half as long: both jobs' reveals wait
    pair = MergeSaving([*ready, job(6, 3, (2,))], shared_plus_per_job(0.2, 0.05))
    assert pair(same) == pytest.approx(0.2)
    assert pair.covers(same, 0.05) and not pair.covers(same, 0.08)
    assert imminent(0.0, 3, [same], view, lands, window, pair) is None
    # the ready group's own cost bounds any saving: a job landing past it is never priced
    priced = []

    def spy(jobs):  # type: ignore[no-untyped-def]
        priced.append(len(jobs))
        return 0.2 + 0.05 * len(jobs)

    far = {expert_id(ExpertKey(3, 4)): 5.0}
    assert imminent(0.0, 3, [same], view, far, window, MergeSaving(ready, spy)) is None
    assert priced == [1]  # the ready group alone


def test_stopping_early_at_a_limit_changes_no_answer() -> None:
    """``last_landing`` with ``beyond`` answers exactly while the job is ready by then, and above
    ``beyond`` otherwise; ``imminent``, which stops reading a job's experts there, names the same
    time as the plain fold over every missing expert of every job (random cases, merge window on and
    off, waits at the window's edge included)."""

    def plain(now, layer, blocked, resident, lands, window_s, saving=None):  # type: ignore[no-untyped-def]
        until = None
        for candidate in blocked:
            if candidate.layer > layer:
                continue
            ready_at = max([now, *(lands.get(e, math.inf) for e in candidate.ids if e not in resident)])
            if ready_at > now + window_s and (saving is None or not saving.covers(candidate, ready_at - now)):
                continue
            until = ready_at if until is None else max(until, ready_at)
        return until

    rng = random.Random(11)
    checked = stopped = 0
    for _ in range(400):
        now = rng.choice([0.0, 0.7, 12.3])
        keys = [ExpertKey(layer, expert) for layer in (1, 2, 3) for expert in range(6)]
        missing = set(rng.sample(keys, rng.randint(0, len(keys))))
        in_flight = [key for key in missing if rng.random() < 0.8]
        # landings on a grid of windows, so that some sit exactly at a limit
        lands = {expert_id(key): now + rng.randint(0, 12) * 0.025 for key in in_flight}
        resident = states(wanted=missing)[0]
        experts = [tuple(rng.sample(range(6), rng.randint(1, 6))) for _ in range(5)]
        blocked = [job(r, rng.choice((1, 2, 3)), ids) for r, ids in enumerate(experts)]
        ready = [job(9, 2, (0,)), job(8, 2, (1,))][: rng.randint(1, 2)]
        saving = MergeSaving(ready, shared_plus_per_job(rng.choice((0.05, 0.2, 0.4)), 0.05))
        for window in (0.0, 0.05, 0.1):
            for merge in (None, saving):
                assert imminent(now, 2, blocked, resident, lands, window, merge) == plain(
                    now, 2, blocked, resident, lands, window, merge
                )
        for candidate in blocked:
            whole = last_landing(candidate, now, resident, lands)
            beyond = now + rng.randint(0, 12) * 0.025
            early = last_landing(candidate, now, resident, lands, beyond)
            checked += 1
            if whole <= beyond:
                assert early == whole
            else:
                assert beyond < early <= whole
                stopped += early < whole
    assert checked == 2000 and stopped > 50  # the early stop happened, and answered as it should


def modelled(blocked: list, lands: dict, share: float = HOLD_MIN_COMPUTE_SHARE / 2) -> Outlook:
    resident, in_flight = states(pending={ExpertKey(3, 4), ExpertKey(3, 5)})
    cost = shared_plus_per_job(1.0, 0.1)
    return Outlook(0.0, blocked, resident, in_flight, FETCH_S, cost, share, lands=lands)


def test_plan_holds_for_a_job_about_to_be_ready_even_far_from_the_bottleneck() -> None:
    """Below the compute-share gate the rule computes the ready group at once, unless a modelled link
    says a job of its layer (or a lower one) is about to be ready: then it waits for that read."""
    queue = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping(bottleneck=True))
    queue.add(job(0, 3))
    soon = {expert_id(ExpertKey(3, 4)): 0.2 * FETCH_S}
    late = {expert_id(ExpertKey(3, 4)): 6 * FETCH_S}  # past half of what the merge saves (1 s) too
    choice = queue.plan({}, {}, modelled([job(1, 3, (4,))], soon))
    assert isinstance(choice, Hold) and choice.deadline == pytest.approx(0.2 * FETCH_S + LANDED_AFTER_S)
    for lands in (late, None):
        choice = queue.plan({}, {}, modelled([job(1, 3, (4,))], lands))  # type: ignore[arg-type]
        assert isinstance(choice, Group) and [j.request for j in choice.jobs] == [0]
        queue.add(job(0, 3))
    paper = ComputeQueue(ComputeOrder.LOWEST_LAYER, Grouping())
    paper.add(job(0, 3))
    assert isinstance(paper.plan({}, {}, modelled([job(1, 3, (4,))], soon)), Group)
