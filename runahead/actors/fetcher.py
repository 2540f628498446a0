"""ExpertFetcher: keeps the link busy with fetches of experts that blocked jobs need.

Which job's experts go first is ``SELECT_FETCH_JOB`` (:class:`runahead.scheduling.FetchQueue`). An
expert already on its way is never fetched twice: jobs that need it simply wait for it. A slot is
reserved by evicting an unpinned entry, never a pinned one. ``queue_depth`` link workers keep that
many reads in flight, so the link never idles between reads. With a prefetching policy, workers
with no demand to serve fetch predicted experts instead.

A worker whose read lands picks the next one itself. Idle workers are woken one at a time: new
work (a message) wakes the longest-idle one, and a worker that found a read to start wakes the
next, so a wake-up finds work unless the one before it took the last read (waking every idle
worker at each message cost most of the link's CPU time, all but one going back to sleep).

A read that fails with an I/O error (``OSError``, or a store's ``ValueError`` naming the file) is
retried ``read_retries`` times with a growing pause; if it still fails, the JobIssuer is told
(:class:`FetchFailed`) and fails only the requests whose jobs wait for that expert. Any other
error is a bug and stops the runtime.
"""

from __future__ import annotations

import asyncio
from collections import deque

from runahead.backend import READS_IN_FLIGHT, Backend
from runahead.cache import ExpertCache
from runahead.clock import Clock
from runahead.health import Health
from runahead.jobs import ExpertId, ExpertKey, expert_key
from runahead.mailbox import serve
from runahead.messages import Blocked, FetchDone, FetcherMessage, FetchFailed, Forget, IssuerMessage, Prefetch
from runahead.metrics import Recorder
from runahead.scheduling import FetchOrder, FetchQueue, PrefetchQueue


class ExpertFetcher:
    """Owns the link: the demand queue, the prefetch hints and the in-flight reads."""

    def __init__(
        self,
        *,
        backend: Backend,
        cache: ExpertCache,
        fetch_order: FetchOrder,
        inbox: asyncio.Queue[FetcherMessage],
        issuer: asyncio.Queue[IssuerMessage],
        clock: Clock,
        recorder: Recorder,
        queue_depth: int = READS_IN_FLIGHT,
        health: Health | None = None,
        read_retries: int = 2,
        retry_pause_s: float = 0.01,
    ) -> None:
        if queue_depth < 1:
            raise ValueError(f"link queue depth must be >= 1, got {queue_depth}")
        self.backend = backend
        self.cache = cache
        self.demand = FetchQueue(fetch_order)
        self.hints = PrefetchQueue()
        self.inbox = inbox
        self.issuer = issuer
        self.clock = clock
        self.recorder = recorder
        self.queue_depth = queue_depth
        self.health = health or Health()
        self.read_retries = read_retries
        self.retry_pause_s = retry_pause_s
        self._idle: deque[asyncio.Future[None]] = deque()  # parked workers, longest idle first
        self._waking = False  # a parked worker was woken and has not run yet
        self._closing = False

    def settled(self) -> bool:
        """Whether every read the link can start has started: no blocked job with a read still to
        start, no prefetch hint, no message waiting in the inbox. Until a group's results reveal
        more, no read can start, and the reads in flight land on the store's threads, which date
        them (``Backend.fetch``): the event loop may compute a group itself meanwhile
        (:class:`runahead.backend.InlineCompute`)."""
        return not (self.demand or self.hints) and self.inbox.empty()

    def reading(self) -> bool:
        """Whether a read is in flight."""
        return bool(self.cache.pending_ids)

    def starting(self) -> bool:
        """Whether a read is about to start: a message waits in the inbox, or a worker woken to
        start one has not run yet (each worker that starts a read wakes the next)."""
        return self._waking or not self.inbox.empty()

    async def run(self) -> None:
        """Serve until the inbox yields ``None``; in-flight reads finish first."""
        async with asyncio.TaskGroup() as workers:
            for _ in range(self.queue_depth):
                workers.create_task(self._link_worker())
            await serve(self.inbox, self._serve)
            self._closing = True
            for waiter in self._idle:
                if not waiter.done():
                    waiter.set_result(None)

    def _serve(self, message: FetcherMessage) -> None:
        self.handle(message)
        self._wake_one()

    def handle(self, message: FetcherMessage) -> None:
        if isinstance(message, Blocked):
            self.demand.add(message.job, message.missing, self.cache)
        elif isinstance(message, Prefetch):
            self.hints.add(message.request, message.progress, message.experts)
        elif isinstance(message, Forget):
            self.demand.discard(message.request)
            self.hints.discard(message.request)

    def _wake_one(self) -> None:
        """Wake the longest-idle worker, unless one woken before has not run yet, or there is nothing
        it could read (no blocked job with a read to start, no prefetch hint): it would only park again."""
        if self._waking or not self._idle or not (self.demand or self.hints):
            return
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._waking = True
                return

    async def _park(self) -> None:
        """Wait, idle, until :meth:`_wake_one` (or closing) wakes this worker."""
        waiter = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        try:
            await waiter
        finally:
            if waiter.done() and not waiter.cancelled():
                self._waking = False

    def _pick(self) -> tuple[ExpertId, int, bool] | None:
        """The next read to start, its reserved slot, and whether it is a prefetch."""
        expert, holder = self.demand.select(self.cache), None
        prefetch = expert is None
        if expert is None:
            hint = self.hints.select(self.cache)
            if hint is None:
                return None
            expert, holder = hint
        slot = self.cache.reserve_id(expert, prefetch=prefetch, holder=holder)
        if slot is None:
            return None  # every slot is pinned or being filled; a completing read frees one
        self.demand.started(expert)
        return expert, slot, prefetch

    async def _link_worker(self) -> None:
        now, cache, demand, recorder = self.clock.reader(), self.cache, self.demand, self.recorder
        fetch, health, issuer = self.backend.fetch, self.health, self.issuer
        while not self._closing:
            picked = self._pick()
            if picked is None:
                await self._park()
                continue
            self._wake_one()  # more reads may be waiting: let the next idle worker look
            expert, slot, prefetch = picked
            key = expert_key(expert)  # what the backend, the health and the record name
            start = now()
            recorder.read_started(start)
            try:
                landed = await fetch(key, slot)
            except (OSError, ValueError) as first_error:
                landed = None
                error = await self._retry(key, slot, first_error)
                if error is not None:
                    recorder.read_ended(now())
                    demand.failed(expert)
                    issuer.put_nowait(FetchFailed(expert, error))
                    self._wake_one()  # its slot is free again once the issuer has the notice
                    continue
            else:
                if health.failing:
                    health.read_succeeded(key)
            cache.complete_id(expert)
            demand.landed(expert)
            end = now()
            if landed is not None and start <= landed < end:
                end = landed  # the loop took the landing late: the link carried it by then
            recorder.fetch(start, end, key, prefetch)
            issuer.put_nowait(FetchDone(expert))

    async def _retry(self, key: ExpertKey, slot: int, error: Exception) -> str | None:
        """Read ``key`` into ``slot`` again after ``error``; None on success, else the last error."""
        for attempt in range(self.read_retries + 1):
            message = f"reading expert {key.expert} of layer {key.layer} failed: {error}"
            if attempt == self.read_retries:
                self.health.read_failed(key, self.clock.now(), message)
                return message
            self.health.read_retried(message)
            await self.clock.sleep(self.retry_pause_s * 4**attempt)
            try:
                await self.backend.fetch(key, slot)
            except (OSError, ValueError) as again:
                error = again
            else:
                self.health.read_succeeded(key)
                return None
        raise AssertionError("unreachable")
