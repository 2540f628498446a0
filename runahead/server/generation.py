"""From engine chunks to OpenAI answers: stop strings, text deltas, SSE events, whole responses.

Every path that reads the engine's ``generate`` iterator closes it when it stops (the end, a stop
string, an error or the client going away), so the engine cancels the request and frees its cache
pins and KV cache at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import structlog

from runahead.server.errors import APIError
from runahead.server.protocol import Choice, GenerationRequest
from runahead.server.responses import Usage
from runahead.server.shapes import Answer, Delta, ResponseShape, Scored

if TYPE_CHECKING:
    from runahead.engine import Chunk, Engine, Generation
    from runahead.sampling import TokenLogprob

T = TypeVar("T")

log = structlog.get_logger("runahead.server")

DONE = "data: [DONE]\n\n"


class StopMatcher:
    """Cuts generated text at the first stop string, holding back any end that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that is safe to show now, and whether a stop string was reached."""
        pending = self.held + text
        found = [i for i in (pending.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.held = ""
            return pending[: min(found)], True
        keep = self._open_tail(pending)
        self.held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """The held-back text, once the generation ended without reaching a stop string."""
        text, self.held = self.held, ""
        return text

    def _open_tail(self, text: str) -> int:
        """The length of the longest end of ``text`` that is the beginning of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


@dataclass(slots=True)
class Tally:
    """Token counts of one request, read by the access log and the metrics when it ends."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> Usage:
        """OpenAI's ``usage`` object."""
        total = self.prompt_tokens + self.completion_tokens
        return Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, total_tokens=total
        )


async def deltas(
    engine: Engine, request: GenerationRequest, choice: Choice, generation: Generation, tally: Tally
) -> AsyncIterator[Delta]:
    """One answer's text as it is generated, cut at a stop string, with its tokens' logprobs when
    asked (and the prompt first with ``echo``); the generation is closed (cancelled) when it stops."""
    matcher = StopMatcher(request.stop)
    chunks = cast("AsyncGenerator[Chunk, None]", aiter(generation))
    try:
        async for chunk in chunks:
            tally.completion_tokens += 1
            echo = choice.prompt_text if request.echo and chunk.index == 0 else ""
            scored = _scored(engine, request, choice, chunk)
            text, stopped = matcher.feed(chunk.text)
            if stopped:
                yield Delta(choice.index, echo + text, scored, "stop")
                return
            if chunk.finish_reason is not None:
                yield Delta(choice.index, echo + text + matcher.flush(), scored, chunk.finish_reason)
                return
            if echo or text or scored:
                yield Delta(choice.index, echo + text, scored)
    finally:
        await chunks.aclose()
    raise APIError(
        "the engine stopped before this request finished",
        status=503,
        kind="server_error",
        code="engine_stopped",
    )


def _scored(engine: Engine, request: GenerationRequest, choice: Choice, chunk: Chunk) -> tuple[Scored, ...]:
    """The logprobs a chunk brings, as text: the prompt's (with ``echo``, on the first), then its token's."""
    if request.logprobs is None:
        return ()
    entries: list[Scored] = []
    if request.echo and chunk.index == 0:
        entries.append(Scored(engine.token_text(choice.prompt_ids[0]), None, None))
        entries += [_score(engine, entry) for entry in chunk.prompt_logprobs]
    if chunk.logprob is not None:
        entries.append(_score(engine, chunk.logprob))
    return tuple(entries)


def _score(engine: Engine, entry: TokenLogprob) -> Scored:
    top = tuple((engine.token_text(token), value) for token, value in entry.top)
    return Scored(engine.token_text(entry.token), entry.logprob, top)


async def collect(
    engine: Engine, request: GenerationRequest, choice: Choice, generation: Generation, tally: Tally
) -> Answer:
    """Run one answer to its end: its text, finish reason and logprobs."""
    parts: list[str] = []
    scored: list[Scored] = []
    reason = "length"
    stream = cast("AsyncGenerator[Delta, None]", deltas(engine, request, choice, generation, tally))
    try:
        async for delta in stream:
            parts.append(delta.text)
            scored += delta.scored
            reason = delta.finish_reason or reason
    finally:
        await stream.aclose()
    return Answer(choice.index, "".join(parts), reason, tuple(scored))


async def collect_all(
    engine: Engine,
    request: GenerationRequest,
    generations: Sequence[Generation],
    tally: Tally,
    timeout_s: float | None = None,
) -> list[Answer]:
    """Every answer of a request, run at once; the first error (or ``timeout_s`` passing: 504)
    cancels the others."""
    pairs = zip(request.choices, generations, strict=True)
    try:
        async with asyncio.timeout(timeout_s):
            return await all_or_none([collect(engine, request, c, g, tally) for c, g in pairs])
    except TimeoutError:
        raise timed_out(timeout_s) from None


def timed_out(timeout_s: float | None) -> APIError:
    """The error of a request that ran past the server's time limit."""
    return APIError(
        f"the request ran past this server's time limit of {timeout_s:g} s and was cancelled",
        status=504,
        kind="server_error",
        code="timeout",
    )


async def all_or_none(work: Sequence[Awaitable[T]]) -> list[T]:
    """Await every item; if one fails (or this is cancelled), cancel the rest before raising."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: Sequence[AsyncIterator[T]], timeout_s: float | None = None) -> AsyncIterator[T]:
    """The items of several async iterators as each comes; ending this ends (and closes) them all.
    Past ``timeout_s`` it raises the 504 of :func:`timed_out`."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    pending = {asyncio.ensure_future(anext(stream)): stream for stream in streams}
    try:
        while pending:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise timed_out(timeout_s)
            for task in sorted(done, key=lambda t: streams.index(pending[t])):
                stream = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(stream))] = stream
                yield item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await cast("AsyncGenerator[T, None]", stream).aclose()


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse_events(
    engine: Engine,
    request: GenerationRequest,
    generations: Sequence[Generation],
    shape: ResponseShape,
    tally: Tally,
    timeout_s: float | None = None,
) -> AsyncIterator[str]:
    """The streamed answer: OpenAI chunks as SSE events, then ``[DONE]``; errors become an event."""
    extra: dict[str, Any] = {"usage": None} if request.include_usage else {}
    for payload in shape.opening([choice.index for choice in request.choices]):
        yield sse(payload | extra)
    pairs = zip(request.choices, generations, strict=True)
    stream = merged([deltas(engine, request, c, g, tally) for c, g in pairs], timeout_s)
    try:
        async for delta in stream:
            yield sse(shape.chunk(delta) | extra)
    except APIError as error:
        yield sse(error.body())
    except Exception as error:  # headers are sent: the client can only learn of it in the stream
        log.exception("stream failed", error=repr(error))
        yield sse(APIError(f"generation failed: {error}", status=500, kind="server_error").body())
    else:
        if request.include_usage:
            yield sse(shape.usage_chunk(tally.usage()))
    finally:
        await cast("AsyncGenerator[Delta, None]", stream).aclose()
    yield DONE
