"""ExpertFetcher: keeps the link busy with fetches of experts that blocked jobs need.

Which job's experts go first is ``SELECT_FETCH_JOB`` (:class:`runahead.scheduling.FetchQueue`). An
expert already on its way is never fetched twice: jobs that need it simply wait for it. A slot is
reserved by evicting an unpinned entry, never a pinned one. ``queue_depth`` link workers keep that
many reads in flight, so the link never idles between reads. With a prefetching policy, workers
with no demand to serve fetch predicted experts instead.

A read that fails with an I/O error (``OSError``, or a store's ``ValueError`` naming the file) is
retried ``read_retries`` times with a growing pause; if it still fails, the JobIssuer is told
(:class:`FetchFailed`) and fails only the requests whose jobs wait for that expert. Any other
error is a bug and stops the runtime.
"""

from __future__ import annotations

import asyncio

from runahead.backend import Backend
from runahead.cache import ExpertCache
from runahead.clock import Clock
from runahead.health import Health
from runahead.jobs import ExpertKey
from runahead.mailbox import Signal
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
        queue_depth: int = 2,
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
        self._wake = Signal()
        self._closing = False

    async def run(self) -> None:
        """Serve until the inbox yields ``None``; in-flight reads finish first."""
        async with asyncio.TaskGroup() as workers:
            for _ in range(self.queue_depth):
                workers.create_task(self._link_worker())
            while (message := await self.inbox.get()) is not None:
                self.handle(message)
                self._wake.set()
            self._closing = True
            self._wake.set()

    def handle(self, message: FetcherMessage) -> None:
        if isinstance(message, Blocked):
            self.demand.add(message.job, message.missing, self.cache)
        elif isinstance(message, Prefetch):
            self.hints.add(message.request, message.progress, message.keys)
        elif isinstance(message, Forget):
            self.demand.discard(message.request)
            self.hints.discard(message.request)

    def _pick(self) -> tuple[ExpertKey, int, bool] | None:
        """The next read to start, its reserved slot, and whether it is a prefetch."""
        key, holder = self.demand.select(self.cache), None
        prefetch = key is None
        if key is None:
            hint = self.hints.select(self.cache)
            if hint is None:
                return None
            key, holder = hint
        slot = self.cache.reserve(key, prefetch=prefetch, holder=holder)
        if slot is None:
            return None  # every slot is pinned or being filled; a completing read frees one
        self.demand.started(key)
        return key, slot, prefetch

    async def _link_worker(self) -> None:
        while not self._closing:
            picked = self._pick()
            if picked is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            key, slot, prefetch = picked
            start = self.clock.now()
            error = await self._read(key, slot)
            if error is not None:
                self.demand.failed(key)
                self.issuer.put_nowait(FetchFailed(key, error))
                self._wake.set()  # its slot is free again once the issuer has the notice
                continue
            self.cache.complete(key)
            self.demand.landed(key)
            self.recorder.fetch(start, self.clock.now(), key, prefetch)
            self.issuer.put_nowait(FetchDone(key))
            self._wake.set()

    async def _read(self, key: ExpertKey, slot: int) -> str | None:
        """Read ``key`` into ``slot``, retrying I/O errors; None on success, else the last error."""
        for attempt in range(self.read_retries + 1):
            try:
                await self.backend.fetch(key, slot)
            except (OSError, ValueError) as error:
                message = f"reading expert {key.expert} of layer {key.layer} failed: {error}"
                if attempt == self.read_retries:
                    self.health.read_failed(key, self.clock.now(), message)
                    return message
                self.health.read_retried(message)
                await self.clock.sleep(self.retry_pause_s * 4**attempt)
            else:
                self.health.read_succeeded(key)
                return None
        raise AssertionError("unreachable")
