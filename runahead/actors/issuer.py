"""JobIssuer: admits requests, checks each job's experts against the cache, issues or blocks it.

Resident experts are pinned at once. A job with nothing missing goes to the ComputeScheduler; one
with missing experts waits here (and the ExpertFetcher is told) until the last of them lands.
Admission control keeps the deadlock rule: a request is admitted only while the cache can hold
every active request's experts without relying on sharing.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from dataclasses import replace
from typing import Any

from runahead.backend import Backend
from runahead.cache import ExpertCache, admissible
from runahead.jobs import ExpertId, Job, RequestSpec, expert_ids, waves_needed
from runahead.mailbox import serve
from runahead.messages import (
    Blocked,
    Cancel,
    FetchDone,
    FetcherMessage,
    FetchFailed,
    Finished,
    Forget,
    IssuerMessage,
    NextJobs,
    Prefetch,
    Ready,
    SchedulerMessage,
    Started,
    Submit,
)
from runahead.metrics import Recorder
from runahead.prefetch import Predictor


class JobIssuer:
    """Owns admission, the cache pins of jobs, and the jobs blocked on fetches."""

    def __init__(
        self,
        *,
        backend: Backend,
        cache: ExpertCache,
        predictor: Predictor | None,
        inbox: asyncio.Queue[IssuerMessage],
        scheduler: asyncio.Queue[SchedulerMessage],
        fetcher: asyncio.Queue[FetcherMessage],
        recorder: Recorder,
        max_active: int | None = None,
        sink: Any = None,
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.predictor = predictor
        self.inbox = inbox
        self.scheduler = scheduler
        self.fetcher = fetcher
        self.recorder = recorder
        self.max_active = max_active
        self.sink = sink  # told when a request is cancelled before it was admitted
        self._cancelled: set[int] = set()
        self.queued: deque[RequestSpec] = deque()
        self.active: dict[int, int] = {}  # request -> lane
        self._free_lanes: list[int] = []
        self._next_lane = 0
        self._waiters: dict[ExpertId, list[Job]] = {}
        self._blocked: dict[int, tuple[Job, int]] = {}  # request -> (job, experts still missing)

    async def run(self) -> None:
        """Handle messages until the inbox yields ``None``."""
        await serve(self.inbox, self.handle)

    def handle(self, message: IssuerMessage) -> None:
        if isinstance(message, NextJobs):
            jobs = message.jobs
            if self._cancelled:
                jobs = tuple([job for job in jobs if job.request not in self._cancelled])
            self.scheduler.put_nowait(Ready(self._issue_group(jobs), reply=True))
        elif isinstance(message, FetchDone):
            ready = self._arrived(message.expert)
            if ready:
                self.scheduler.put_nowait(Ready(ready))
        elif isinstance(message, Submit):
            self.queued.extend(message.requests)
            self._admit()
        elif isinstance(message, Finished):
            self._cancelled.discard(message.request)
            self._release(message.request)
            self._admit()
        elif isinstance(message, FetchFailed):
            self._fetch_failed(message.expert, message.error)
        elif isinstance(message, Cancel):
            self._cancel(message.request, message.error)

    # -- jobs ----------------------------------------------------------------------------------

    def _issue_group(self, jobs: tuple[Job, ...]) -> tuple[Job, ...]:
        """Issue a computed group's next jobs in order; return those ready (pinned) now.

        Jobs with no prediction to make, selection to record or waves to split, the common case,
        are pinned in one batch (:meth:`ExpertCache.pin_jobs`); otherwise job by job
        (:meth:`_issue`), since splitting a job into waves looks at the pins of the jobs before it.
        """
        budget = self.backend.experts_per_job
        if self.predictor is not None or self.recorder.record_selections or waves_needed(jobs, budget):
            return tuple([issued for job in jobs if (issued := self._issue(job)) is not None])
        ready = []
        for job, missing in zip(jobs, self.cache.pin_jobs(jobs), strict=True):
            if missing:
                self._block(job, missing)
            else:
                ready.append(job)
        return tuple(ready)

    def _issue(self, job: Job) -> Job | None:
        """Pin the job's experts; return it (its first wave, if split) when ready, else block it."""
        if self.recorder.record_selections and job.wave == 0 and not job.prefill:
            self.recorder.selection(job.request, job.step, job.layer, job.experts)
        if len(job.experts) > self.backend.experts_per_job:
            job = self._first_wave(job)
        missing = self.cache.pin_ids(job.ids)
        if self.predictor is not None:
            self.cache.release_prefetches(job.request)  # its job took what was predicted for it
            if job.wave == 0:
                hint = self.predictor.predict(job)
                layer = job.layer + 1
                self.fetcher.put_nowait(Prefetch(job.request, (job.epoch, layer), expert_ids(layer, hint)))
        if not missing:
            return job
        self._block(job, missing)
        return None

    def _block(self, job: Job, missing: tuple[ExpertId, ...]) -> None:
        """``job`` waits for ``missing``: note it, and tell the ExpertFetcher."""
        self._blocked[job.request] = (job, len(missing))
        waiters = self._waiters
        for expert in missing:
            waiting = waiters.get(expert)
            if waiting is None:
                waiters[expert] = [job]
            else:
                waiting.append(job)
        self.fetcher.put_nowait(Blocked(job, missing))

    def _first_wave(self, job: Job) -> Job:
        """Split a job needing more experts than one job may pin into waves (deadlock rule).

        Resident experts go first, then those already on their way, then those another job waits
        for, then the rest, each kind by expert number, so the first waves compute while the link
        brings the later ones (expert-granular accumulation).
        """
        cache = self.cache
        resident, pending, pinned = cache.resident_ids, cache.pending_ids, cache.pinned_ids
        ranks: tuple[list[int], ...] = ([], [], [], [])  # as ``state_id``: resident, being read, wanted, none
        first, coming, wanted, absent = ranks
        for expert, key in zip(job.experts, job.ids, strict=True):
            if key in resident:
                first.append(expert)
            elif key in pending:
                coming.append(expert)
            elif key in pinned:
                wanted.append(expert)
            else:
                absent.append(expert)
        order = [expert for rank in ranks for expert in sorted(rank)]  # a prefill chunk: hundreds
        budget = self.backend.experts_per_job
        return replace(job, experts=tuple(order[:budget]), remaining=tuple(order[budget:]))

    def _arrived(self, expert: ExpertId) -> tuple[Job, ...]:
        """Release the jobs waiting on ``expert`` if it is resident.

        A notice can be stale: the expert may have landed, been evicted and been wanted again
        before this message was read. Its waiters then wait for the read now on its way.
        """
        if not self.cache.is_resident_id(expert):
            return ()
        ready = []
        for job in self._waiters.pop(expert, ()):
            blocked = self._blocked.get(job.request)
            if blocked is None or blocked[0] is not job:
                continue  # cancelled meanwhile
            remaining = blocked[1] - 1
            if remaining:
                self._blocked[job.request] = (job, remaining)
            else:
                del self._blocked[job.request]
                ready.append(job)
        return tuple(ready)

    def _fetch_failed(self, expert: ExpertId, error: str) -> None:
        """A read failed for good: fail the requests whose jobs wait for it; the others go on."""
        self.cache.abort_id(expert)
        for job in self._waiters.pop(expert, ()):
            blocked = self._blocked.get(job.request)
            if blocked is not None and blocked[0] is job:
                self._cancel(job.request, error)

    # -- requests ------------------------------------------------------------------------------

    def _admit(self) -> None:
        started = []
        per_job = self.backend.experts_per_job
        while self.queued and admissible(self.cache.slots, len(self.active) + 1, per_job):
            if self.max_active is not None and len(self.active) >= self.max_active:
                break
            request = self.queued.popleft()
            self.backend.open_request(request)
            lane = heapq.heappop(self._free_lanes) if self._free_lanes else self._take_new_lane()
            self.active[request.request] = lane
            started.append((request, lane))
        if started:
            self.scheduler.put_nowait(Started(tuple(started)))

    def _take_new_lane(self) -> int:
        self._next_lane += 1
        return self._next_lane - 1

    def _release(self, request: int) -> None:
        lane = self.active.pop(request, None)
        if lane is not None:
            heapq.heappush(self._free_lanes, lane)
        self.backend.close_request(request)
        if self.predictor is not None:
            self.predictor.forget(request)
            self.cache.release_prefetches(request)
        self.fetcher.put_nowait(Forget(request))

    def _cancel(self, request: int, error: str | None = None) -> None:
        """Drop a queued request at once; for an active one, unpin a blocked job and tell the scheduler.

        With ``error`` the request failed rather than being cancelled; its caller gets the error.

        The scheduler owns the rest of the request (a ready job's pins, the step barrier, its KV
        cache) and answers with :class:`Finished`. Jobs of the request still in flight towards
        this actor are dropped when they arrive.
        """
        for spec in self.queued:
            if spec.request == request:
                self.queued.remove(spec)
                if self.sink is not None:
                    self.sink.finished(request, cancelled=True, error=error)
                return
        if request not in self.active or request in self._cancelled:
            return
        self._cancelled.add(request)
        blocked = self._blocked.pop(request, None)
        if blocked is not None:
            job = blocked[0]
            self.cache.unpin_ids(job.ids)
            for expert in job.ids:  # the job no longer waits on its missing experts
                waiters = [w for w in self._waiters.get(expert, ()) if w is not job]
                if waiters:
                    self._waiters[expert] = waiters
                else:
                    self._waiters.pop(expert, None)
        self.cache.release_prefetches(request)
        self.fetcher.put_nowait(Forget(request))
        self.scheduler.put_nowait(Cancel(request, error))
