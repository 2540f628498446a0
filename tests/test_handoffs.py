"""The hand-off between the event loop and a real backend's compute thread, as measured for bench rows:
the thread's own time inside ``_compute`` beside the runtime's compute time of each group."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from runahead.backends.common import RequestLifecycle, compute_cpu_share, handoff_seconds
from runahead.jobs import Group, Job, JobResult


class _Sleeper(RequestLifecycle[Any]):
    """A compute thread whose every group takes ``seconds`` (and returns one empty result a job)."""

    backend_name = "sleeper"

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self._compute_thread = ThreadPoolExecutor(1)

    def _compute(self, group: Group) -> list[JobResult]:
        time.sleep(self.seconds)
        return [JobResult(job) for job in group.jobs]


def _group() -> Group:
    return Group(0, (Job(0, 0, 0, (1,)),))


def test_the_thread_time_counts_each_group_and_the_loops_wait_shows_as_handoff() -> None:
    backend = _Sleeper(0.02)

    async def run(loop_busy_s: float) -> float:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        computing = asyncio.ensure_future(backend.compute(_group()))
        await asyncio.sleep(0)  # the hand-off is on its way
        time.sleep(loop_busy_s)  # the loop busy meanwhile: the result waits for it
        await computing
        assert loop.is_running()
        return time.perf_counter() - start

    try:
        quick = asyncio.run(run(0.0))
        assert 0.02 <= backend.thread_seconds < quick
        before = backend.thread_seconds
        slow = asyncio.run(run(0.06))  # the thread ends at ~20 ms, the loop looks at ~60 ms
        assert 0.02 <= backend.thread_seconds - before < 0.05
        # the slow group's result waited ~40 ms for the loop: ~20 ms a group over the two
        handoff = handoff_seconds(quick + slow, 2, backend)
        assert handoff is not None and handoff > 0.01
    finally:
        backend._compute_thread.shutdown()


def test_a_failing_group_still_counts_its_time() -> None:
    class Failing(_Sleeper):
        def _compute(self, group: Group) -> list[JobResult]:
            time.sleep(self.seconds)
            raise RuntimeError("broken")

    backend = Failing(0.01)
    try:
        with pytest.raises(RuntimeError, match="broken"):
            asyncio.run(backend.compute(_group()))
        assert backend.thread_seconds >= 0.01
    finally:
        backend._compute_thread.shutdown()


class _Spinner(_Sleeper):
    """A compute thread that works (in Python) for ``seconds`` a group instead of sleeping."""

    def _compute(self, group: Group) -> list[JobResult]:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return [JobResult(job) for job in group.jobs]


def test_the_compute_threads_cpu_share_tells_working_from_waiting() -> None:
    """A group that sleeps (the thread waiting, as for a core or the GIL) has a share near 0; one that
    works has most of its time on a core."""
    shares = []
    for kind in (_Sleeper, _Spinner):
        backend = kind(0.03)
        try:
            assert compute_cpu_share(backend) is None  # no group yet
            for _ in range(3):
                asyncio.run(backend.compute(_group()))
            assert backend.thread_cpu_seconds <= backend.thread_seconds + 0.005  # two clocks: a tick apart
            share = compute_cpu_share(backend)
            assert share is not None
            shares.append(share)
        finally:
            backend._compute_thread.shutdown()
    sleeping, working = shares
    assert sleeping < 0.2
    assert working > max(0.3, 2 * sleeping)


def test_no_handoff_without_a_compute_thread_or_before_any_group() -> None:
    assert handoff_seconds(1.0, 4, object()) is None  # the sim: no thread
    assert compute_cpu_share(object()) is None
    assert handoff_seconds(0.0, 0, _Sleeper(0.0)) is None
