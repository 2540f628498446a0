"""The engine API for async apps: open a model, stream generations, many at once.

::

    async with await Engine.open("path/to/model", device="cpu", cache_fraction=0.3) as engine:
        async for chunk in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(chunk.text, end="")
        done = await engine.complete([1, 2, 3], SamplingParams(max_tokens=8))

Every ``generate`` call is one request of the running runtime: calls made from many tasks
interleave (continuous batching: requests join and leave at any time, prompts are processed in
chunks between other requests' tokens). Cancelling the consuming task cancels the request, which
releases its cache pins and KV cache at once. The engine imports no HTTP.

Admission is bounded: beyond the requests the runtime runs at once (its deadlock rule), at most
``max_waiting`` wait; :meth:`Engine.submit` refuses more with :class:`EngineOverloaded` at once,
before anything is queued, so a server can answer 429 instead of letting a queue grow.

The runtime runs in a task of its own. A failed expert read or group compute fails only the
requests that needed it (their ``generate`` raises :class:`RequestFailed` naming the expert and
the file); :meth:`Engine.health` says ``degraded`` meanwhile. Should the runtime stop (an error it
cannot isolate), every running request fails with the reason, :attr:`Engine.failure` holds it
and :meth:`Engine.wait_stopped` returns. Closing the engine fails the requests still running with
a clear error rather than ending their streams silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from runahead.backend import READS_IN_FLIGHT
from runahead.health import RequestFailed
from runahead.jobs import RequestSpec
from runahead.runtime import RequestHandle, Runtime, RuntimeConfig
from runahead.sampling import SamplingParams, TokenLogprob

DEFAULT_MAX_WAITING = 128
"""Requests that may wait for admission beyond the running ones (TGI's default bound is 128 too)."""


class EngineOverloaded(RuntimeError):
    """Too many requests already wait for admission; the caller should retry later."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One generated token and the text it adds (may be empty while a character is incomplete)."""

    token_id: int
    text: str
    index: int
    finish_reason: str | None = None  # "stop", "length" or "cancelled" on the last chunk
    logprob: TokenLogprob | None = None  # with SamplingParams.logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with SamplingParams.prompt_logprobs, first chunk only


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished generation."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int


class Engine:
    """A model served by the runahead runtime. Build it with :meth:`open`."""

    def __init__(
        self,
        runtime: Runtime,
        tokenizer: Any,
        *,
        context_length: int,
        vocab_size: int,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self._ids = itertools.count()
        self._running = False
        self._stop = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None
        """The error that stopped the runtime, if one did."""

    @classmethod
    async def open(
        cls,
        model: str,
        *,
        backend: str = "torch",
        device: str = "cpu",
        cache_fraction: float = 0.3,
        policy: str = "runahead",
        store: str = "disk",
        step_barrier: bool = False,
        prefill_chunk: int = 256,
        record_selections: bool = False,
        keep_records: bool = False,
        batch_invariant: bool = False,
        dtype: str = "auto",
        max_waiting: int = DEFAULT_MAX_WAITING,
        link_bandwidth: float | None = None,
        threads: int | str = "auto",
        reads_in_flight: int | None = None,
        inline_compute: bool = True,
    ) -> Engine:
        """Load ``model`` (a Hugging Face folder) and start the runtime; use as ``async with``.

        ``backend``: ``torch`` or ``mlx`` (MLX: also mlx-lm's quantized folders; ``device`` ``cpu``,
        ``gpu`` or ``auto``).

        ``keep_records`` keeps the log of every group and read (for a timeline); a long-running
        server leaves it off and keeps running totals only. ``batch_invariant`` computes each
        request's jobs on their own, so its tokens never depend on what it was batched with (float32
        or bfloat16 compute on the CPU kernel already gives that for Qwen3-MoE, Qwen3.6 and Gemma 4:
        docs/architecture.md; this holds on any path, slower).
        ``dtype``: compute and cache dtype (``auto``: bfloat16 on CUDA; on CPU float32 where the CPU
        kernel multiplies the experts as stored (a GGUF, a bf16/f16 checkpoint), else the faster of
        float32 and bfloat16 at the model's shapes, timed once per process). An unknown name: ValueError.
        ``max_waiting``: requests that may wait beyond the running ones (:meth:`submit`).
        ``link_bandwidth`` (bytes per second): pace every expert read to a serial link of that rate
        (:class:`runahead.store.LinkCap`; the bytes still come from the store), to stand in for a
        slower device's link; a value that is not a positive number: ValueError.
        ``threads`` (torch on CPU): torch's intra-op compute threads, a count or ``auto`` (every core
        but one: :mod:`runahead.backends.threads`); a process-wide torch setting. MLX picks its own:
        a count given with ``backend="mlx"`` is a ValueError.
        ``reads_in_flight``: expert reads kept in flight at once (the store's workers and the runtime's
        link workers; None: the store's :data:`runahead.backend.READS_IN_FLIGHT` workers, and the
        runtime's default, :attr:`runahead.runtime.Runtime.link_queue_depth`: four times that,
        :data:`runahead.backend.INLINE_READS_IN_FLIGHT`, where groups are computed inline): an NVMe
        drive may want more, a slow serial link fewer; below 1: ValueError.
        ``inline_compute``: while the link has nothing to read, compute each decode group on the
        event loop's thread instead of handing it to the compute thread (two wake-ups saved, ~5% of
        a token with every expert resident on a 2-core CPU); the loop then waits for that group (a
        few ms on a CPU). False keeps every group on the compute thread, for an application whose
        loop must stay free (:attr:`runahead.runtime.RuntimeConfig.inline_compute`).
        """
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        if reads_in_flight is not None and (not isinstance(reads_in_flight, int) or reads_in_flight < 1):
            raise ValueError(f"reads_in_flight must be a whole number >= 1, got {reads_in_flight!r}")
        if backend not in ("torch", "mlx"):
            raise ValueError(f"Engine.open serves real models on the torch or mlx backend, not {backend!r}")
        if backend == "mlx" and threads != "auto":
            raise ValueError(
                f"threads sets torch's compute threads; the mlx backend picks its own, got {threads}"
            )
        from runahead.extras import needs_extras

        with needs_extras():
            from runahead.models.loader import load_tokenizer

            if backend == "mlx":
                from runahead.backends.mlx import MLXBackend as Real
            else:
                from runahead.backends.torch import TorchBackend as Real  # type: ignore[assignment]

        torch_only: dict[str, Any] = {"threads": threads} if backend == "torch" else {}
        real_backend = Real.open(
            model,
            cache_fraction=cache_fraction,
            device=device,
            store=store,
            batch_invariant=batch_invariant,
            dtype=dtype,
            link_bandwidth=link_bandwidth,
            queue_depth=READS_IN_FLIGHT if reads_in_flight is None else reads_in_flight,
            **torch_only,
        )
        config = real_backend.model.config
        runtime = Runtime(
            real_backend,
            RuntimeConfig(
                cache_slots=real_backend.num_slots,
                policy=policy,
                step_barrier=step_barrier,
                link_queue_depth=reads_in_flight,
                prefill_chunk=prefill_chunk,
                record_selections=record_selections,
                keep_records=keep_records,  # off by default: a server keeps totals, not a log of every read
                inline_compute=inline_compute,
            ),
        )
        try:
            tokenizer = load_tokenizer(model)
        except Exception:  # a folder without a tokenizer still serves token ids
            tokenizer = None
        engine = cls(
            runtime,
            tokenizer,
            context_length=config.max_position_embeddings,
            vocab_size=config.vocab_size,
            max_waiting=max_waiting,
        )
        await engine.start()
        return engine

    async def start(self) -> None:
        """Start the runtime's actors in a task of their own."""
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._supervisor = asyncio.create_task(self._supervise(started), name="runahead-engine")
        await started
        self._running = True

    async def _supervise(self, started: asyncio.Future[None]) -> None:
        """Run the runtime until :meth:`close`; record the error if it stops by itself."""
        try:
            async with self.runtime:
                started.set_result(None)
                await self._stop.wait()
        except Exception as error:
            if not started.done():
                started.set_exception(error)
                return
            self.failure = error
        finally:
            self._running = False

    @property
    def running(self) -> bool:
        """True from :meth:`open` until the engine is closed or its runtime stops."""
        return self._running

    async def wait_stopped(self) -> BaseException | None:
        """Wait until the runtime stops (closed, or failed); return the error if it failed."""
        if self._supervisor is not None:
            await asyncio.shield(self._supervisor)
        return self.failure

    def health(self) -> dict[str, object]:
        """``status``: ``ok``, ``degraded`` (reads or computes failing; ``reason`` says which) or
        ``failed`` (the runtime stopped; ``reason`` says why), with failure counters."""
        report = self.runtime.health_report()
        if self.failure is not None:
            report.update(status="failed", reason=repr(self.failure))
        elif not self._running:
            report.update(status="failed", reason="the engine is closed")
        return report

    async def close(self) -> None:
        """Fail what is still running (with a clear error), stop the actors and free the backend."""
        if self._supervisor is None:
            return
        for handle in list(self.runtime.handles.values()):
            self.runtime.fail(handle.request, "the engine was closed while it ran")
        self._stop.set()
        try:
            with contextlib.suppress(Exception):  # a failure is kept in self.failure
                await self._supervisor
        finally:
            self._supervisor = None
            close = getattr(self.runtime.backend, "close", None)
            if close is not None:
                close()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text (needs the model's tokenizer) or as ids (checked)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: give the prompt as token ids")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One token as text, special tokens included (``token_id:N`` without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return str(self.tokenizer.decode([token]))

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) + params.max_tokens > self.context_length:
            raise ValueError(
                f"the prompt of {len(ids)} tokens plus max_tokens {params.max_tokens} exceeds the model's "
                f"context of {self.context_length} tokens"
            )

    @property
    def capacity(self) -> int:
        """Requests the engine holds at most: those the runtime runs at once plus ``max_waiting``."""
        return self.runtime.max_active + self.max_waiting

    def room(self) -> int:
        """How many more requests :meth:`submit` takes now."""
        return max(0, self.capacity - len(self.runtime.handles))

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Generation:
        """Check one generation and queue it now, without waiting; iterate the result for its chunks.

        Raises ``ValueError`` for a bad prompt (or one that does not fit the context with
        ``max_tokens``), :class:`EngineOverloaded` when :attr:`capacity` requests are already held,
        :class:`RequestFailed` when the engine is closed. Nothing is queued when it raises.
        """
        if not self._running:
            raise RequestFailed(
                "the engine is closed" if self.failure is None else f"the engine stopped: {self.failure!r}"
            )
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self._check(ids, params)
        if not self.room():
            raise EngineOverloaded(
                f"{len(self.runtime.handles)} requests are running or waiting, the most this engine holds "
                f"({self.runtime.max_active} running + max_waiting {self.max_waiting}); retry later"
            )
        spec = RequestSpec(
            next(self._ids),
            params.max_tokens,
            prompt=tuple(ids),
            sampling=params,
            stop_tokens=params.stop_token_ids,
        )
        (handle,) = self.runtime.submit(spec)
        return Generation(self, handle, params)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream one generation (see :meth:`submit`). Stopping the iteration (or cancelling its
        task) cancels it."""
        generation = self.submit(prompt, params)
        try:
            async for chunk in generation:
                yield chunk
        finally:
            generation.cancel()

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Completion:
        """Run one generation to its end and return it whole."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        chunks = [chunk async for chunk in self.generate(ids, params)]
        token_ids = [chunk.token_id for chunk in chunks]
        reason = chunks[-1].finish_reason if chunks and chunks[-1].finish_reason else "length"
        return Completion(token_ids, self.decode(token_ids), reason, len(ids))

    def stats(self) -> dict[str, float]:
        """Counters for monitoring: requests, cache hits/misses/fetches, busy times, queue lengths."""
        runtime, cache = self.runtime, self.runtime.cache.stats
        recorder = runtime.recorder
        return {
            "requests_active": sum(1 for h in runtime.handles.values() if not h.done()),
            "tokens_generated": recorder.token_count,
            "groups_computed": recorder.groups,
            "jobs_computed": recorder.jobs,
            "cache_hits": cache.hits,
            "cache_misses": cache.misses,
            "cache_fetches": cache.fetches,
            "cache_evictions": cache.evictions,
            "cache_slots_pinned": runtime.cache.pinned_count(),
            "compute_busy_seconds": recorder.compute_seconds,
            "expert_read_seconds": recorder.read_seconds,
            "link_busy_seconds": recorder.link_seconds,
            "reads_failed": runtime.health.reads_failed,
            "reads_retried": runtime.health.reads_retried,
            "groups_failed": runtime.health.groups_failed,
            "requests_failed": runtime.health.requests_failed,
        }


class Generation:
    """A submitted generation (:meth:`Engine.submit`): iterate it once for its chunks; leaving the
    iteration early, or :meth:`cancel`, cancels the request."""

    def __init__(self, engine: Engine, handle: RequestHandle, params: SamplingParams) -> None:
        self.engine = engine
        self.handle = handle
        self.params = params

    def cancel(self) -> None:
        """Cancel the request (its pins and KV cache are freed). Idempotent; no-op once it ended."""
        self.handle.cancel()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        engine, params = self.engine, self.params
        tokens: list[int] = []
        shown = ""
        try:
            async for token, scored in self.handle.steps():
                tokens.append(token)
                text = engine.decode(tokens)
                last = len(tokens) == params.max_tokens or token in params.stop_token_ids
                # an incomplete character is held back until the next token, or shown as is at the end
                new = text[len(shown) :] if last or not text.endswith("\ufffd") else ""
                shown += new
                reason = ("stop" if token in params.stop_token_ids else "length") if last else None
                logprob, scored_prompt = (scored.token, scored.prompt) if scored is not None else (None, ())
                yield Chunk(token, new, len(tokens) - 1, reason, logprob, scored_prompt)
        finally:
            self.cancel()  # no-op once it finished
