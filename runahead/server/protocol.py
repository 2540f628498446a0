"""Request bodies of the OpenAI API, checked and turned into what the engine takes.

Every check raises :class:`APIError` naming the field and the value, so a client learns what to fix;
nothing here touches the engine's runtime (only its tokenizer and its context length).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runahead.sampling import SamplingParams
from runahead.server.errors import APIError, invalid

if TYPE_CHECKING:
    from runahead.engine import Engine

MAX_STOP_STRINGS = 4
"""OpenAI's limit on ``stop``."""

COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``; chat defaults to the context left."""

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds ``torch.Generator.manual_seed`` takes."""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# Parameters this server does not implement, and the values that mean "not used".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "suffix": ("",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One checked request: the prompt's token ids, sampling, stop strings and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


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
        raise invalid("model", f"model must be a string, got {_show(model)}")
    if model != served:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {served!r}",
            status=404,
            param="model",
            code="model_not_found",
        )


def completion_request(data: Mapping[str, Any], engine: Engine, eos: frozenset[int]) -> GenerationRequest:
    """Check a ``/v1/completions`` body and encode its prompt."""
    _refuse_unsupported(data)
    ids = _encode(engine, _single_prompt(data.get("prompt")), "prompt")
    default = min(COMPLETION_MAX_TOKENS, max(1, engine.context_length - len(ids)))
    return _generation(data, engine, ids, "prompt", default, eos)


def chat_request(data: Mapping[str, Any], engine: Engine, eos: frozenset[int]) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body and render its messages with the chat template."""
    _refuse_unsupported(data)
    messages = _messages(data.get("messages"))
    ids = _render_chat(engine, messages)
    return _generation(data, engine, ids, "messages", max(1, engine.context_length - len(ids)), eos)


# -- shared fields ---------------------------------------------------------------------------------


def _generation(
    data: Mapping[str, Any],
    engine: Engine,
    ids: list[int],
    prompt_field: str,
    default_max_tokens: int,
    eos: frozenset[int],
) -> GenerationRequest:
    context = engine.context_length
    if len(ids) >= context:
        raise invalid(
            prompt_field,
            f"the prompt has {len(ids)} tokens, but the model's context is {context} tokens "
            "(and at least one must be left to generate)",
            "context_length_exceeded",
        )
    name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(data, name, default_max_tokens, minimum=1)
    if len(ids) + max_tokens > context:
        raise invalid(
            name,
            f"{name} {max_tokens} plus the prompt's {len(ids)} tokens exceeds the model's context of "
            f"{context} tokens; ask for at most {context - len(ids)}",
            "context_length_exceeded",
        )
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0, low_open=False),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_integer(data, "top_k", 0, minimum=0),
        seed=_seed(data),
        stop_token_ids=eos,
    )
    stream = _boolean(data, "stream", False)
    return GenerationRequest(ids, params, _stop(data), stream, _include_usage(data, stream))


def _integer(data: Mapping[str, Any], name: str, default: int, *, minimum: int) -> int:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"{name} must be an integer, got {_show(value)}")
    if value < minimum:
        raise invalid(name, f"{name} must be >= {minimum}, got {value}")
    return value


def _number(
    data: Mapping[str, Any], name: str, default: float, low: float, high: float, *, low_open: bool
) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"{name} must be a number, got {_show(value)}")
    if not ((low < value) if low_open else (low <= value)) or not value <= high:
        bracket = "(" if low_open else "["
        raise invalid(name, f"{name} must lie in {bracket}{low:g}, {high:g}], got {value}")
    return float(value)


def _boolean(data: Mapping[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be true or false, got {_show(value)}")
    return value


def _seed(data: Mapping[str, Any]) -> int | None:
    value = data.get("seed")
    if value is None:
        return None
    low, high = SEED_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid("seed", f"seed must be an integer in [{low}, {high}], got {_show(value)}")
    return value


def _stop(data: Mapping[str, Any]) -> tuple[str, ...]:
    value = data.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", f"stop must be a string or a list of strings, got {_show(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return tuple(stops)


def _include_usage(data: Mapping[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", f"stream_options must be an object, got {_show(options)}")
    return _boolean(options, "include_usage", False)


def _refuse_unsupported(data: Mapping[str, Any]) -> None:
    for name, unused in _UNSUPPORTED.items():
        value = data.get(name)
        if value is not None and not any(_same(value, u) for u in unused):
            raise invalid(name, f"{name}={_show(value)} is not supported by this server", "unsupported")


def _same(value: Any, unused: Any) -> bool:
    if isinstance(unused, bool) or isinstance(value, bool):
        return value is unused
    if isinstance(unused, int):  # 0 and 0.0 both mean "no penalty"
        return isinstance(value, int | float) and value == unused
    return type(value) is type(unused) and bool(value == unused)


def _show(value: Any) -> str:
    text = json.dumps(value) if _is_json(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- prompts ---------------------------------------------------------------------------------------


def _single_prompt(prompt: Any) -> str | list[int]:
    """The one prompt of a request: a string, a list of token ids, or a list holding one of those."""
    if prompt is None:
        raise invalid("prompt", "you must provide a prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise invalid("prompt", f"this server takes one prompt per request, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise invalid("prompt", f"prompt must be a string or a list of token ids, got {_show(prompt)}")


def _encode(engine: Engine, prompt: str | Sequence[int], field: str) -> list[int]:
    try:
        return engine.encode(prompt)
    except ValueError as error:
        raise invalid(field, str(error)) from None


def _messages(value: Any) -> list[dict[str, str]]:
    """Chat messages as ``{"role", "content"}`` with text content (parts of type text are joined)."""
    if value is None:
        raise invalid("messages", "you must provide messages")
    if not isinstance(value, list) or not value:
        raise invalid("messages", f"messages must be a non-empty list, got {_show(value)}")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(where, f"{where} must be an object, got {_show(message)}")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}, got {_show(role)}")
    return {"role": role, "content": _content(f"{where}.content", message.get("content"))}


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)  # type: ignore[arg-type]
        raise invalid(where, f"{where}: only text content parts are supported, got {_show(content)}")
    raise invalid(where, f"{where} must be a string or a list of text parts, got {_show(content)}")


def _render_chat(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the messages through the tokenizer's chat template, ending in the reply prompt."""
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
