"""The ``sim`` backend: modelled hardware, routing from a trace, on virtual time.

The same actors run unchanged. ``compute`` waits the cost model's time for the group; ``fetch``
models the link: a read issued at ``t`` starts moving bytes at ``max(t + latency, link free)`` and
holds the link for ``bytes / bandwidth``, so reads in flight overlap their latencies but share the
bandwidth. Run on a virtual-time loop (:func:`runahead.clock.run_virtual`) a long experiment takes
seconds of wall time and gives identical results every run.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol, cast

from runahead.backend import BrokenPromise
from runahead.cache import ExpertCache
from runahead.clock import Clock
from runahead.jobs import (
    ENTRY_LAYER,
    ExpertId,
    ExpertKey,
    Group,
    Job,
    JobResult,
    RequestSpec,
    expert_id,
    expert_key,
    job_ids,
)
from runahead.landing import LinkModel


class SimCosts(Protocol):
    """Durations the sim charges (:class:`runahead.costs.CostModel` is the calibrated one)."""

    @property
    def link_latency_s(self) -> float: ...

    def fetch_transfer_time(self) -> float:
        """Seconds one expert's bytes hold the link."""
        ...

    def compute_time(
        self,
        layer: int,
        num_tokens: Sequence[int],
        context_lengths: Sequence[int],
        distinct_experts: int,
        *,
        moe_only: bool = False,
        routed_fraction: float = 1.0,
    ) -> float:
        """Seconds one group at ``layer`` keeps the compute unit busy (``moe_only``: a partial wave)."""
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
        self,
        layer: int,
        num_tokens: Sequence[int],
        context_lengths: Sequence[int],
        distinct_experts: int,
        *,
        moe_only: bool = False,
        routed_fraction: float = 1.0,
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
    def num_experts(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    def selections(self, request: int) -> list[list[tuple[int, ...]]]: ...

    def predictions(self, request: int) -> list[list[tuple[int, ...]]]: ...

    def window(
        self, request: int, layer: int, start: int, count: int, *, predicted: bool = False
    ) -> tuple[int, ...]: ...


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
        self.num_experts = routing.num_experts
        self.experts_per_job = routing.top_k
        self.step_offset = step_offset
        self.zero_cost = zero_cost
        self.clock = clock or Clock()
        self._requests: dict[int, _SimRequest] = {}
        self._link = None if zero_cost else LinkModel(costs.link_latency_s, costs.fetch_transfer_time())
        self._cache: ExpertCache | None = None
        self._landed: dict[int, ExpertId] = {}  # slot -> the expert whose read into it landed
        self._reading: dict[int, ExpertId] = {}  # slot -> the expert being read into it
        self._reads_begun = 0  # reads started so far: a slot's content changes only when one starts

    def watch(self, cache: ExpertCache) -> None:
        """Check at every compute that each job's experts are resident, landed and pinned."""
        self._cache = cache

    def open_request(self, request: RequestSpec) -> None:
        index = request.trace_index if request.trace_index is not None else request.request
        index %= self.routing.num_requests
        needed = self.step_offset + request.max_tokens
        if needed > self.routing.num_steps:
            raise ValueError(
                f"request {request.request} needs {needed} trace steps (offset {self.step_offset} + "
                f"{request.max_tokens} tokens) but the trace has {self.routing.num_steps}"
            )
        self._requests[request.request] = _SimRequest(
            request, index, self.routing.selections(index), self.routing.predictions(index)
        )

    def close_request(self, request: int) -> None:
        self._requests.pop(request, None)

    def landings(self) -> Mapping[ExpertId, float] | None:
        """:class:`runahead.backend.ModelledLink`: when each read in flight lands, on the link
        :meth:`fetch` charges (None with ``zero_cost``: reads take no time)."""
        return None if self._link is None else self._link.lands

    async def fetch(self, key: ExpertKey, slot: int) -> None:
        expert = expert_id(key)  # what the check at each compute compares (the cache's ids)
        self._landed.pop(slot, None)
        self._reading[slot] = expert
        self._reads_begun += 1
        if self._link is None:
            await self.clock.sleep(0.0)
        else:
            now = self.clock.now()  # sleep_until's own reading, taken once
            try:
                await self.clock.sleep(self._link.started(expert, now) - now)
            finally:
                self._link.ended(expert)
        del self._reading[slot]
        self._landed[slot] = expert

    async def compute(self, group: Group) -> Sequence[JobResult]:
        jobs = group.jobs
        requests = self._requests
        states = [requests[job.request] for job in jobs]
        held, begun = self._check_experts(group), self._reads_begun
        await self.clock.sleep(0.0 if self.zero_cost else self._duration(group, states))
        # only a read started meanwhile can have changed a slot: look again only then
        if (
            held is not None
            and self._reads_begun != begun
            and list(map(self._landed.get, held[0])) != held[1]
        ):
            raise BrokenPromise(
                f"an expert of the group at layer {group.layer} was evicted while it computed"
            )
        last = self.num_layers - 1
        layer = group.layer
        if layer < last:
            step_offset, following = self.step_offset, layer + 2
            results = []
            for job, state in zip(jobs, states, strict=True):
                if job.remaining:  # a wave before the last: its experts' share of the MoE only
                    results.append(JobResult(job))
                elif job.prefill:
                    results.append(self._prefill_result(state, job))
                else:
                    step = step_offset + state.decoded
                    predicted = state.predictions[step][following] if following <= last else ()
                    results.append(JobResult(job, state.selections[step][layer + 1], predicted))
            return results
        results = []
        for job, state in zip(jobs, states, strict=True):
            if job.remaining:
                results.append(JobResult(job))
                continue
            if not job.prefill or state.position + job.num_tokens >= state.spec.prompt_length:
                results.append(JobResult(job, token=sim_token(state.spec, state.generated)))
                state.generated += 1
            else:
                results.append(JobResult(job))
            state.position += job.num_tokens
            if not job.prefill:
                state.decoded += 1
        return results

    def _check_experts(self, group: Group) -> tuple[list[int], list[ExpertId]] | None:
        """Raise unless every expert of every job is resident, landed in its slot and pinned.

        Returns the group's slots and the expert each holds, to check again when the compute ends
        (a pinned expert's slot is never refilled meanwhile). A slot the runtime warmed without a
        read holds the expert the cache put there.
        """
        cache = self._cache
        if cache is None:
            return None
        ids = job_ids(group.jobs)
        slots = cache.pinned_slots(ids)  # one call per group: this runs for every expert
        if slots is None:
            self._refuse_unready(group, cache)
        landed = self._landed
        held = list(map(landed.get, slots))  # type: ignore[arg-type]  # None finds nothing: held differs
        if held != ids:  # only where they differ (a slot the run warmed is seen for the first time)
            if None in slots:  # an expert not resident holds no slot
                self._refuse_unready(group, cache)
            for index in itertools.compress(range(len(ids)), map(operator.ne, held, ids)):
                expert, slot, content = ids[index], cast(int, slots[index]), held[index]
                if content is None and slot not in self._reading:
                    landed[slot] = held[index] = expert  # warmed: it holds what the cache put there
                elif content != expert:
                    job = next(job for job in group.jobs if expert in job.ids)
                    what = (
                        f"{expert_key(content)} (landed)"
                        if content is not None
                        else f"{expert_key(self._reading[slot])} (still being read)"
                    )
                    raise BrokenPromise(
                        f"request {job.request}'s job at layer {job.layer} was computed with slot {slot} "
                        f"holding {what}, not {expert_key(expert)}"
                    )
        return slots, held  # type: ignore[return-value]

    @staticmethod
    def _refuse_unready(group: Group, cache: ExpertCache) -> NoReturn:
        """Raise naming the first expert of the group that is not resident and pinned."""
        for job in group.jobs:
            for key in job.keys:
                if not cache.is_resident(key) or cache.refcount(key) < 1:
                    state = cache.state(key)
                    raise BrokenPromise(
                        f"request {job.request}'s job at layer {job.layer} was computed before expert "
                        f"{key} was ready (cache state {None if state is None else state.value}, "
                        f"pins {cache.refcount(key)})"
                    )
        raise AssertionError("unreachable")

    def _prefill_result(self, state: _SimRequest, job: Job) -> JobResult:
        """A prefill chunk's gate at the next layer (and its prediction for the one after).

        A chunk's tokens take the routing of the trace's steps at their positions (round the trace's
        length): the request's own routing, so a prompt touches the experts its topic uses.
        """
        following = job.layer + 2
        window = self.routing.window
        predicted = (
            window(state.index, following, state.position, job.num_tokens, predicted=True)
            if following < self.num_layers
            else ()
        )
        return JobResult(job, window(state.index, job.layer + 1, state.position, job.num_tokens), predicted)

    def _duration(self, group: Group, states: list[_SimRequest]) -> float:
        """The cost model's time for the group; waves before the last pay for their experts only."""
        jobs = group.jobs
        final = [(job, state) for job, state in zip(jobs, states, strict=True) if not job.remaining]
        if len(final) < len(jobs) or any(map(_wave_of, jobs)):  # a job split in waves
            share = [_wave_share(job, self.experts_per_job) for job in jobs]
            routed_fraction = sum(share) / len(share)
        else:  # each job does all of its experts' work: a share of 1.0 each, without a call per job
            routed_fraction = 1.0
        if not final:
            tokens = [job.num_tokens for job in group.jobs]
            contexts = [state.spec.prompt_tokens + state.position for state in states]
            return self.costs.compute_time(
                group.layer,
                tokens,
                contexts,
                group.distinct_experts(),
                moe_only=True,
                routed_fraction=routed_fraction,
            )
        tokens = [job.num_tokens for job, _ in final]
        contexts = [state.spec.prompt_tokens + state.position + job.num_tokens for job, state in final]
        return self.costs.compute_time(
            group.layer, tokens, contexts, group.distinct_experts(), routed_fraction=routed_fraction
        )


_wave_of = operator.attrgetter("wave")


def _wave_share(job: Job, budget: int) -> float:
    """The fraction of a job's expert work one wave does (earlier waves held ``budget`` each)."""
    total = job.wave * budget + len(job.experts) + len(job.remaining)
    return len(job.experts) / total if total else 1.0


@dataclass(slots=True)
class _SimRequest:
    spec: RequestSpec
    index: int  # the trace's request whose routing this one takes
    selections: list[list[tuple[int, ...]]]
    predictions: list[list[tuple[int, ...]]]
    position: int = 0  # tokens processed (prefill and decode)
    decoded: int = 0  # decode steps done: the trace step after the offset
    generated: int = 0  # tokens produced


def sim_token(request: RequestSpec, step: int) -> int:
    """The sim has no model: its "token" is a fixed function of the request and step."""
    index = request.trace_index if request.trace_index is not None else request.request
    return (index * 1_000_003 + step) % 50_000


__all__ = ["ENTRY_LAYER", "FixedCosts", "Routing", "SimBackend", "SimCosts", "sim_token"]
