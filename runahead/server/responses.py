"""Response bodies of the OpenAI API as pydantic models: what the server sends and documents.

Answers are built from these models and dumped with ``exclude_unset``, so a field appears exactly
when the code sets it (``"logprobs": null`` is always set; a chat delta carries only what changed).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length"]


class Out(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The JSON object to send: only the fields that were set."""
        return self.model_dump(mode="json", exclude_unset=True)


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Out):
    """The legacy completions shape: parallel lists, one entry per token (the first prompt token of
    an ``echo`` has no logprob: ``null``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Out):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionChoice(Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(Out):
    """A ``/v1/completions`` answer, or one of its streamed chunks (the same shape)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Out):
    """Every refusal: ``{"error": {message, type, param, code}}``, as OpenAI sends it."""

    error: ErrorDetail


class ModelCard(Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Out):
    status: Literal["ok", "degraded", "failed"] = Field(
        description="ok: the engine serves; degraded: it serves, but expert reads or computes are "
        "failing now (reason says which, only the requests needing them fail); failed: it stopped."
    )
    reason: str | None = Field(default=None, description="Why it is not ok.")
    failing_experts: int | None = Field(default=None, description="Experts whose last read failed.")
    reads_failed: int = Field(description="Expert reads given up after their retries, since start.")
    reads_retried: int
    groups_failed: int
    requests_failed: int
