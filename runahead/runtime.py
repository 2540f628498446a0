"""The runtime: wires the expert cache and the three actors over one backend, and runs requests.

::

    async with Runtime(backend, RuntimeConfig(cache_slots=512, policy="runahead")) as runtime:
        handle = runtime.submit(RequestSpec(request=0, max_tokens=32))
        tokens = await handle.result()

The actors run as tasks of one task group. A failed expert read or group compute fails only the
requests that needed it (:class:`RequestFailed` from their ``result()``); the runtime goes on, its
:attr:`Runtime.health` saying ``degraded`` while failures last. An error that leaves the runtime
unusable cancels every actor and is raised from the ``async with`` block (and from every pending
``result()``), never a hang.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from runahead.actors import ComputeScheduler, ExpertFetcher, JobIssuer
from runahead.backend import (
    INLINE_READS_IN_FLIGHT,
    READS_IN_FLIGHT,
    Backend,
    CacheWatcher,
    ExpertCount,
    InlineCompute,
    SpeculativeGate,
    TokenScorer,
)
from runahead.cache import ExpertCache
from runahead.clock import Clock, VirtualTimeLoop
from runahead.health import Health, RequestFailed
from runahead.jobs import ExpertKey, RequestSpec
from runahead.mailbox import Handoff, Mailbox
from runahead.messages import Cancel, FetcherMessage, IssuerMessage, SchedulerMessage, Submit
from runahead.metrics import Recorder
from runahead.policy import PolicyConfig, parse_policy
from runahead.prefetch import make_predictor
from runahead.scheduling import ComputeQueue, StepBarrier

if TYPE_CHECKING:
    from runahead.sampling import StepLogprobs

MAILBOX_SIZE = 1 << 16
"""Mailboxes are bounded. The actor graph has a cycle (issuer <-> scheduler), so sends never wait:
the messages in flight are bounded by the active requests and the link's queue depth, and an
overflow would be a bug, raised as ``asyncio.QueueFull`` rather than a silent stall."""


@dataclass(slots=True)
class RuntimeConfig:
    """How to schedule: policy, cache size and eviction, step barrier, link queue depth."""

    cache_slots: int
    policy: PolicyConfig | str = "runahead"
    eviction: str = "lfu"
    step_barrier: bool = True
    link_queue_depth: int | None = None
    """Link workers, the reads kept in flight at once; None: :data:`runahead.backend.READS_IN_FLIGHT`,
    or :data:`~runahead.backend.INLINE_READS_IN_FLIGHT` where groups are computed inline
    (``inline_compute`` on a backend that can: :attr:`Runtime.link_queue_depth` says which)."""
    max_active: int | None = None
    record_selections: bool = False
    keep_records: bool = True  # off for long-running servers: only running totals are kept
    prefill_chunk: int = 256
    read_retries: int = 2  # a failed expert read is tried again this many times before it fails
    retry_pause_s: float = 0.01  # the first pause before a retry; each next one is 4x longer
    max_compute_failures: int = 3  # groups failing in a row before the runtime stops
    inline_compute: bool = True
    """Compute a decode group on the event loop's thread, not the backend's compute thread, while the
    link has nothing to read (:class:`runahead.backend.InlineCompute`: torch; mlx has none): the loop is
    busy for that group's time (a few ms on a CPU) and two thread hand-offs are saved. Off for an
    application whose loop must never wait that long."""
    policy_config: PolicyConfig = field(init=False)

    def __post_init__(self) -> None:
        self.policy_config = parse_policy(self.policy) if isinstance(self.policy, str) else self.policy
        if self.cache_slots < 1:
            raise ValueError(f"cache_slots must be >= 1, got {self.cache_slots}")
        if self.link_queue_depth is not None and self.link_queue_depth < 1:
            raise ValueError(f"link_queue_depth must be >= 1, got {self.link_queue_depth}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.read_retries < 0 or self.retry_pause_s < 0:
            raise ValueError("read_retries and retry_pause_s must be >= 0")
        if self.max_compute_failures < 1:
            raise ValueError(f"max_compute_failures must be >= 1, got {self.max_compute_failures}")
        if self.max_active is not None and self.max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {self.max_active}")


class RequestHandle:
    """A submitted request: its tokens as they come, the whole list when it is done, and cancel()."""

    def __init__(self, request: int, runtime: Runtime) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.cancelled = False
        self._runtime = runtime
        self._stream: asyncio.Queue[tuple[int, StepLogprobs | None] | None] = asyncio.Queue()
        self._done: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()

    async def result(self) -> list[int]:
        """Wait for the last token (or the cancellation); return every generated token id."""
        return await asyncio.shield(self._done)

    async def stream(self) -> AsyncIterator[int]:
        """Each token as it is generated; ends when the request finishes or is cancelled."""
        async for token, _ in self.steps():
            yield token

    async def steps(self) -> AsyncIterator[tuple[int, StepLogprobs | None]]:
        """Each token with what the backend scored for it (log-probs, when the request asked)."""
        while (step := await self._stream.get()) is not None:
            yield step
        if self._done.done() and self._done.exception() is not None:
            raise self._done.exception()  # type: ignore[misc]

    def cancel(self) -> None:
        """Stop the request now: its cache pins and KV cache are released. Idempotent."""
        if not self._done.done():
            self._runtime.cancel(self.request)

    def done(self) -> bool:
        return self._done.done()

    def _token(self, token: int, logprobs: StepLogprobs | None = None) -> None:
        self.tokens.append(token)
        self._stream.put_nowait((token, logprobs))

    def _finish(self, cancelled: bool) -> None:
        if not self._done.done():
            self.cancelled = cancelled
            self._done.set_result(self.tokens)
            self._stream.put_nowait(None)

    def _fail(self, error: BaseException) -> None:
        if not self._done.done():
            self._done.set_exception(error)
            self._done.exception()  # mark retrieved: the runtime raises it too
            self._stream.put_nowait(None)


class Runtime:
    """One backend, one expert cache, three actors."""

    def __init__(self, backend: Backend, config: RuntimeConfig, *, clock: Clock | None = None) -> None:
        if config.cache_slots < backend.experts_per_job:
            raise ValueError(
                f"an expert cache of {config.cache_slots} slots cannot hold the {backend.experts_per_job} "
                "experts a single job needs; use at least that many slots"
            )
        self.backend = backend
        self.config = config
        self.clock = clock or Clock()
        experts = backend.num_layers * backend.num_experts if isinstance(backend, ExpertCount) else None
        self.cache = ExpertCache(config.cache_slots, config.eviction, experts=experts)
        self._scorer = backend if isinstance(backend, TokenScorer) else None
        if isinstance(backend, CacheWatcher):
            backend.watch(self.cache)
        if isinstance(backend, SpeculativeGate):
            backend.use_speculative_gate(config.policy_config.prefetch == "gate")
        self.recorder = Recorder(record_selections=config.record_selections, keep_records=config.keep_records)
        self.health = Health()
        self.handles: dict[int, RequestHandle] = {}
        self._task_group: asyncio.TaskGroup | None = None
        self._issuer_inbox: asyncio.Queue[IssuerMessage] | None = None
        self._inboxes: list[asyncio.Queue[Any]] = []

    def health_report(self) -> dict[str, object]:
        """``status`` (``ok``, ``degraded`` or ``failed``), the reason, and failure counters."""
        return self.health.report(self.clock.now())

    @property
    def link_queue_depth(self) -> int:
        """The reads the link keeps in flight: ``config.link_queue_depth``, or its default here."""
        if self.config.link_queue_depth is not None:
            return self.config.link_queue_depth
        inline = self.config.inline_compute and isinstance(self.backend, InlineCompute)
        return INLINE_READS_IN_FLIGHT if inline else READS_IN_FLIGHT

    @property
    def max_active(self) -> int:
        """How many requests may run at once under the deadlock rule (and ``max_active``)."""
        limit = self.config.cache_slots // self.backend.experts_per_job
        return limit if self.config.max_active is None else min(limit, self.config.max_active)

    async def preload(self, keys: Iterable[ExpertKey]) -> None:
        """Read ``keys`` into the cache before the runtime starts (not counted as fetches)."""
        if self._task_group is not None:
            raise RuntimeError("preload() runs before the runtime starts")
        keys = list(keys)
        self.cache.warm(keys)
        for key in keys:
            if self.cache.is_resident(key):
                await self.backend.fetch(key, self.cache.slot_of(key))

    async def __aenter__(self) -> Runtime:
        if self._task_group is not None:
            raise RuntimeError("this runtime is already running")
        policy = self.config.policy_config
        loop = asyncio.get_running_loop()
        quiet = loop.quiet if isinstance(loop, VirtualTimeLoop) else _never
        issuer: Mailbox[IssuerMessage] = Mailbox(MAILBOX_SIZE)
        scheduler: Mailbox[SchedulerMessage] = Mailbox(MAILBOX_SIZE)
        fetcher: Mailbox[FetcherMessage] = Mailbox(MAILBOX_SIZE)
        job_issuer = JobIssuer(
            backend=self.backend,
            cache=self.cache,
            predictor=make_predictor(policy.prefetch, self.backend.num_layers),
            inbox=issuer,
            scheduler=scheduler,
            fetcher=fetcher,
            recorder=self.recorder,
            max_active=self.config.max_active,
            sink=self,
        )
        expert_fetcher = ExpertFetcher(
            backend=self.backend,
            cache=self.cache,
            fetch_order=policy.fetch_order,
            inbox=fetcher,
            issuer=issuer,
            clock=self.clock,
            recorder=self.recorder,
            queue_depth=self.link_queue_depth,
            health=self.health,
            read_retries=self.config.read_retries,
            retry_pause_s=self.config.retry_pause_s,
        )
        compute_scheduler = ComputeScheduler(
            backend=self.backend,
            cache=self.cache,
            queue=ComputeQueue(policy.compute_order, policy.grouping),
            barrier=StepBarrier(self.config.step_barrier),
            inbox=scheduler,
            issuer=Handoff(issuer, job_issuer.handle, quiet),
            clock=self.clock,
            recorder=self.recorder,
            sink=self,
            prefill_chunk=self.config.prefill_chunk,
            health=self.health,
            max_compute_failures=self.config.max_compute_failures,
            link=expert_fetcher if self.config.inline_compute else None,
        )
        self._issuer_inbox = issuer
        self._inboxes = [issuer, fetcher, scheduler]
        self._task_group = asyncio.TaskGroup()
        await self._task_group.__aenter__()
        self._task_group.create_task(job_issuer.run(), name="JobIssuer")
        self._task_group.create_task(expert_fetcher.run(), name="ExpertFetcher")
        self._task_group.create_task(compute_scheduler.run(), name="ComputeScheduler")
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._task_group is not None
        for inbox in self._inboxes:
            inbox.put_nowait(None)
        try:
            await self._task_group.__aexit__(kind, error, tb)
        except BaseExceptionGroup as group:
            failure = _sole_error(group)
            self.health.fatal = self.health.fatal or repr(failure)
            for handle in self.handles.values():
                handle._fail(
                    RequestFailed(f"request {handle.request} failed: the runtime stopped: {failure!r}")
                )
            self.handles.clear()
            if failure is group:
                raise
            raise failure from group
        finally:
            self._task_group = None
            self.cache.finish()

    def submit(self, *requests: RequestSpec) -> list[RequestHandle]:
        """Queue requests for admission; return their handles. Request ids must be unique."""
        if self._issuer_inbox is None:
            raise RuntimeError("submit() needs a running runtime: use 'async with runtime:'")
        seen = set(self.handles)
        for spec in requests:
            if spec.request in seen:
                raise ValueError(f"request id {spec.request} was already submitted")
            seen.add(spec.request)
        handles = [RequestHandle(spec.request, self) for spec in requests]
        self.handles.update((h.request, h) for h in handles)
        self._issuer_inbox.put_nowait(Submit(tuple(requests)))
        return handles

    async def run(self, requests: Sequence[RequestSpec]) -> dict[int, list[int]]:
        """Run ``requests`` to completion; return each request's generated tokens."""
        async with self:
            handles = self.submit(*requests)
            return {h.request: await h.result() for h in handles}

    def cancel(self, request: int) -> None:
        """Cancel a submitted request (see :meth:`RequestHandle.cancel`)."""
        handle = self.handles.get(request)
        if self._issuer_inbox is not None and handle is not None and not handle.done():
            self._issuer_inbox.put_nowait(Cancel(request))

    def fail(self, request: int, error: str) -> None:
        """End a request now with ``error`` (its ``result()`` raises it) and cancel it in the actors."""
        handle = self.handles.get(request)
        if handle is not None and not handle.done():
            self.cancel(request)
            handle._fail(RequestFailed(f"request {request} failed: {error}"))

    # -- TokenSink (called by the actors) ------------------------------------------------------

    def token(self, request: int, step: int, token: int, time: float) -> None:
        # the backend scored the token in the compute that sampled it; its request is still open
        scored = self._scorer.take_logprobs(request) if self._scorer is not None else None
        self.handles[request]._token(token, scored)

    def finished(self, request: int, cancelled: bool = False, error: str | None = None) -> None:
        """A request ended: resolve its handle and forget it (the caller holds the handle).

        With ``error`` it failed: its ``result()`` and ``stream()`` raise :class:`RequestFailed`.
        """
        handle = self.handles.pop(request)
        if error is None:
            handle._finish(cancelled)
        else:
            self.health.requests_failed += 1
            handle._fail(RequestFailed(f"request {request} failed: {error}"))


def _never() -> bool:
    return False


def _sole_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one real error inside a task group's failure, or the group itself if there are several.

    One actor failing cancels the others, so the group almost always holds exactly one error; the
    caller then sees that error (``OSError: device lost``), not a wrapper around it.
    """
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        elif not isinstance(error, asyncio.CancelledError):
            leaves.append(error)

    collect(group)
    return leaves[0] if len(leaves) == 1 else group
