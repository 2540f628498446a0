"""Who may call the server and how much they may send: ``--api-key`` (Bearer) and the body limit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from runahead.server import ServerConfig

from serverhelpers import RunningServer, build_chat_model, running_server

KEY = "sk-test-1234"
LIMIT = 4096
GOOD = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = build_chat_model(tmp_path_factory.mktemp("guarded-model"))
    config = ServerConfig(api_key=KEY, max_body_bytes=LIMIT)
    with running_server(model, config=config, cache_fraction=0.5) as running:
        yield running


def _client(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_right_key_is_let_through(guarded: RunningServer) -> None:
    with _client(guarded, KEY) as client:
        done = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=2, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 2
        assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_wrong_key_gets_an_openai_401(guarded: RunningServer) -> None:
    with _client(guarded, "sk-wrong") as client, pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model="tiny", prompt="w1", max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert "not valid" in caught.value.message


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "you must provide an API key"),
        ({"Authorization": f"Basic {KEY}"}, "not valid"),
        ({"Authorization": f"Bearer {KEY}x"}, "not valid"),
        ({"Authorization": "Bearer"}, "not valid"),
    ],
    ids=["missing", "basic", "longer", "empty"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"])
def test_every_guarded_path_refuses_without_the_key(guarded, path, headers, message) -> None:  # type: ignore[no-untyped-def]
    method = "GET" if path in ("/v1/models", "/metrics") else "POST"
    response = httpx.request(method, f"{guarded.url}{path}", json=GOOD, headers=headers, timeout=10)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == "invalid_api_key"


def test_health_and_the_schema_stay_open(guarded: RunningServer) -> None:
    assert httpx.get(f"{guarded.url}/health", timeout=10).json()["status"] == "ok"
    document = httpx.get(f"{guarded.url}/openapi.json", timeout=10).json()
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert document["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in document["paths"]["/health"]["get"]


def test_the_lm_eval_harness_header_is_accepted(guarded: RunningServer) -> None:
    # lm-evaluation-harness's TemplateAPI sends {"Authorization": f"Bearer {api_key}"} with requests
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{guarded.url}/v1/completions", json=GOOD, headers=headers, timeout=30)
    assert response.status_code == 200, response.text


def test_a_body_over_the_limit_gets_413(guarded: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({**GOOD, "prompt": "w1 " * LIMIT}).encode()
    response = httpx.post(f"{guarded.url}/v1/completions", content=big, headers=headers, timeout=30)
    assert response.status_code == 413
    error = response.json()["error"]
    assert f"has {len(big)} bytes; this server takes at most {LIMIT}" in error["message"]
    assert error["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_gets_413(guarded: RunningServer) -> None:
    # no Content-Length: the limit is enforced while reading
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}

    def pieces() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMIT // 64 + 2):
            yield b"w1 " * 21 + b" "
        yield b'"}'

    response = httpx.post(f"{guarded.url}/v1/completions", content=pieces(), headers=headers, timeout=30)
    assert response.status_code == 413
    assert "at least" in response.json()["error"]["message"]
    ok = httpx.post(f"{guarded.url}/v1/completions", json=GOOD, headers=headers, timeout=30)
    assert ok.status_code == 200  # the server goes on


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"api_key": " "}, "api_key must not be empty"),
        ({"max_body_bytes": 0}, "max_body_bytes must be >= 1"),
        ({"request_timeout_s": 0}, "request_timeout_s must be > 0"),
    ],
)
def test_server_config_names_a_bad_option(options, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        ServerConfig(**options)


def test_serve_refuses_an_empty_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runahead.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", str(tmp_path), "--api-key", ""])
    assert stopped.value.code == 2
    assert "runahead serve: error: api_key must not be empty" in capsys.readouterr().err
