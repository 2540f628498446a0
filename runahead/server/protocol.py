"""Request bodies of the OpenAI API, checked and turned into what the engine takes.

Every check raises :class:`APIError` naming the field and the value, so a client learns what to fix;
nothing here touches the engine's runtime (only its tokenizer and its context length).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from runahead.sampling import SamplingParams
from runahead.server.errors import APIError, invalid
from runahead.server.schema import (
    MAX_CHOICES,
    SEED_RANGE,
    UNSUPPORTED,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Sampling,
    show,
)

if TYPE_CHECKING:
    from runahead.engine import Engine

M = TypeVar("M", bound=BaseModel)

COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``; chat defaults to the context left."""

_MISSING = {"model": "a model parameter", "prompt": "a prompt", "messages": "messages"}
_TYPES = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


@dataclass(frozen=True, slots=True)
class Choice:
    """One answer of a request: its index, prompt (ids, and text for ``echo``) and sampling."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One checked request: its answers (prompts times ``n``), stop strings and how to answer.

    ``logprobs`` is how many alternatives to report per token (None: no logprobs); ``echo`` puts
    each prompt (and, with ``logprobs``, its tokens' logprobs) before its answer.
    """

    choices: list[Choice]
    prompt_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    echo: bool = False


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why it is not one."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid(None, f"the request body is not valid JSON: {error}", "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(None, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def check_model(data: Mapping[str, Any], served: str) -> None:
    """Refuse a request without ``model`` (400) or for a model this server does not serve (404)."""
    model = data.get("model")
    if model is None:
        raise invalid("model", "you must provide a model parameter")
    if not isinstance(model, str):
        raise invalid("model", f"model must be a string, got {show(model)}")
    if model != served:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {served!r}",
            status=404,
            param="model",
            code="model_not_found",
        )


def validate(model: type[M], data: Mapping[str, Any]) -> M:
    """``data`` as ``model``, or a 400 naming the first field that is wrong and its value."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(model, error.errors()[0]) from None


def validation_error(model: type[BaseModel], error: ErrorDetails) -> APIError:
    """One pydantic error as an OpenAI error: ``param`` is the field's path, the message names it."""
    path = _path(error["loc"])
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "missing":
        message = f"you must provide {_MISSING.get(path, path)}"
    elif kind == "value_error":
        reason = str(ctx.get("error", error["msg"]))
        message = f"{path} {reason}" if reason.startswith("must ") else reason
    elif kind in _TYPES:
        message = f"{path} must be {_TYPES[kind]}, got {show(value)}"
    elif kind == "literal_error":
        message = f"{path} must be one of {ctx.get('expected')}, got {show(value)}"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        message = f"{path} must {_bounds(model, path)}, got {show(value)}"
    elif kind == "too_short":
        message = f"{path} must have at least {ctx.get('min_length')} items, got {show(value)}"
    else:
        message = f"{path}: {error['msg']}, got {show(value)}"
    return invalid(path or None, message)


def _path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def _bounds(model: type[BaseModel], path: str) -> str:
    """A field's range as a client reads it: ``lie in (0, 1]`` or ``be >= 1``."""
    field = model.model_fields.get(path)
    limits = {
        type(m).__name__: getattr(m, type(m).__name__.lower())
        for m in (field.metadata if field else [])
        if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")
    }
    low = limits.get("Ge", limits.get("Gt"))
    high = limits.get("Le", limits.get("Lt"))
    if low is None or high is None:
        return f"be >= {low}" if low is not None else f"be <= {high}"
    left = "[" if "Ge" in limits else "("
    right = "]" if "Le" in limits else ")"
    return f"lie in {left}{low}, {high}{right}"


def completion_request(data: Mapping[str, Any], engine: Engine, eos: frozenset[int]) -> GenerationRequest:
    """Check a ``/v1/completions`` body and encode its prompts."""
    body = validate(CompletionRequest, data)
    _refuse_unsupported(data)
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise invalid(
            "best_of", f"best_of must equal n ({n}) on this server, got {body.best_of}", "unsupported"
        )
    prompts = body.prompts()
    _check_choices(len(prompts), n)
    encoded = [_encode(engine, prompt, "prompt") for prompt in prompts]
    texts = [p if isinstance(p, str) else engine.decode(ids) for p, ids in zip(prompts, encoded, strict=True)]
    default = min(COMPLETION_MAX_TOKENS, max(1, engine.context_length - max(map(len, encoded))))
    asked = ("max_tokens", body.max_tokens or default)
    logprobs = body.logprobs
    echo = bool(body.echo)
    prompt_logprobs = logprobs if echo else None
    return _generation(body, engine, encoded, texts, "prompt", asked, eos, logprobs, prompt_logprobs, echo)


def chat_request(data: Mapping[str, Any], engine: Engine, eos: frozenset[int]) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body and render its messages with the chat template."""
    body = validate(ChatRequest, data)
    _refuse_unsupported(data)
    _check_choices(1, body.n or 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    ids = _render_chat(engine, body.messages)
    default = max(1, engine.context_length - len(ids))
    asked = ("max_completion_tokens", body.max_completion_tokens)
    if body.max_completion_tokens is None:
        asked = ("max_tokens", body.max_tokens or default)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _generation(body, engine, [ids], [""], "messages", asked, eos, logprobs, None, False)


def _check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise invalid(
            "n", f"{prompts} prompts times n={n} asks for {prompts * n} answers; at most {MAX_CHOICES}"
        )


# -- shared fields ---------------------------------------------------------------------------------


def _generation(
    body: Sampling,
    engine: Engine,
    prompts: list[list[int]],
    texts: list[str],
    prompt_field: str,
    asked: tuple[str, int | None],
    eos: frozenset[int],
    logprobs: int | None,
    prompt_logprobs: int | None,
    echo: bool,
) -> GenerationRequest:
    """The engine's requests; ``asked`` is the max-tokens field the client used and its value."""
    context = engine.context_length
    name, max_tokens = asked
    assert max_tokens is not None
    for i, ids in enumerate(prompts):
        where = prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]"
        if len(ids) >= context:
            raise invalid(
                prompt_field,
                f"the {where} has {len(ids)} tokens, but the model's context is {context} tokens "
                "(and at least one must be left to generate)",
                "context_length_exceeded",
            )
        if len(ids) + max_tokens > context:
            raise invalid(
                name,
                f"{name} {max_tokens} plus the {where}'s {len(ids)} tokens exceeds the model's context of "
                f"{context} tokens; ask for at most {context - len(ids)}",
                "context_length_exceeded",
            )
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    n = body.n or 1
    choices = []
    for p, (ids, text) in enumerate(zip(prompts, texts, strict=True)):
        for j in range(n):
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=_nth_seed(body.seed, j),
                stop_token_ids=frozenset() if body.ignore_eos else eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            choices.append(Choice(p * n + j, ids, text, params))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    total = sum(map(len, prompts))
    return GenerationRequest(choices, total, stop, stream, include_usage, logprobs, echo)


def _nth_seed(seed: int | None, n: int) -> int | None:
    """The seed of answer ``n``: ``seed + n`` (``seed - n`` at the top of the range)."""
    if seed is None:
        return None
    return seed + n if seed + n <= SEED_RANGE[1] else seed - n


def _refuse_unsupported(data: Mapping[str, Any]) -> None:
    for name, unused in UNSUPPORTED.items():
        value = data.get(name)
        if value is not None and not any(_same(value, u) for u in unused):
            raise invalid(name, f"{name}={show(value)} is not supported by this server", "unsupported")


def _same(value: Any, unused: Any) -> bool:
    if isinstance(unused, bool) or isinstance(value, bool):
        return value is unused
    if isinstance(unused, int):  # 0 and 0.0 both mean "no penalty"
        return isinstance(value, int | float) and value == unused
    return type(value) is type(unused) and bool(value == unused)


# -- prompts ---------------------------------------------------------------------------------------


def _encode(engine: Engine, prompt: str | Sequence[int], field: str) -> list[int]:
    try:
        return engine.encode(prompt)
    except ValueError as error:
        raise invalid(field, str(error)) from None


def _render_chat(engine: Engine, chat: list[ChatMessage]) -> list[int]:
    """Token ids of the messages through the tokenizer's chat template, ending in the reply prompt."""
    messages = [{"role": m.role, "content": m.text()} for m in chat]
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise invalid(
            "messages", "this model has no tokenizer, so it cannot take chat messages", "no_tokenizer"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise invalid(
            "messages",
            "this model's tokenizer has no chat template, so chat messages cannot be turned into a "
            "prompt; use /v1/completions with a prompt instead",
            "no_chat_template",
        )
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as error:  # a template may raise on what it does not accept
        raise invalid("messages", f"the chat template could not render these messages: {error}") from None
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered  # transformers 5: a dict
    return _encode(engine, [int(t) for t in ids], "messages")
