"""The JSON of each endpoint's answers and chunks, built from the response models.

A request's answers are numbered by ``index`` (prompt times ``n``, OpenAI's order). Logprobs come
in OpenAI's two shapes: the legacy completions lists (``tokens``, ``token_logprobs``,
``top_logprobs`` as {token: logprob}, ``text_offset``) and chat's ``content`` entries. A token's
``text_offset`` is the summed length of the token strings before it, as vLLM counts it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runahead.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    TokenLogprob,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from runahead.server.generation import Tally


@dataclass(frozen=True, slots=True)
class Scored:
    """One token's logprob as text: ``logprob`` and ``top`` are None for an echoed first prompt token."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] | None


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of answer ``index`` and the logprobs of its tokens; ``finish_reason`` on the last."""

    index: int
    text: str
    scored: tuple[Scored, ...] = ()
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """One whole answer."""

    index: int
    text: str
    finish_reason: str
    scored: tuple[Scored, ...]


class ResponseShape:
    """The id, timestamp and models of one answer; subclasses give each endpoint's fields.

    ``logprobs``: whether the request asked for them (then every choice carries a logprobs object).
    """

    prefix = "cmpl"

    def __init__(self, model: str, *, logprobs: bool = False) -> None:
        self.model = model
        self.logprobs = logprobs
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def fields(self) -> dict[str, Any]:
        """The fields every answer and chunk carries around its choices."""
        return {"id": self.id, "created": self.created, "model": self.model}

    def opening(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Chunks sent before the first token."""
        return []

    def chunk(self, delta: Delta) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        raise NotImplementedError

    def response(self, answers: Sequence[Answer], tally: Tally) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    """``/v1/completions``: choices carry ``text``."""

    def __init__(self, model: str, *, logprobs: bool = False) -> None:
        super().__init__(model, logprobs=logprobs)
        self.offsets: dict[int, int] = {}  # per answer: token text already streamed (text_offset)

    def chunk(self, delta: Delta) -> dict[str, Any]:
        start = self.offsets.get(delta.index, 0)
        self.offsets[delta.index] = start + sum(len(s.token) for s in delta.scored)
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(delta.scored, start),
            finish_reason=_reason(delta.finish_reason),
        )
        return Completion(**self.fields(), object="text_completion", choices=[choice]).dump()

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return Completion(**self.fields(), object="text_completion", choices=[], usage=usage).dump()

    def response(self, answers: Sequence[Answer], tally: Tally) -> dict[str, Any]:
        choices = [
            CompletionChoice(
                index=a.index,
                text=a.text,
                logprobs=self._logprobs(a.scored, 0),
                finish_reason=_reason(a.finish_reason),
            )
            for a in sorted(answers, key=lambda a: a.index)
        ]
        usage = tally.usage()
        return Completion(**self.fields(), object="text_completion", choices=choices, usage=usage).dump()

    def _logprobs(self, scored: Sequence[Scored], start: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        offsets = []
        for entry in scored:
            offsets.append(start)
            start += len(entry.token)
        return CompletionLogprobs(
            tokens=[s.token for s in scored],
            token_logprobs=[s.logprob for s in scored],
            top_logprobs=[_top_dict(s) for s in scored],
            text_offset=offsets,
        )


def _top_dict(entry: Scored) -> dict[str, float] | None:
    """The alternatives as {token: logprob}, with the chosen token's own among them (as vLLM does)."""
    if entry.top is None or entry.logprob is None:
        return None
    top = dict(entry.top)
    top.setdefault(entry.token, entry.logprob)
    return top


class ChatShape(ResponseShape):
    """``/v1/chat/completions``: a ``message`` whole, or ``delta`` chunks after a role chunk."""

    prefix = "chatcmpl"

    def opening(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self._chunk(i, ChatDelta(role="assistant", content=""), (), None) for i in indices]

    def chunk(self, delta: Delta) -> dict[str, Any]:
        content = ChatDelta(content=delta.text) if delta.text else ChatDelta()
        return self._chunk(delta.index, content, delta.scored, delta.finish_reason)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return ChatCompletionChunk(
            **self.fields(), object="chat.completion.chunk", choices=[], usage=usage
        ).dump()

    def _chunk(
        self, index: int, delta: ChatDelta, scored: Sequence[Scored], finish_reason: str | None
    ) -> dict[str, Any]:
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(scored) if scored else None,
            finish_reason=_reason(finish_reason),
        )
        return ChatCompletionChunk(**self.fields(), object="chat.completion.chunk", choices=[choice]).dump()

    def response(self, answers: Sequence[Answer], tally: Tally) -> dict[str, Any]:
        choices = [
            ChatChoice(
                index=a.index,
                message=AssistantMessage(role="assistant", content=a.text),
                logprobs=self._logprobs(a.scored),
                finish_reason=_reason(a.finish_reason),
            )
            for a in sorted(answers, key=lambda a: a.index)
        ]
        usage = tally.usage()
        return ChatCompletion(**self.fields(), object="chat.completion", choices=choices, usage=usage).dump()

    def _logprobs(self, scored: Sequence[Scored]) -> ChatLogprobs | None:
        if not self.logprobs:
            return None
        content = [
            TokenLogprob(
                token=s.token,
                logprob=s.logprob or 0.0,
                bytes=list(s.token.encode()),
                top_logprobs=[
                    TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in (s.top or ())
                ],
            )
            for s in scored
        ]
        return ChatLogprobs(content=content)


def _reason(reason: str | None) -> FinishReason | None:
    """The engine's finish reason as OpenAI's (a cancelled request never gets this far)."""
    if reason is None:
        return None
    return "stop" if reason == "stop" else "length"
