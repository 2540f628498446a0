"""Bad requests to the OpenAI-compatible server and the error each must get: ``(path, body, status,
message, param)``, ``message`` a part of the error's text and ``param`` its ``param`` field. The server's
tests post every one (alone, and beside a running stream that must not notice)."""

from __future__ import annotations

from typing import Any

GOOD = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 2}
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}


BAD_REQUESTS: list[tuple[str, Any, int, str, str | None]] = [
    ("/v1/completions", b"{not json", 400, "the request body is not valid JSON", None),
    ("/v1/completions", [1, 2], 400, "the request body must be a JSON object, got list", None),
    ("/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "the model 'gpt-9' does not exist", "model"),
    ("/v1/completions", {"prompt": "w1"}, 400, "you must provide a model parameter", "model"),
    ("/v1/completions", {"model": "tiny"}, 400, "you must provide a prompt", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": 7}, 400, "prompt must be a string or a list of token", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "the prompt is empty", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["w1", 5]}, 400, "or a list of those; got", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["w1"] * 65}, 400, "at most 64 prompts, got 65", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["w1 w2", ""]}, 400, "the prompt is empty", "prompt"),
    (
        "/v1/completions",
        {**GOOD, "prompt": ["w1", "w1 " * 512]},
        400,
        "the prompt[1] has 512 tokens",
        "prompt",
    ),
    ("/v1/completions", {**GOOD, "prompt": [5, 300]}, 400, "outside the vocabulary [0, 256)", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "w1 " * 600}, 400, "the prompt has 600 tokens", "prompt"),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens must be >= 1, got -1", "max_tokens"),
    (
        "/v1/completions",
        {**GOOD, "max_tokens": "9"},
        400,
        'max_tokens must be an integer, got "9"',
        "max_tokens",
    ),
    (
        "/v1/completions",
        {**GOOD, "max_tokens": 10**9},
        400,
        "exceeds the model's context of 512",
        "max_tokens",
    ),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature must lie in [0, 2]", "temperature"),
    ("/v1/completions", {**GOOD, "temperature": 2.5}, 400, "temperature must lie in [0, 2]", "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p must lie in (0, 1], got 0", "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p must lie in (0, 1], got 1.5", "top_p"),
    ("/v1/completions", {**GOOD, "seed": "x"}, 400, "seed must be an integer", "seed"),
    ("/v1/completions", {**GOOD, "stop": 5}, 400, "stop must be a string or a list of strings", "stop"),
    ("/v1/completions", {**GOOD, "stop": list("abcde")}, 400, "stop takes at most 4 strings", "stop"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, 'stream must be true or false, got "yes"', "stream"),
    (
        "/v1/completions",
        {**GOOD, "stream_options": {}},
        400,
        "only allowed when stream is true",
        "stream_options",
    ),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n must lie in [1, 64], got 0", "n"),
    ("/v1/completions", {**GOOD, "prompt": ["w1"] * 8, "n": 9}, 400, "asks for 72 answers; at most 64", "n"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs must lie in [0, 20], got 21", "logprobs"),
    ("/v1/completions", {**GOOD, "logprobs": True}, 400, "logprobs must be an integer, got true", "logprobs"),
    ("/v1/completions", {**GOOD, "echo": 1}, 400, "echo must be true or false, got 1", "echo"),
    ("/v1/completions", {**GOOD, "best_of": 3}, 400, "best_of must equal n (1)", "best_of"),
    ("/v1/completions", {**GOOD, "suffix": "x"}, 400, 'suffix="x" is not supported', "suffix"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "you must provide messages", "messages"),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": []},
        400,
        "messages must be a non-empty list",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "robot", "content": "w1"}]},
        400,
        "messages[0].role must be one of",
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content must be a string or a list of text parts",
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "top_logprobs": 2},
        400,
        "top_logprobs needs logprobs set to true",
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs must lie in [0, 20], got 21",
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "max_tokens": 600},
        400,
        "exceeds the model's context",
        "max_tokens",
    ),
]
