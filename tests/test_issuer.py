"""The JobIssuer on its own: stale fetch notices and prefill waves."""

import asyncio

from runahead.actors.issuer import JobIssuer
from runahead.cache import ExpertCache
from runahead.jobs import ExpertKey, Job, expert_id, expert_ids
from runahead.messages import Blocked, FetchDone, NextJobs, Ready
from runahead.metrics import Recorder


class Backend:
    num_layers = 4
    experts_per_job = 2

    def open_request(self, request: object) -> None: ...

    def close_request(self, request: int) -> None: ...


def issuer(cache: ExpertCache) -> tuple[JobIssuer, asyncio.Queue, asyncio.Queue]:  # type: ignore[type-arg]
    scheduler: asyncio.Queue = asyncio.Queue()  # type: ignore[type-arg]
    fetcher: asyncio.Queue = asyncio.Queue()  # type: ignore[type-arg]
    actor = JobIssuer(
        backend=Backend(),
        cache=cache,
        predictor=None,
        inbox=asyncio.Queue(),  # type: ignore[arg-type]
        scheduler=scheduler,
        fetcher=fetcher,
        recorder=Recorder(),
    )
    return actor, scheduler, fetcher


async def test_a_stale_fetch_notice_does_not_release_a_job() -> None:
    cache = ExpertCache(2)
    key = ExpertKey(1, 5)
    actor, scheduler, _ = issuer(cache)
    # an earlier read of `key` landed; its notice is still unread when the expert is evicted ...
    cache.warm([key])
    stale = FetchDone(expert_id(key))
    cache.warm([ExpertKey(1, 6), ExpertKey(1, 7)])  # evicts `key`
    assert cache.state(key) is None
    # ... and a new job wants it again
    actor.handle(NextJobs((Job(3, 0, 1, (5,)),)))
    assert scheduler.get_nowait() == Ready((), reply=True)
    actor.handle(stale)
    assert scheduler.empty()  # still waiting: the expert is not resident
    cache.reserve(key)
    cache.complete(key)
    actor.handle(FetchDone(expert_id(key)))
    ready = scheduler.get_nowait()
    assert [job.request for job in ready.jobs] == [3]


async def test_a_job_with_more_experts_than_its_budget_runs_in_waves_resident_first() -> None:
    cache = ExpertCache(8)
    cache.warm([ExpertKey(2, 7)])
    actor, scheduler, fetcher = issuer(cache)
    actor.handle(NextJobs((Job(0, 0, 2, (1, 3, 5, 7, 9), prefill=True, num_tokens=4),)))
    assert scheduler.get_nowait() == Ready((), reply=True)
    blocked = fetcher.get_nowait()
    assert isinstance(blocked, Blocked)
    assert blocked.job.experts == (7, 1)  # the resident expert first, then the budget's rest
    assert blocked.job.remaining == (3, 5, 9)
    assert blocked.missing == (expert_id(ExpertKey(2, 1)),)
    assert cache.refcount(ExpertKey(2, 3)) == 0  # later waves pin nothing yet


async def test_waves_take_resident_then_arriving_then_wanted_then_the_rest_each_by_number() -> None:
    """A later wave's experts come in the previous wave's order, not sorted: the order is the
    experts' states then their numbers, whatever order they came in."""
    cache = ExpertCache(16)
    cache.warm([ExpertKey(2, 7)])
    assert cache.pin_ids(expert_ids(2, (9, 3))) == expert_ids(2, (9, 3))  # another job wants them,
    cache.reserve(ExpertKey(2, 9))  # and 9's read is on its way
    states = [cache.state(ExpertKey(2, e)) for e in (7, 9, 3, 1)]
    assert [s.value if s else None for s in states] == ["resident", "pending", "wanted", None]
    actor, _, fetcher = issuer(cache)
    actor.handle(NextJobs((Job(0, 0, 2, (11, 3, 9, 1, 7, 5), prefill=True, num_tokens=4),)))
    blocked = fetcher.get_nowait()
    assert blocked.job.experts == (7, 9)
    assert blocked.job.remaining == (3, 1, 5, 11)
