"""The ``sim`` backend: modelled hardware, routing from a trace, on virtual time.

The same actors run unchanged. ``compute`` waits the cost model's time for the group; ``fetch``
models the link: a read issued at ``t`` starts moving bytes at ``max(t + latency, link free)`` and
holds the link for ``bytes / bandwidth``, so reads in flight overlap their latencies but share the
bandwidth. Run on a virtual-time loop (:func:`runahead.clock.run_virtual`) a long experiment takes
seconds of wall time and gives identical results every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runahead.clock import Clock
from runahead.jobs import ENTRY_LAYER, ExpertKey, Group, JobResult, RequestSpec


class SimCosts(Protocol):
    """Durations the sim charges (:class:`runahead.costs.CostModel` is the calibrated one)."""

    @property
    def link_latency_s(self) -> float: ...

    def fetch_transfer_time(self) -> float:
        """Seconds one expert's bytes hold the link."""
        ...

    def compute_time(
        self, layer: int, num_tokens: Sequence[int], context_lengths: Sequence[int], distinct_experts: int
    ) -> float:
        """Seconds one group at ``layer`` keeps the compute unit busy."""
        ...


@dataclass(frozen=True, slots=True)
class FixedCosts:
    """Hand-set costs for exact timeline tests: ``group_s + per_expert_s * distinct`` per group."""

    group_s: float
    per_expert_s: float
    transfer_s: float
    latency_s: float = 0.0

    @property
    def link_latency_s(self) -> float:
        return self.latency_s

    def fetch_transfer_time(self) -> float:
        return self.transfer_s

    def compute_time(
        self, layer: int, num_tokens: Sequence[int], context_lengths: Sequence[int], distinct_experts: int
    ) -> float:
        return self.group_s + self.per_expert_s * distinct_experts


class Routing(Protocol):
    """Which experts each request's gate selects (:class:`runahead.trace.RoutingTrace`)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_steps(self) -> int: ...

    @property
    def num_requests(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    def selections(self, request: int) -> list[list[tuple[int, ...]]]: ...

    def predictions(self, request: int) -> list[list[tuple[int, ...]]]: ...


class SimBackend:
    """A backend whose compute and link are models; routing comes from ``routing``.

    Request ``r`` follows trace request ``trace_index`` (default ``r`` modulo the trace's requests)
    from trace step ``step_offset`` on; its context grows from ``prompt_tokens`` by one per step.
    With ``zero_cost`` every operation takes no time (to measure the runtime's own overhead).
    """

    def __init__(
        self,
        routing: Routing,
        costs: SimCosts,
        *,
        step_offset: int = 0,
        zero_cost: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.routing = routing
        self.costs = costs
        self.num_layers = routing.num_layers
        self.experts_per_job = routing.top_k
        self.step_offset = step_offset
        self.zero_cost = zero_cost
        self.clock = clock or Clock()
        self._requests: dict[
            int, tuple[RequestSpec, list[list[tuple[int, ...]]], list[list[tuple[int, ...]]]]
        ] = {}
        self._link_free = 0.0

    def open_request(self, request: RequestSpec) -> None:
        index = request.trace_index if request.trace_index is not None else request.request
        index %= self.routing.num_requests
        needed = self.step_offset + request.max_tokens
        if needed > self.routing.num_steps:
            raise ValueError(
                f"request {request.request} needs {needed} trace steps (offset {self.step_offset} + "
                f"{request.max_tokens} tokens) but the trace has {self.routing.num_steps}"
            )
        self._requests[request.request] = (
            request,
            self.routing.selections(index),
            self.routing.predictions(index),
        )

    def close_request(self, request: int) -> None:
        self._requests.pop(request, None)

    async def fetch(self, key: ExpertKey, slot: int) -> None:
        if self.zero_cost:
            await self.clock.sleep(0.0)
            return
        start = max(self.clock.now() + self.costs.link_latency_s, self._link_free)
        self._link_free = start + self.costs.fetch_transfer_time()
        await self.clock.sleep_until(self._link_free)

    async def compute(self, group: Group) -> Sequence[JobResult]:
        layer = group.layer
        if self.zero_cost:
            await self.clock.sleep(0.0)
        else:
            contexts = [self._requests[j.request][0].prompt_tokens + j.step for j in group.jobs]
            tokens = [j.num_tokens for j in group.jobs]
            await self.clock.sleep(self.costs.compute_time(layer, tokens, contexts, group.distinct_experts()))
        results = []
        last = self.num_layers - 1
        for job in group.jobs:
            spec, selections, predictions = self._requests[job.request]
            step = self.step_offset + job.step
            if layer == last:
                results.append(JobResult(job, token=sim_token(spec, job.step)))
                continue
            following = layer + 2
            predicted = predictions[step][following] if following <= last else ()
            results.append(JobResult(job, selections[step][layer + 1], predicted))
        return results


def sim_token(request: RequestSpec, step: int) -> int:
    """The sim has no model: its "token" is a fixed function of the request and step."""
    index = request.trace_index if request.trace_index is not None else request.request
    return (index * 1_000_003 + step) % 50_000


__all__ = ["ENTRY_LAYER", "FixedCosts", "Routing", "SimBackend", "SimCosts", "sim_token"]
