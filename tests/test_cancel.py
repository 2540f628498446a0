"""Cancellation: a cancelled request releases its pins and KV cache at once; the others are unaffected."""

from __future__ import annotations

import asyncio

import pytest

from runahead.backends.sim import SimBackend, sim_token
from runahead.clock import run_virtual
from runahead.jobs import RequestSpec
from runahead.runtime import Runtime, RuntimeConfig

from simhelpers import COSTS, random_trace

TRACE = random_trace(requests=4, steps=12, layers=3, experts=8, top_k=2, seed=5)


def runtime(policy: str = "runahead", slots: int = 8, barrier: bool = True) -> Runtime:
    return Runtime(
        SimBackend(TRACE, COSTS), RuntimeConfig(cache_slots=slots, policy=policy, step_barrier=barrier)
    )


@pytest.mark.parametrize("policy", ["runahead", "sync", "prefetch-gate"])
@pytest.mark.parametrize("barrier", [True, False])
@pytest.mark.parametrize("after_ms", [0.0, 7.7, 40.0, 91.3, 133.3, 1000.0])
def test_cancel_at_any_moment(policy: str, barrier: bool, after_ms: float) -> None:
    rt = runtime(policy, barrier=barrier)

    async def main() -> tuple[list[list[int]], bool]:
        async with rt:
            handles = rt.submit(*(RequestSpec(r, max_tokens=12) for r in range(4)))
            await asyncio.sleep(after_ms / 1000)
            handles[1].cancel()
            results = [await h.result() for h in handles]
            return results, handles[1].cancelled

    results, cancelled = run_virtual(main)
    for r in (0, 2, 3):
        assert results[r] == [sim_token(RequestSpec(r, 12), s) for s in range(12)]
    assert results[1] == [sim_token(RequestSpec(1, 12), s) for s in range(len(results[1]))]
    assert cancelled == (len(results[1]) < 12)
    assert cancelled == (after_ms < 1000)  # mid-run it stops early; after the end it is a no-op
    assert rt.cache.is_idle()
    assert not rt.backend._requests  # type: ignore[attr-defined]  # every KV cache freed


def test_cancelling_a_queued_request_never_admits_it() -> None:
    rt = runtime(slots=2)  # room for one request at a time

    async def main() -> tuple[list[int], list[int], bool]:
        async with rt:
            first, second = rt.submit(RequestSpec(0, max_tokens=5), RequestSpec(1, max_tokens=5))
            second.cancel()
            return await first.result(), await second.result(), second.cancelled

    first, second, cancelled = run_virtual(main)
    assert len(first) == 5 and second == [] and cancelled
    assert 1 not in {request for record in rt.recorder.computes for request in record.requests}


def test_streaming_yields_tokens_as_they_come_and_cancel_is_idempotent() -> None:
    rt = runtime()

    async def main() -> tuple[list[tuple[int, float]], list[int]]:
        seen = []
        async with rt:
            (handle,) = rt.submit(RequestSpec(0, max_tokens=6))
            async for token in handle.stream():
                seen.append((token, asyncio.get_running_loop().time()))
            handle.cancel()
            handle.cancel()
            return seen, await handle.result()

    seen, tokens = run_virtual(main)
    assert [t for t, _ in seen] == tokens and len(tokens) == 6
    times = [time for _, time in seen]
    assert times == sorted(times) and times[0] < times[-1]
