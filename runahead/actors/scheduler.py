"""ComputeScheduler: picks the next group (``SELECT_COMPUTE_GROUP``) and runs it on the backend.

When a group's compute returns, its experts are unpinned and each request's next job (revealed by
the gate) goes back to the JobIssuer; the scheduler waits for the issuer's answer before choosing
again, so the choice always sees every job that is ready at that moment. When the issuer is idle
and nothing else is ready to run, the scheduler calls the issuer's handler itself
(:class:`runahead.mailbox.Handoff`): the same order of events, without the round trip. A request that finished
its token starts its next one at once, or at the step barrier when that is on.

With ``bottleneck`` grouping the scheduler hands the pure rule (:meth:`ComputeQueue.plan`) what it
knows when the compute unit frees up: the clock's time, the jobs the JobIssuer holds (it sent them,
and has not had them back as ready), the cache's view of their experts, and costs: the backend's
cost model when it has one (the sim's ``costs``), else what this run measured (group compute times
fitted per kind of layer as shared + per distinct expert, the link's busy time per read). A :class:`Hold`
waits for the next message (a job became ready, a cancellation) or the hold's deadline, whichever
comes first, then decides again. With ``adaptive`` grouping on such a backend a
:class:`runahead.mode.ModeChooser` is told of every token and may switch the queue to one group of
every request (batching) while that measures faster, and back.

A backend that computes on a thread of its own (:class:`runahead.backend.InlineCompute`) is asked to
compute a decode group on the event loop's thread instead when the ``link`` (the ExpertFetcher) has
started every read it can: the loop first yields while a read is about to start (a worker woken, a
message queued), so those reads run on the store's threads while the loop computes, and the two
thread hand-offs are saved. Until the group's results reveal more experts no read could start
anyway; the reads in flight land meanwhile, dated by the store's threads. After such a group the
scheduler yields to the loop once, as the awaited ``compute`` would, or :data:`SETTLE_YIELDS` times
where reads were in flight: the landings the loop takes late reach the ready jobs before the next
choice.

A group whose compute raises fails only its own requests (their pins and state are released, their
callers get the error); the others go on. ``max_compute_failures`` groups failing in a row means
the compute unit itself is broken: the scheduler then stops the runtime with
:class:`runahead.health.RuntimeBroken`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

from runahead.backend import Backend, BrokenPromise, InlineCompute, ModelledLink
from runahead.bottleneck import ComputeFit, GroupPricer, Hold, Outlook, may_hold
from runahead.cache import ExpertCache
from runahead.clock import Clock
from runahead.costs import CostModel, GroupCost
from runahead.health import Health, RuntimeBroken
from runahead.jobs import ENTRY_LAYER, Group, Job, JobResult, RequestSpec, distinct_experts
from runahead.mailbox import Handoff, Mailbox, Outbox
from runahead.messages import Cancel, Finished, IssuerMessage, NextJobs, Ready, SchedulerMessage, Started
from runahead.metrics import Recorder
from runahead.mode import Mode, ModeChooser
from runahead.scheduling import ComputeQueue, Grouping, StepBarrier

SHARE_WINDOW_STEPS = 4
"""Without a cost model the rule's compute share is measured over about this many recent steps."""

_SELF_CONTAINED = (Ready, Started)
"""Messages whose handling changes only the scheduler's own state (and sends nothing)."""

BATCHING = Grouping(static=True)
"""The grouping an adaptive scheduler switches to while batching measures faster: ``sync``'s."""

SETTLE_YIELDS = 8
"""Turns the scheduler gives the event loop after a group it computed on the loop's thread while
reads were in flight, before it chooses again. A read that landed during the group reaches the
ready jobs in a chain of turns (the store's callback, the link worker, the JobIssuer, this inbox),
several reads one chain each; choosing after one turn, the scheduler saw few of them and made
smaller groups. Measured on the medium model behind a 3 GB/s cap, 70% cache (docs/results-torch.md,
"Groups on the loop's thread while reads are in flight"): 8 requests ran 27.5 tok/s after 4 turns
and 28.7 after 8, 4 requests 23.4 and 23.8."""


class Link(Protocol):
    """What the scheduler asks the link (the :class:`runahead.actors.fetcher.ExpertFetcher`) before
    computing a group on the event loop's thread."""

    queue_depth: int

    def settled(self) -> bool:
        """Every read that can start has started."""
        ...

    def starting(self) -> bool:
        """A read is about to start, given a turn of the loop."""
        ...

    def reading(self) -> bool:
        """A read is in flight."""
        ...


class TokenSink(Protocol):
    """Where generated tokens go (the runtime's per-request streams)."""

    def token(self, request: int, step: int, token: int, time: float) -> None: ...

    def finished(self, request: int, cancelled: bool = False, error: str | None = None) -> None: ...


class ComputeScheduler:
    """Owns the ready jobs, the compute unit, request progress and the step barrier."""

    def __init__(
        self,
        *,
        backend: Backend,
        cache: ExpertCache,
        queue: ComputeQueue,
        barrier: StepBarrier,
        inbox: asyncio.Queue[SchedulerMessage],
        issuer: Outbox[IssuerMessage],
        clock: Clock,
        recorder: Recorder,
        sink: TokenSink,
        prefill_chunk: int = 256,
        health: Health | None = None,
        max_compute_failures: int = 3,
        link: Link | None = None,
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.queue = queue
        self.barrier = barrier
        self.inbox = inbox
        self.issuer = issuer
        self.clock = clock
        self.recorder = recorder
        self.sink = sink
        self.last_layer = backend.num_layers - 1
        self.prefill_chunk = prefill_chunk
        self.health = health or Health()
        self.max_compute_failures = max_compute_failures
        self.chunks: dict[int, list[int]] = {}  # request -> token count of each prefill pass
        self.requests: dict[int, RequestSpec] = {}
        self.lanes: dict[int, int] = {}
        self.positions: dict[int, tuple[int, int]] = {}  # requests with a job in flight
        self.blocked: dict[int, Job] = {}  # jobs sent to the issuer and not back as ready yet
        self._ahead = queue.grouping  # the configured grouping (what AHEAD runs)
        self._bottleneck = queue.grouping.bottleneck  # the rule decides now (it may hold groups)
        self._tracking = queue.grouping.bottleneck  # blocked jobs and the compute fit are kept
        self._model = getattr(backend, "costs", None)  # the sim's cost model, if any
        self._chooser: ModeChooser | None = None  # measures ahead against batching (real backends)
        if queue.grouping.adaptive and self._model is None:
            self._chooser = ModeChooser(settle_switches=not barrier.enabled)
        self._prompt_computed = False  # a prompt pass ran since the chooser's last token
        self._batched = [0.0, 0.0, 0.0]  # compute and link seconds and reads while batching
        self._pricer: GroupPricer | None = None  # a CostModel's prices, job by job
        if isinstance(self._model, CostModel):
            self._pricer = partial(GroupCost, self._model, self._context)
        self._fit = ComputeFit(self.last_layer)
        self._share_window: deque[tuple[float, float]] = deque([(0.0, 0.0)], maxlen=SHARE_WINDOW_STEPS + 1)
        self._next_share_mark = 0  # token count at which the window takes its next mark
        self._awaiting_reply = False
        self._closing = False
        self._now = clock.now  # the clock's reader for the running loop, once run() starts
        # decode groups run on the loop's thread once the link has started its reads (None: never)
        self._compute_inline: Callable[[Group], Sequence[JobResult]] | None = None
        self._link = link
        if link is not None and isinstance(backend, InlineCompute):
            self._compute_inline = backend.compute_inline
        # when each read in flight lands, where the backend's link is a model (the sim)
        self._lands = backend.landings() if isinstance(backend, ModelledLink) else None

    async def run(self) -> None:
        """Compute groups until the inbox yields ``None``."""
        self._now = self.clock.reader()
        while not self._closing:
            while not self.inbox.empty():
                self.handle(self.inbox.get_nowait())
            if self._awaiting_reply:
                choice = None
            elif self._bottleneck:
                choice = self.queue.plan(self.positions, self.lanes, self._outlook())
            else:
                choice = self.queue.select_group(self.positions, self.lanes)
            if isinstance(choice, Group):
                await self._compute(choice)
            elif isinstance(choice, Hold):
                await self._hold(choice.deadline)
            elif not self._closing:
                self.handle(await self.inbox.get())

    async def _hold(self, deadline: float) -> None:
        """Wait for the next message, or until ``deadline`` (then the caller decides again).

        A real loop's timers count whole milliseconds (uvloop rounds a wait of 0.3 ms to none), so a
        timer may fire before the deadline: the wait goes on until the deadline has passed.
        """
        self.recorder.holds += 1
        wait = max(1e-6, deadline - self._now())
        while True:
            try:
                async with asyncio.timeout(wait):
                    message = await self.inbox.get()
            except TimeoutError:
                wait = deadline - self._now()
                if wait < 1e-6:
                    return
                continue
            self.handle(message)
            return

    def _outlook(self) -> Outlook | None:
        """What ``bottleneck`` grouping decides from; None while there is nothing to wait for, or no
        group may be held (:func:`may_hold`)."""
        if not self.blocked:
            return None
        recorder = self.recorder
        if self._model is not None:
            fetch_s = float(self._model.fetch_transfer_time())
            link_s = fetch_s * recorder.reads
            share = recorder.compute_seconds / link_s if link_s else 1.0
        elif recorder.reads > self._batched[2] and self._fit.middle.observed >= 2:
            # the link's time per read: its busy time, not the reads' own (reads in flight together
            # each take longer than the link spends on one; summed, they double count the link)
            compute, link, reads = self._ahead_totals()
            fetch_s = link / reads
            share = self._recent_share(compute, link)
        else:
            return None  # nothing measured yet: group as the paper does
        if not may_hold(share):
            return None  # no group may be held now: the paper's group, as the rule would say
        return Outlook(
            self._now(),
            list(self.blocked.values()),
            self.cache.resident_ids,
            self.cache.pending_ids,
            fetch_s,
            self._group_s,
            share,
            self.last_layer if self.barrier.enabled else None,
            self._pricer,
            measured=self._model is None,
            lands=self._lands,
        )

    def _recent_share(self, compute: float, link: float) -> float:
        """Compute busy time over link busy time in about the last :data:`SHARE_WINDOW_STEPS` decode
        steps run ahead (measured: a real run starts with a cold cache, link-bound, and a share since
        the start would keep the rule off long after the cache warmed); ``compute`` and ``link`` are
        the busy times so far, batching's left out (:meth:`_ahead_totals`)."""
        recorder = self.recorder
        window = self._share_window
        if recorder.token_count >= self._next_share_mark:
            window.append((compute, link))
            self._next_share_mark = recorder.token_count + max(1, len(self.requests))
        compute_0, link_0 = window[0]
        return (compute - compute_0) / (link - link_0) if link > link_0 else 1.0

    def _ahead_totals(self) -> tuple[float, float, int]:
        """Compute and link busy seconds and reads so far, without those of steps batched by adaptive
        grouping: what the rule measures is running ahead (a share measured while batching, its
        compute small, would keep the rule from holding for steps after a switch back)."""
        recorder, batched = self.recorder, self._batched
        return (
            recorder.compute_seconds - batched[0],
            recorder.link_seconds - batched[1],
            recorder.reads - int(batched[2]),
        )

    def _group_s(self, jobs: Sequence[Job]) -> float:
        """Compute seconds of one group of ``jobs``: the cost model's, else the measured fit."""
        if self._model is None:
            return self._fit(jobs)
        contexts = list(map(self._context, jobs))
        return float(
            self._model.compute_time(
                jobs[0].layer, [job.num_tokens for job in jobs], contexts, distinct_experts(jobs)
            )
        )

    def _context(self, job: Job) -> int:
        """The tokens a job's attention reads, its own included (what the cost model prices)."""
        return self.requests[job.request].prompt_tokens + job.step + job.num_tokens

    def handle(self, message: SchedulerMessage) -> None:
        if message is None:
            self._closing = True
        elif isinstance(message, Ready):
            jobs = message.jobs
            if self.blocked:
                for job in jobs:
                    self.blocked.pop(job.request, None)
            self.queue.add_all(jobs)
            if message.reply:
                self._awaiting_reply = False
        elif isinstance(message, Cancel):
            self._cancel(message.request, message.error)
        elif isinstance(message, Started):
            epoch = min((p[0] for p in self.positions.values()), default=self.barrier.round + 1)
            entries = []
            for request, lane in message.requests:
                self.requests[request.request] = request
                self.lanes[request.request] = lane
                self.chunks[request.request] = request.chunk_sizes(self.prefill_chunk)
                entries.append(self._entry_job(request.request, 0, lane, epoch))
            self._release(self.barrier.arrive(entries))

    def _entry_job(self, request: int, step: int, lane: int, epoch: int) -> Job:
        """The first job of a pass: a prefill chunk while the prompt lasts, then one decode token."""
        chunks = self.chunks[request]
        prefill = step < len(chunks)
        tokens = chunks[step] if prefill else 1
        return Job(request, step, ENTRY_LAYER, lane=lane, num_tokens=tokens, epoch=epoch, prefill=prefill)

    async def _compute(self, group: Group) -> None:
        inline = None if self._compute_inline is None else await self._inline_for(group)
        reading = inline is not None and self._link is not None and self._link.reading()
        start = self._now()
        try:
            if inline is not None:
                self.recorder.inline_groups += 1
                results = inline(group)
            else:
                results = await self.backend.compute(group)
        except BrokenPromise:
            raise
        except Exception as error:
            self._group_failed(group, error)
            if inline is not None:
                await asyncio.sleep(0)  # what the awaited compute gave the loop's other tasks
            return
        self.health.compute_succeeded()
        end = self._now()
        if self._tracking and self._model is None:
            self._fit.observe_group(group.jobs, end - start)
            if self._chooser is not None and not self._prompt_computed:
                self._prompt_computed = any(job.prefill for job in group.jobs)
        if len(results) != len(group.jobs):
            raise RuntimeError(
                f"backend returned {len(results)} results for a group of {len(group.jobs)} jobs"
            )
        jobs = group.jobs
        self.recorder.compute(start, end, group.layer, tuple([job.request for job in jobs]))
        self.cache.unpin_jobs(jobs)  # in order, as job by job
        next_jobs = []
        positions, last_layer = self.positions, self.last_layer
        for result in results:
            job = result.job
            if job.remaining:  # more waves of this job's experts to go
                next_jobs.append(self._next_wave(job))
            elif job.layer == last_layer:
                self._token_done(result, end)
            else:
                layer, epoch = job.layer + 1, job.epoch
                positions[job.request] = (epoch, layer)
                next_jobs.append(
                    Job(
                        job.request,
                        job.step,
                        layer,
                        result.next_experts,
                        job.lane,
                        job.num_tokens,
                        result.predicted_next,
                        epoch,
                        prefill=job.prefill,
                    )
                )
        if next_jobs:
            if self._tracking:
                for job in next_jobs:
                    self.blocked[job.request] = job
            self._awaiting_reply = True
            await self._send_next(NextJobs(tuple(next_jobs)))
        if inline is not None:
            # the loop's other tasks (streams, new requests) run between groups, and the reads that
            # landed during this one reach the ready jobs
            for _ in range(SETTLE_YIELDS if reading else 1):
                await asyncio.sleep(0)

    async def _inline_for(self, group: Group) -> Callable[[Group], Sequence[JobResult]] | None:
        """``compute_inline`` where ``group`` may run on the loop's thread, else None (the compute
        thread takes it): a decode group, once the link has started every read it can. While a
        read is about to start the loop gets a turn (at most one per link worker, and two more),
        so that read runs on the store's threads during the group."""
        link = self._link
        if link is None or any(job.prefill for job in group.jobs):
            return None  # a prompt chunk (long): the loop would miss too much
        for _ in range(link.queue_depth + 2):
            if not link.starting():
                break
            await asyncio.sleep(0)
        return self._compute_inline if link.settled() else None

    async def _send_next(self, message: NextJobs) -> None:
        """Send a group's next jobs to the issuer; its handler takes them at once if it may.

        Before waiting for the reply the run loop would handle what is in the inbox; when that is
        only ``Ready`` and ``Started`` (which start nothing elsewhere) it is handled first, and the
        issuer may then answer at once (:meth:`Handoff.hand`): the order of events is the same.
        """
        issuer, inbox = self.issuer, self.inbox
        if (
            not isinstance(issuer, Handoff)
            or not isinstance(inbox, Mailbox)
            or not all(isinstance(queued, _SELF_CONTAINED) for queued in inbox)
        ):
            issuer.put_nowait(message)
            return
        while not inbox.empty():
            self.handle(inbox.get_nowait())
        if issuer.hand(message):  # answered: go on behind what the issuer started, if anything
            await self.clock.sleep(0)

    def _next_wave(self, job: Job) -> Job:
        return Job(
            job.request,
            job.step,
            job.layer,
            job.remaining,
            job.lane,
            job.num_tokens,
            epoch=job.epoch,
            wave=job.wave + 1,
            prefill=job.prefill,
        )

    def _token_done(self, result: JobResult, time: float) -> None:
        job = result.job
        request = self.requests[job.request]
        generated = job.step - max(0, len(self.chunks[job.request]) - 1)  # negative during prefill
        finished = False
        if generated >= 0:
            if result.token is None:
                raise RuntimeError(f"backend returned no token for request {job.request}'s last layer")
            self.recorder.token(job.request, generated, time)
            self.sink.token(job.request, generated, result.token, time)
            if self._chooser is not None:
                self._choose_mode(time)
            finished = generated + 1 >= request.max_tokens or result.token in request.stop_tokens
        self.positions.pop(job.request, None)
        if finished:
            del self.requests[job.request], self.lanes[job.request], self.chunks[job.request]
            self.issuer.put_nowait(Finished(job.request))
            self.sink.finished(job.request)
            self._release(self.barrier.token_done(job.request, None))
        else:
            entry = self._entry_job(job.request, job.step + 1, job.lane, job.epoch + 1)
            self._release(self.barrier.token_done(job.request, entry))

    def _choose_mode(self, now: float) -> None:
        """Tell the chooser of a token; switch the queue's grouping if it chose the other mode."""
        assert self._chooser is not None
        if not self._bottleneck:
            self.recorder.batched_tokens += 1
        mode = self._chooser.token(now, len(self.requests), self._prompt_computed)
        self._prompt_computed = False
        if (mode is Mode.AHEAD) != self._bottleneck:
            self._set_mode(mode)

    def _set_mode(self, mode: Mode) -> None:
        """Run ahead (the configured grouping) or batch (one group of every request) from now on."""
        self._bottleneck = mode is Mode.AHEAD
        self.queue.grouping = self._ahead if self._bottleneck else BATCHING
        recorder, batched, sign = self.recorder, self._batched, 1.0 if self._bottleneck else -1.0
        batched[0] += sign * recorder.compute_seconds  # batching's totals: its end minus its start
        batched[1] += sign * recorder.link_seconds
        batched[2] += sign * recorder.reads
        recorder.mode_switches += 1

    def _group_failed(self, group: Group, error: Exception) -> None:
        """A group's compute raised: fail its requests alone, or stop if computes keep failing."""
        message = f"computing layer {group.layer} failed: {error!r}"
        self.health.compute_failed(message)
        if self.health.compute_failures_in_a_row >= self.max_compute_failures:
            self.health.fatal = f"{self.max_compute_failures} groups in a row failed; the last: {message}"
            raise RuntimeBroken(self.health.fatal) from error
        for job in group.jobs:
            self.cache.unpin_ids(job.ids)
            self._cancel(job.request, message)

    def _cancel(self, request: int, error: str | None = None) -> None:
        """Forget a cancelled (or, with ``error``, failed) request: unpin its ready job, leave the
        barrier, free its lane."""
        if request not in self.requests:
            return  # it finished meanwhile
        job = self.queue.discard(request)
        if job is not None:
            self.cache.unpin_ids(job.ids)
        released = self.barrier.forget(request)
        self.positions.pop(request, None)
        self.blocked.pop(request, None)
        del self.requests[request], self.lanes[request], self.chunks[request]
        self.issuer.put_nowait(Finished(request))
        self.sink.finished(request, cancelled=True, error=error)
        self._release(released)

    def _release(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.positions[job.request] = job.progress
            self.queue.add(job)
