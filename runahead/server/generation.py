"""From engine chunks to OpenAI answers: stop strings, text deltas, SSE events, whole responses.

Every path that reads the engine's ``generate`` iterator closes it when it stops (the end, a stop
string, an error or the client going away), so the engine cancels the request and frees its cache
pins and KV cache at once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import structlog

from runahead.server.errors import APIError
from runahead.server.protocol import GenerationRequest
from runahead.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    FinishReason,
    Usage,
)

if TYPE_CHECKING:
    from runahead.engine import Chunk, Engine

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


@dataclass(frozen=True, slots=True)
class Delta:
    """New text for the client; ``finish_reason`` is set on the last one."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None


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


async def deltas(engine: Engine, request: GenerationRequest, tally: Tally) -> AsyncIterator[Delta]:
    """The request's text as it is generated, cut at a stop string; the engine's iterator is closed."""
    matcher = StopMatcher(request.stop)
    chunks = cast("AsyncGenerator[Chunk, None]", engine.generate(request.prompt_ids, request.params))
    try:
        async for chunk in chunks:
            tally.completion_tokens = chunk.index + 1
            text, stopped = matcher.feed(chunk.text)
            if stopped:
                yield Delta(text, tally.completion_tokens, "stop")
                return
            if chunk.finish_reason is not None:
                yield Delta(text + matcher.flush(), tally.completion_tokens, chunk.finish_reason)
                return
            if text:
                yield Delta(text, tally.completion_tokens)
    finally:
        await chunks.aclose()
    raise APIError(
        "the engine stopped before this request finished",
        status=503,
        kind="server_error",
        code="engine_stopped",
    )


async def collect(engine: Engine, request: GenerationRequest, tally: Tally) -> tuple[str, str]:
    """Run a request to its end; return its text and finish reason."""
    parts: list[str] = []
    reason = "length"
    stream = cast("AsyncGenerator[Delta, None]", deltas(engine, request, tally))
    try:
        async for delta in stream:
            parts.append(delta.text)
            reason = delta.finish_reason or reason
    finally:
        await stream.aclose()
    return "".join(parts), reason


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse_events(
    engine: Engine, request: GenerationRequest, shape: ResponseShape, tally: Tally
) -> AsyncIterator[str]:
    """The streamed answer: OpenAI chunks as SSE events, then ``[DONE]``; errors become an event."""
    extra: dict[str, Any] = {"usage": None} if request.include_usage else {}
    for payload in shape.opening():
        yield sse(payload | extra)
    stream = cast("AsyncGenerator[Delta, None]", deltas(engine, request, tally))
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
        await stream.aclose()
    yield DONE


class ResponseShape:
    """The id, timestamp and models of one answer; subclasses give each endpoint's fields."""

    prefix = "cmpl"

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def fields(self) -> dict[str, Any]:
        """The fields every answer and chunk carries around its choices."""
        return {"id": self.id, "created": self.created, "model": self.model}

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the first token."""
        return []

    def chunk(self, delta: Delta) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        raise NotImplementedError

    def response(self, text: str, finish_reason: str, tally: Tally) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    """``/v1/completions``: choices carry ``text``."""

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice = CompletionChoice(
            index=0, text=delta.text, logprobs=None, finish_reason=_reason(delta.finish_reason)
        )
        return Completion(**self.fields(), object="text_completion", choices=[choice]).dump()

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return Completion(**self.fields(), object="text_completion", choices=[], usage=usage).dump()

    def response(self, text: str, finish_reason: str, tally: Tally) -> dict[str, Any]:
        choice = CompletionChoice(index=0, text=text, logprobs=None, finish_reason=_reason(finish_reason))
        return Completion(
            **self.fields(), object="text_completion", choices=[choice], usage=tally.usage()
        ).dump()


class ChatShape(ResponseShape):
    """``/v1/chat/completions``: a ``message`` whole, or ``delta`` chunks after a role chunk."""

    prefix = "chatcmpl"

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(ChatDelta(role="assistant", content=""), None)]

    def chunk(self, delta: Delta) -> dict[str, Any]:
        return self._chunk(ChatDelta(content=delta.text) if delta.text else ChatDelta(), delta.finish_reason)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return ChatCompletionChunk(
            **self.fields(), object="chat.completion.chunk", choices=[], usage=usage
        ).dump()

    def _chunk(self, delta: ChatDelta, finish_reason: str | None) -> dict[str, Any]:
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=_reason(finish_reason))
        return ChatCompletionChunk(**self.fields(), object="chat.completion.chunk", choices=[choice]).dump()

    def response(self, text: str, finish_reason: str, tally: Tally) -> dict[str, Any]:
        message = AssistantMessage(role="assistant", content=text)
        choice = ChatChoice(index=0, message=message, logprobs=None, finish_reason=_reason(finish_reason))
        return ChatCompletion(
            **self.fields(), object="chat.completion", choices=[choice], usage=tally.usage()
        ).dump()


def _reason(reason: str | None) -> FinishReason | None:
    """The engine's finish reason as OpenAI's (a cancelled request never gets this far)."""
    if reason is None:
        return None
    return "stop" if reason == "stop" else "length"
