"""A failure in any actor surfaces as an error from the run; nothing hangs."""

import asyncio
from collections.abc import Sequence

import pytest

from runahead.backends.sim import FixedCosts, SimBackend
from runahead.cache import ExpertCache
from runahead.clock import SimulationStalled, run_virtual
from runahead.jobs import ExpertKey, RequestSpec
from runahead.runtime import Runtime, RuntimeConfig

from simhelpers import random_trace

TRACE = random_trace(requests=3, steps=2, layers=3, experts=6, top_k=2)
REQUESTS = [RequestSpec(r, max_tokens=2) for r in range(3)]
COSTS = FixedCosts(0.001, 0.0001, 0.0005)


class BrokenCompute(SimBackend):
    async def compute(self, group):  # type: ignore[no-untyped-def]
        if group.layer == 1:
            raise OSError("device lost")
        return await super().compute(group)


class BrokenFetch(SimBackend):
    async def fetch(self, key, slot):  # type: ignore[no-untyped-def]
        raise OSError(f"short read of {key}")


class HungFetch(SimBackend):
    async def fetch(self, key, slot):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()  # a read that never completes


class WrongResults(SimBackend):
    async def compute(self, group):  # type: ignore[no-untyped-def]
        return (await super().compute(group))[:-1]


def run(backend: SimBackend) -> dict[int, list[int]]:
    runtime = Runtime(backend, RuntimeConfig(cache_slots=6))
    return run_virtual(lambda: runtime.run(REQUESTS))


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        (BrokenCompute, "device lost"),
        (BrokenFetch, "short read"),
        (WrongResults, r"returned 2 results for a group of 3 jobs"),
    ],
)
def test_actor_errors_reach_the_caller(backend: type[SimBackend], message: str) -> None:
    with pytest.raises(Exception) as caught:  # one error, or a group when two reads fail at once
        run(backend(random_trace(requests=3, steps=2, layers=3, experts=6, top_k=2), COSTS))
    if isinstance(caught.value, BaseExceptionGroup):
        assert caught.group_contains(Exception, match=message)
    else:
        assert caught.match(message)


def test_a_read_that_never_lands_is_reported_as_a_stall() -> None:
    with pytest.raises(SimulationStalled, match="nothing is scheduled"):
        run(HungFetch(TRACE, COSTS))


def test_a_trace_too_short_for_the_request_is_named() -> None:
    runtime = Runtime(SimBackend(TRACE, COSTS), RuntimeConfig(cache_slots=6))
    with pytest.raises(ValueError, match=r"needs 5 trace steps .* but the trace has 2"):
        run_virtual(lambda: runtime.run([RequestSpec(0, max_tokens=5)]))


def test_duplicate_request_ids_are_refused() -> None:
    runtime = Runtime(SimBackend(TRACE, COSTS), RuntimeConfig(cache_slots=6))
    with pytest.raises(ValueError, match="request id 0 was already submitted"):
        run_virtual(lambda: runtime.run([RequestSpec(0, 1), RequestSpec(0, 1)]))


def test_bad_request_values_are_named() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        RequestSpec(0, max_tokens=0)


def test_the_sim_refuses_a_job_computed_before_its_experts_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken issuer that calls every expert resident is caught at the compute, not trusted."""
    monkeypatch.setattr(ExpertCache, "pin_all", lambda self, keys: ())
    with pytest.raises(RuntimeError, match=r"computed before expert ExpertKey\(.*\) was ready"):
        run(SimBackend(TRACE, COSTS))


def test_the_sim_refuses_a_job_whose_experts_are_not_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken issuer that drops a job's pins on resident experts: they could be evicted mid-compute."""
    pin_all = ExpertCache.pin_all

    def pin_then_drop(self: ExpertCache, keys: Sequence[ExpertKey]) -> tuple[ExpertKey, ...]:
        missing = pin_all(self, keys)
        for key in keys:
            if key not in missing:
                self.unpin(key)
        return missing

    monkeypatch.setattr(ExpertCache, "pin_all", pin_then_drop)
    with pytest.raises(RuntimeError, match=r"was ready \(cache state resident, pins 0\)"):
        run(SimBackend(TRACE, COSTS))
