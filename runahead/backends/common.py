"""What the real backends (torch, mlx) share about requests and a group's rows; no tensor library.

A group is one batch of rows, one per token of each job, in job order (:func:`row_spans`); a job's
tokens are the next prompt chunk or the last sampled token (:func:`input_tokens`). A request is
checked once at admission (:func:`admit`), and what its sampling asked to score is handed over as
each token is delivered (:func:`take_logprobs`). :class:`SlotOwners` keeps which expert each cache
slot holds. :class:`RequestLifecycle` is the part of the backend protocol both implement alike: the
open requests' states and the one compute thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from runahead.jobs import ExpertKey, Group, Job, JobResult, RequestSpec
from runahead.sampling import Sampler, SamplingParams, StepLogprobs, TokenLogprob


class Scored(Protocol):
    """A backend's per-request state that keeps what it scored until the runtime takes it."""

    prompt_logprobs: list[TokenLogprob]
    token_logprob: TokenLogprob | None


class RequestState(Scored, Protocol):
    """A backend's per-request state, as :class:`RequestLifecycle` sees it."""

    logits: list[Any]


State = TypeVar("State", bound=RequestState)


class RequestLifecycle(Generic[State]):
    """The request lifecycle and compute hand-off both real backends share.

    A subclass sets ``backend_name``, ``vocab_size``, ``store`` and ``_compute_thread`` (one
    worker: the backend's compute is one thread, from :meth:`_start_compute_thread`), and implements
    ``_new_state`` and ``_compute`` (one group on that thread).
    """

    backend_name: str
    store: Any  # the backend's expert store or reader: what close() closes
    _compute_thread: ThreadPoolExecutor
    speculate: bool
    """Apply the following layer's gate to each job's hidden state and report its guess
    (``JobResult.predicted_next``); the runtime sets it from its policy (:meth:`use_speculative_gate`)."""

    def __init__(self) -> None:
        self._requests: dict[int, State] = {}
        self.thread_seconds = 0.0
        """Time spent inside ``_compute``, every group of the backend's life summed (on the compute
        thread, or on the caller's for ``compute_inline``).
        The runtime's compute time of a group (from the event loop's hand-off to its resuming with
        the results) is longer by the two thread hand-offs: :func:`handoff_seconds`."""
        self.thread_cpu_seconds = 0.0
        """CPU time of the compute thread itself inside ``_compute`` (``time.thread_time``), summed as
        :attr:`thread_seconds` is. Below it when the thread waited inside a group: for a core, for the
        GIL, or for helper threads of its own (whose CPU is not counted here): :func:`compute_cpu_share`."""
        self.inline_cpu_seconds = 0.0
        """CPU time of the groups a backend computed on the caller's thread (``compute_inline``, where
        it has one: :class:`runahead.backend.InlineCompute`), summed: the event loop's thread ran
        them, so a count of the loop's own CPU leaves them out."""
        self.compute_nice: int | None = None
        """The nice value the compute thread runs at once it started (Linux; None before its first group,
        elsewhere, or where it was told to leave its priority alone): :mod:`runahead.backends.priority`."""

    def _start_compute_thread(self, prefix: str, nice: int | None) -> ThreadPoolExecutor:
        """The one compute thread (named ``prefix``), asking to run at ``nice`` when it starts (None:
        left alone; :func:`runahead.backends.priority.resolve_nice` gives it). Where the OS refuses,
        it runs as it was."""
        from runahead.backends.priority import prioritize_this_thread

        def on_start() -> None:
            self.compute_nice = prioritize_this_thread(nice)

        return ThreadPoolExecutor(1, thread_name_prefix=prefix, initializer=on_start)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def _new_state(self, request: RequestSpec, sampler: Sampler) -> State:
        """A fresh state for an admitted request (its KV cache or recurrent state, its sampler)."""
        raise NotImplementedError

    def _compute(self, group: Group) -> list[JobResult]:
        """One backend call on the compute thread."""
        raise NotImplementedError

    def open_request(self, request: RequestSpec) -> None:
        params = admit(request, self.vocab_size, self.backend_name)
        self._requests[request.request] = self._new_state(request, Sampler(params))

    def close_request(self, request: int) -> None:
        self._requests.pop(request, None)

    def take_logprobs(self, request: int) -> StepLogprobs | None:
        """What was scored for an open request since the last call (with ``logprobs`` or
        ``prompt_logprobs`` in its sampling), or None; called as each token is delivered."""
        return take_logprobs(self._requests.get(request))

    def use_speculative_gate(self, on: bool) -> None:
        """:class:`runahead.backend.SpeculativeGate`: guess the next layer's experts only when the
        runtime's policy prefetches by the gate's guess."""
        self.speculate = on

    def logits_of(self, request: int) -> list[Any]:
        """Logits of each generated token of an open request (with ``keep_logits``)."""
        return self._requests[request].logits

    def close(self) -> None:
        """Stop the compute thread and close the store."""
        self._compute_thread.shutdown(wait=True)
        self.store.close()

    async def compute(self, group: Group) -> Sequence[JobResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compute_thread, self._timed_compute, group)

    def _timed_compute(self, group: Group, inline: bool = False) -> list[JobResult]:
        """``_compute`` on the compute thread, its time added to :attr:`thread_seconds`; ``inline``: on
        the caller's thread instead, its CPU added to :attr:`inline_cpu_seconds` too."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._compute(group)
        finally:
            self.thread_seconds += time.perf_counter() - start
            used = time.thread_time() - cpu
            self.thread_cpu_seconds += used
            if inline:
                self.inline_cpu_seconds += used


def handoff_seconds(compute_seconds: float, groups: int, backend: object) -> float | None:
    """Seconds per group between the event loop and a real backend's compute thread: the runtime's
    compute time (``compute_seconds`` over ``groups``, from each hand-off to the loop resuming with
    the results) less the thread's own (:attr:`RequestLifecycle.thread_seconds`). Both hops are on
    the compute unit's critical path: the thread waits for its next group meanwhile. None for a
    backend without a compute thread (the sim) or before any group."""
    thread_seconds = getattr(backend, "thread_seconds", None)
    if thread_seconds is None or not groups:
        return None
    return (compute_seconds - float(thread_seconds)) / groups


def compute_cpu_share(backend: object) -> float | None:
    """The share of a real backend's compute-thread time inside groups that the thread ran on a core:
    its :attr:`~RequestLifecycle.thread_cpu_seconds` over its :attr:`~RequestLifecycle.thread_seconds`.

    With one compute thread, what is missing from 1 is time the thread was ready but not running: it
    waited for a core (reads' copies and the event loop on the same cores) or for the GIL (each
    torch call lets go of it). Work on other threads (torch's intra-op threads, the CPU kernel's
    helpers) is not counted, so with several threads the share is lower for that reason too. None
    for a backend without a compute thread (the sim) or before any group."""
    wall, cpu = getattr(backend, "thread_seconds", None), getattr(backend, "thread_cpu_seconds", None)
    if wall is None or cpu is None or wall <= 0:
        return None
    return min(1.0, float(cpu) / float(wall))


def admit(request: RequestSpec, vocab_size: int, backend: str) -> SamplingParams:
    """Check ``request``'s prompt (non-empty, every id in ``[0, vocab_size)``); return its sampling.

    Raises ``ValueError`` naming the request and the bad ids.
    """
    if not request.prompt:
        raise ValueError(f"request {request.request}: the {backend} backend needs a non-empty prompt")
    bad = [t for t in request.prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"request {request.request}: prompt token ids {bad[:5]} are outside [0, {vocab_size})"
        )
    params: SamplingParams = request.sampling or SamplingParams(max_tokens=request.max_tokens)
    return params


def take_logprobs(state: Scored | None) -> StepLogprobs | None:
    """What was scored for a request since the last call (and forget it), or None if nothing was."""
    if state is None or (not state.prompt_logprobs and state.token_logprob is None):
        return None
    step = StepLogprobs(tuple(state.prompt_logprobs), state.token_logprob)
    state.prompt_logprobs, state.token_logprob = [], None
    return step


def input_tokens(spec: RequestSpec, position: int, last_token: int | None, job: Job) -> list[int]:
    """The tokens a job embeds: the next prompt chunk (from ``position``), or the last sampled token."""
    if job.prefill:
        chunk = list(spec.prompt[position : position + job.num_tokens])
        if len(chunk) != job.num_tokens:
            raise RuntimeError(f"request {job.request}: prefill chunk past the end of the prompt")
        return chunk
    assert last_token is not None
    return [last_token]


def row_spans(jobs: Sequence[Job]) -> list[tuple[int, int]]:
    """Each job's rows ``[start, stop)`` in the group's batch (one row per token)."""
    spans, start = [], 0
    for job in jobs:
        spans.append((start, start + job.num_tokens))
        start += job.num_tokens
    return spans


def distinct_experts(rows: Iterable[Iterable[int]]) -> tuple[int, ...]:
    """The distinct experts in rows of routing, ascending."""
    return tuple(sorted({int(e) for row in rows for e in row}))


class SlotOwners:
    """Which expert each cache slot holds, as the backend's fetches filled them.

    :meth:`claim` when a fetch into a slot starts (the slot's previous expert is no longer there),
    :meth:`filled` when its bytes landed; :meth:`slot` finds a resident expert's slot for a compute
    and refuses one the runtime did not make resident (a broken promise, not a user error).
    """

    def __init__(self) -> None:
        self.owner: dict[int, ExpertKey] = {}
        self.slot_of: dict[ExpertKey, int] = {}

    def claim(self, key: ExpertKey, slot: int) -> None:
        """A fetch of ``key`` into ``slot`` starts: whatever the slot held is gone, and ``key`` is
        nowhere until :meth:`filled` (a slot that held it before no longer counts). An expert the
        slot once held that another slot holds now stays where it is."""
        previous = self.owner.get(slot)
        if previous is not None and self.slot_of.get(previous) == slot:
            del self.slot_of[previous]
        before = self.slot_of.pop(key, None)
        if before is not None and before != slot and self.owner.get(before) == key:
            del self.owner[before]
        self.owner[slot] = key

    def filled(self, key: ExpertKey, slot: int) -> None:
        """``key``'s bytes are in ``slot``."""
        self.slot_of[key] = slot

    def slot(self, key: ExpertKey) -> int:
        """The slot holding ``key``; ``RuntimeError`` if none does."""
        slot = self.slot_of.get(key)
        if slot is None or self.owner.get(slot) != key:
            raise RuntimeError(
                f"{key} is not resident in any cache slot; the runtime must pin it before compute"
            )
        return slot
