"""A failure in any actor surfaces as an error from the run; nothing hangs."""

import asyncio
from collections.abc import Sequence

import pytest

from runahead.backend import BrokenPromise
from runahead.backends.sim import FixedCosts, SimBackend, sim_token
from runahead.cache import ExpertCache
from runahead.clock import SimulationStalled, run_virtual
from runahead.health import RequestFailed, RuntimeBroken
from runahead.jobs import ExpertId, ExpertKey, RequestSpec
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
    monkeypatch.setattr(ExpertCache, "pin_ids", lambda self, experts: ())
    with pytest.raises(BrokenPromise, match=r"computed before expert ExpertKey\(.*\) was ready"):
        run(SimBackend(TRACE, COSTS))


def test_the_sim_refuses_a_job_whose_experts_are_not_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken issuer that drops a job's pins on resident experts: they could be evicted mid-compute."""
    pin_ids = ExpertCache.pin_ids

    def pin_then_drop(self: ExpertCache, experts: Sequence[ExpertId]) -> tuple[ExpertId, ...]:
        missing = pin_ids(self, experts)
        self.unpin_ids([expert for expert in experts if expert not in missing])
        return missing

    monkeypatch.setattr(ExpertCache, "pin_ids", pin_then_drop)
    with pytest.raises(BrokenPromise, match=r"was ready \(cache state resident, pins 0\)"):
        run(SimBackend(TRACE, COSTS))


def test_the_sim_refuses_a_group_whose_slot_was_refilled_while_it_computed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken cache that gives away a pinned expert's slot: the read into it lands during the compute."""

    def take_any_slot(self: ExpertCache, last_resort: bool = False) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        expert = next(iter(self._resident))  # the oldest resident, pinned or not
        self._idle.discard(expert)
        return self._resident.pop(expert)

    monkeypatch.setattr(ExpertCache, "_take_slot", take_any_slot)
    trace = random_trace(requests=3, steps=2, layers=3, experts=6, top_k=2, seed=1)
    with pytest.raises(BrokenPromise, match="group at layer 1 was evicted while it computed"):
        run(SimBackend(trace, COSTS))


# -- fault isolation: a failed read or compute fails only the requests that needed it ----------

ISOLATION_TRACE = random_trace(requests=4, steps=6, layers=3, experts=16, top_k=2, seed=11)


class FlakyReads(SimBackend):
    """Reads of ``bad`` fail with EIO ``failures`` times in all (forever if None); others succeed."""

    def __init__(self, bad: ExpertKey, failures: int | None, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.bad, self.failures, self.attempts = bad, failures, 0

    async def fetch(self, key: ExpertKey, slot: int) -> None:
        await super().fetch(key, slot)
        if key == self.bad and (self.failures is None or self.attempts < self.failures):
            self.attempts += 1
            raise OSError(5, "Input/output error", "experts.safetensors")


def users_of(key: ExpertKey, requests: int, steps: int) -> set[int]:
    """Requests whose routing selects ``key`` in their first ``steps`` steps."""
    return {
        r
        for r in range(requests)
        for step in ISOLATION_TRACE.selections(r)[:steps]
        if key.expert in step[key.layer]
    }


def run_isolated(
    backend: SimBackend, policy: str = "runahead", **config: object
) -> tuple[Runtime, dict[int, object], dict[str, object]]:
    """Run 4 requests; return the runtime, each request's tokens or error, and the health at the end."""
    runtime = Runtime(backend, RuntimeConfig(cache_slots=8, policy=policy, **config))  # type: ignore[arg-type]

    async def main() -> tuple[dict[int, object], dict[str, object]]:
        async with runtime:
            handles = runtime.submit(*(RequestSpec(r, max_tokens=6) for r in range(4)))
            outcomes: dict[int, object] = {}
            for handle in handles:
                try:
                    outcomes[handle.request] = await handle.result()
                except RequestFailed as error:
                    outcomes[handle.request] = error
            return outcomes, runtime.health_report()

    outcomes, health = run_virtual(main)
    return runtime, outcomes, health


@pytest.mark.parametrize("policy", ["runahead", "sync", "prefetch-gate"])
def test_a_read_that_keeps_failing_fails_only_the_requests_that_need_it(policy: str) -> None:
    bad = next(ExpertKey(1, e) for e in range(16) if len(users_of(ExpertKey(1, e), 4, 6)) == 2)
    users = users_of(bad, 4, 6)
    runtime, outcomes, health = run_isolated(FlakyReads(bad, None, ISOLATION_TRACE, COSTS), policy)
    failed = {r for r, outcome in outcomes.items() if isinstance(outcome, RequestFailed)}
    assert failed == users
    for r, outcome in outcomes.items():
        if r in failed:
            assert f"reading expert {bad.expert} of layer 1 failed" in str(outcome)
            assert "Input/output error" in str(outcome) and "experts.safetensors" in str(outcome)
        else:
            assert outcome == [sim_token(RequestSpec(r, 6), s) for s in range(6)]
    assert runtime.cache.is_idle() and runtime.cache.state(bad) is None  # fetchable again later
    assert not runtime.backend._requests  # type: ignore[attr-defined]
    assert health["status"] == "degraded" and f"expert {bad.expert} of layer 1" in str(health["reason"])
    assert health["requests_failed"] == len(failed)


FIRST_USED = ExpertKey(1, ISOLATION_TRACE.selections(0)[0][1][0])
"""An expert request 0 needs at its first step."""


def test_a_transient_read_error_is_retried_and_hurts_nobody() -> None:
    bad = FIRST_USED
    backend = FlakyReads(bad, 2, ISOLATION_TRACE, COSTS)
    runtime, outcomes, health = run_isolated(backend, read_retries=2)
    assert outcomes == {r: [sim_token(RequestSpec(r, 6), s) for s in range(6)] for r in range(4)}
    assert backend.attempts == 2 and runtime.health.reads_retried == 2
    assert health["status"] == "ok"  # the retry succeeded


def test_after_a_failed_read_a_later_request_fetches_the_expert_again() -> None:
    bad, user = FIRST_USED, 0
    backend = FlakyReads(bad, 3, ISOLATION_TRACE, COSTS)  # one request's worth of failures
    runtime = Runtime(backend, RuntimeConfig(cache_slots=8, read_retries=2))

    async def main() -> tuple[object, list[int], object, object]:
        async with runtime:
            (first,) = runtime.submit(RequestSpec(user, max_tokens=1))
            try:
                outcome: object = await first.result()
            except RequestFailed as error:
                outcome = error
            status = runtime.health_report()["status"]
            (again,) = runtime.submit(RequestSpec(100 + user, max_tokens=1, trace_index=user))
            tokens = await again.result()
            return outcome, tokens, status, runtime.health_report()["status"]

    outcome, tokens, status, status_after = run_virtual(main)
    assert isinstance(outcome, RequestFailed) and status == "degraded"
    assert tokens == [sim_token(RequestSpec(100 + user, 1, trace_index=user), 0)]
    assert status_after == "ok" and runtime.cache.is_resident(bad)


class FailsOnce(SimBackend):
    """The first group computed at ``layer`` raises; everything else computes."""

    def __init__(self, layer: int, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.layer = layer
        self.failed_group: tuple[int, ...] | None = None

    async def compute(self, group):  # type: ignore[no-untyped-def]
        if group.layer == self.layer and self.failed_group is None:
            self.failed_group = tuple(job.request for job in group.jobs)
            raise OSError("kernel launch failed")
        return await super().compute(group)


@pytest.mark.parametrize("policy", ["runahead", "sync"])
def test_a_failed_group_fails_only_its_own_requests(policy: str) -> None:
    backend = FailsOnce(1, ISOLATION_TRACE, COSTS)
    runtime, outcomes, health = run_isolated(backend, policy)
    assert backend.failed_group
    for r, outcome in outcomes.items():
        if r in backend.failed_group:
            assert isinstance(outcome, RequestFailed) and "kernel launch failed" in str(outcome)
        else:
            assert outcome == [sim_token(RequestSpec(r, 6), s) for s in range(6)]
    assert runtime.cache.is_idle() and not runtime.backend._requests  # type: ignore[attr-defined]
    assert runtime.health.groups_failed == 1
    if policy == "runahead":  # small groups: the others computed after the failure, so all is well
        assert len(backend.failed_group) < 4 and health["status"] == "ok"
    else:  # one group of everyone: nothing computed since, so the last compute failed
        assert len(backend.failed_group) == 4 and health["status"] == "degraded"


class DeadDevice(SimBackend):
    async def compute(self, group):  # type: ignore[no-untyped-def]
        raise OSError("device lost")


def test_computes_failing_group_after_group_stop_the_runtime_with_the_reason() -> None:
    runtime = Runtime(DeadDevice(ISOLATION_TRACE, COSTS), RuntimeConfig(cache_slots=8, policy="runahead"))
    failed: list[int] = []

    async def main() -> None:
        async with runtime:
            for r in range(4):  # one at a time: each one's first group fails
                (handle,) = runtime.submit(RequestSpec(r, max_tokens=6))
                try:
                    await handle.result()
                except RequestFailed:
                    failed.append(r)

    with pytest.raises(RuntimeBroken, match=r"3 groups in a row failed; the last: .*device lost"):
        run_virtual(main)
    assert failed == [0, 1]  # the third failure stopped the runtime
    assert runtime.health.fatal.startswith("3 groups in a row failed")
