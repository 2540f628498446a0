"""Request bodies of the OpenAI API as pydantic models: what the server checks and documents.

The models are strict (``"9"`` is not an integer, ``1`` is not ``true``) and ignore fields they do
not know, as OpenAI's clients send a few more than any server implements. A field whose accepted
shapes a JSON type cannot say alone (a prompt, stop strings, message content) is checked by a
``before`` validator that names the field and the value, so every refusal stays precise;
:func:`runahead.server.protocol.validation_error` turns pydantic's errors into OpenAI errors.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runahead.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 4
"""OpenAI's limit on ``stop``."""

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds ``torch.Generator.manual_seed`` takes."""

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

MAX_CHOICES = 64
"""The most answers one request may ask for: prompts times ``n``."""

# Parameters this server does not implement, and the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
}


def show(value: Any) -> str:
    """A value as a client wrote it (JSON), cut to 60 characters, for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class Body(BaseModel):
    """Strict fields; unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Body):
    include_usage: bool | None = Field(None, description="Send a last chunk with the request's usage.")


class Sampling(Body):
    """The fields both generation endpoints share."""

    model: str = Field(description="The served model's name (see `GET /v1/models`).")
    max_tokens: Annotated[int | None, Field(ge=1)] = Field(
        None, description="Tokens to generate at most; prompt + max_tokens must fit the model's context."
    )
    temperature: Annotated[float | None, Field(ge=0, le=2)] = Field(
        None, description="0 is greedy; default 1."
    )
    top_p: Annotated[float | None, Field(gt=0, le=1)] = Field(None, description="Nucleus sampling mass.")
    top_k: Annotated[int | None, Field(ge=0)] = Field(None, description="Keep the k likeliest (0: all).")
    seed: Annotated[int | None, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] = Field(
        None, description="Seeds the request's own generator: same seed, same tokens."
    )
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty strings; the text ends before the first."
    )
    stream: bool | None = Field(None, description="Answer as server-sent events.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(
        None, description="Go on past the end-of-sequence token (vLLM's extension; for benchmarks)."
    )
    user: str | None = None
    n: Annotated[int | None, Field(ge=1, le=MAX_CHOICES)] = Field(
        None, description="Answers per prompt; with `seed`, answer i samples with seed + i."
    )
    presence_penalty: Any = Field(None, description="Not supported: only 0.")
    frequency_penalty: Any = Field(None, description="Not supported: only 0.")
    logit_bias: Any = Field(None, description="Not supported: only {}.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return value
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop must be a string or a list of strings, got {show(value)}")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value


class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A string or a list of token ids, or a list of those (one answer each, in order)."
    )
    echo: bool | None = Field(None, description="Put the prompt before the answer (and its logprobs).")
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = Field(
        None, description="Report each token's logprob and this many likeliest alternatives."
    )
    best_of: Annotated[int | None, Field(ge=1)] = Field(None, description="Only n (or unset) is supported.")
    suffix: Any = Field(None, description='Not supported: only "".')

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any) -> Any:
        batch = isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt)
        for one in prompt if batch else [prompt]:
            if not isinstance(one, str) and not _is_token_ids(one):
                raise ValueError(
                    f"prompt must be a string or a list of token ids, or a list of those; got {show(prompt)}"
                )
        if batch and len(prompt) > MAX_CHOICES:
            raise ValueError(f"prompt takes at most {MAX_CHOICES} prompts, got {len(prompt)}")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)
        return [prompt]  # type: ignore[list-item]


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Role
    content: str | list[TextPart] = Field(description="Text, or a list of text parts (joined).")

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, content: Any) -> Any:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            if all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                return content
            raise ValueError(f"must hold text parts only, got {show(content)}")
        raise ValueError(f"must be a string or a list of text parts, got {show(content)}")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = Field(
        None, description="The newer name of max_tokens; wins when both are given."
    )
    logprobs: bool | None = Field(None, description="Report each generated token's logprob.")
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = Field(
        None, description="With logprobs: this many likeliest alternatives per token."
    )
    tools: Any = Field(None, description="Not supported: only [].")
    functions: Any = Field(None, description="Not supported: only [].")

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError(f"messages must be a non-empty list, got {show(value)}")
        return value
