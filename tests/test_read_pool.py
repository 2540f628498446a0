"""The stores' read pool: every read's outcome reaches its awaiting task, reads that land together wake
the event loop once, and a shut-down pool refuses new reads after running the queued ones."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from runahead.store.base import _Landings, _ReadPool
from runahead.store.link import link_clock


def test_each_read_gets_its_own_result_or_error() -> None:
    pool = _ReadPool(2, "test-read")

    def read(i: int) -> None:
        if i % 3 == 0:
            raise OSError(f"read {i} failed")

    async def main() -> tuple[float, list[BaseException | float], float]:
        before = link_clock()
        futures = [pool.submit(read, (i,)) for i in range(7)]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        return before, list(outcomes), link_clock()

    try:
        before, outcomes, after = asyncio.run(main())
    finally:
        pool.shutdown()
    for i, outcome in enumerate(outcomes):
        if i % 3 == 0:
            assert isinstance(outcome, OSError) and str(outcome) == f"read {i} failed"
        else:  # when it landed, on the link's clock, as the reader thread saw it
            assert isinstance(outcome, float) and before <= outcome <= after


def test_reads_that_land_while_the_loop_is_busy_wake_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    deliveries = []
    deliver = _Landings._deliver

    def counted(self: _Landings) -> None:
        deliveries.append(len(self._landed))
        deliver(self)

    monkeypatch.setattr(_Landings, "_deliver", counted)
    pool = _ReadPool(4, "test-read")
    go, landed = threading.Event(), threading.Semaphore(0)

    def read() -> None:
        go.wait(5)
        landed.release()

    async def main() -> None:
        futures = [pool.submit(read, ()) for _ in range(4)]
        go.set()
        for _ in range(4):  # the loop's thread busy (blocked) until every read has landed
            assert landed.acquire(timeout=5)
        landings = pool._landings
        assert landings is not None
        deadline = time.monotonic() + 5
        while len(landings._landed) < 4 and time.monotonic() < deadline:  # each handed its landing over
            time.sleep(0.001)
        await asyncio.gather(*futures)

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
    assert deliveries == [4]  # one wake-up delivered all four


def test_a_shut_down_pool_runs_what_was_queued_and_refuses_more() -> None:
    pool = _ReadPool(1, "test-read")
    ran: list[int] = []
    release = threading.Event()

    async def main() -> None:
        first = pool.submit(lambda: (release.wait(5), ran.append(0)), ())
        second = pool.submit(ran.append, (1,))
        closing = threading.Thread(target=pool.shutdown)
        closing.start()
        release.set()
        await asyncio.gather(first, second)
        closing.join(5)
        with pytest.raises(RuntimeError, match="shut down"):
            pool.submit(ran.append, (2,))

    asyncio.run(main())
    assert ran == [0, 1]
