"""Cancellation: a cancelled request releases its pins and KV cache at once; the others are unaffected."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runahead.backends.sim import SimBackend, sim_token
from runahead.clock import run_virtual
from runahead.jobs import ExpertKey, RequestSpec
from runahead.runtime import Runtime, RuntimeConfig

from simhelpers import COSTS, POLICIES, random_trace

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


LINK_TICK_US = 500  # the sim's transfer time per expert (COSTS.transfer_s): cancels land on read ends


class HoppingSim(SimBackend):
    """The sim, with each read's end (and so its worker's next pick) delayed by a few loop turns.

    At one virtual instant the loop runs ready tasks in one fixed order; the extra turns let
    hypothesis reorder a worker's next pick against the issuer's and the fetcher's handling of a
    cancellation, the way real time does by chance.
    """

    def __init__(self, hops: list[int], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hops = itertools.cycle(hops)

    async def fetch(self, key: ExpertKey, slot: int) -> None:
        await super().fetch(key, slot)
        for _ in range(next(self.hops)):
            await asyncio.sleep(0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    depth=st.integers(1, 3),
    barrier=st.booleans(),
    requests=st.integers(1, 4),
    extra_slots=st.integers(0, 3),
    hops=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    cancels=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 3)),
        min_size=1,
        max_size=4,
    ),
)
def test_cancellations_interleaved_with_fetch_completions(
    policy: str,
    depth: int,
    barrier: bool,
    requests: int,
    extra_slots: int,
    hops: list[int],
    cancels: list[tuple[int, int, int]],
) -> None:
    """Cancels at read completions, in every order of the actors' turns at that instant.

    A cancel lands at a multiple of the link's transfer time after the start (plus latency, so
    exactly where reads end), then waits some loop turns; reads' ends wait some turns too.
    """
    slots = 2 * requests + extra_slots  # tight: cancellations free slots others are waiting for
    rt = Runtime(
        HoppingSim(hops, TRACE, COSTS),
        RuntimeConfig(cache_slots=slots, policy=policy, step_barrier=barrier, link_queue_depth=depth),
    )

    async def main() -> list[tuple[list[int], bool]]:
        async with rt:
            handles = rt.submit(*(RequestSpec(r, max_tokens=12) for r in range(requests)))
            start = asyncio.get_running_loop().time()
            for request, ticks, turns in sorted(cancels, key=lambda c: c[1]):
                when = start + COSTS.latency_s + ticks * LINK_TICK_US / 1e6
                await asyncio.sleep(max(0.0, when - asyncio.get_running_loop().time()))
                for _ in range(turns):
                    await asyncio.sleep(0)
                if request < requests:
                    handles[request].cancel()
            return [(await h.result(), h.cancelled) for h in handles]

    results = run_virtual(main)
    for r, (tokens, cancelled) in enumerate(results):
        assert tokens == [sim_token(RequestSpec(r, 12), s) for s in range(len(tokens))]
        assert cancelled == (len(tokens) < 12)
    assert rt.cache.is_idle() and rt.cache.pinned_count() == 0
    assert not rt.backend._requests  # type: ignore[attr-defined]
