"""The OpenAI-compatible server, end to end: a real uvicorn on 127.0.0.1, real clients (openai, httpx)."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runahead.engine import Completion
from runahead.server.generation import StopMatcher

from modelhelpers import build_tiny_model, reference_greedy
from serverhelpers import RunningServer, build_chat_model, running_server
from serverrequests import BAD_REQUESTS, GOOD, GOOD_CHAT

PROMPTS = ["w5 w17 w42", "w9 w3", "w100 w2 w7 w7", "w33"]
CHAT: list[Any] = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w5 w6 w7"}]
TOKENS = 6
LONG = 500  # tokens asked of a request the client abandons: far more than it waits for (context 512)
EOS = 2


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[RunningServer]:
    with running_server(chat_model, cache_fraction=0.5) as running:
        yield running


@pytest.fixture(scope="module")
def references(server: RunningServer, chat_model: Path) -> dict[str, Any]:
    """transformers' own greedy output (the judge, not the engine) for every prompt and the chat."""
    tokenizer = server.engine.tokenizer
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if isinstance(chat_ids, Mapping) else chat_ids)

    prompt_ids = [list(tokenizer.encode(p)) for p in PROMPTS] + [chat_ids]
    answers = []
    for ids, tokens in zip(
        prompt_ids, reference_greedy(chat_model, prompt_ids, TOKENS, eos=EOS), strict=True
    ):
        reason = "stop" if tokens[-1] == EOS else "length"
        answers.append(
            Completion(tokens, tokenizer.decode(tokens, skip_special_tokens=True), reason, len(ids))
        )
    *completions, chat = answers
    return {"prompts": dict(zip(PROMPTS, completions, strict=True)), "chat": chat, "chat_ids": chat_ids}


@pytest.fixture()
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as sync:
        yield sync


def sse_payloads(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, checking the framing exactly; ``[DONE]`` must end it."""
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events), events
    assert events[-1] == "data: [DONE]" and "data: [DONE]" not in events[:-1]
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


# -- answers ---------------------------------------------------------------------------------------


def test_health_and_models(server: RunningServer, client: openai.OpenAI) -> None:
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.object == "list"


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_greedy_completion_is_the_engines_output(client, references, as_ids) -> None:  # type: ignore[no-untyped-def]
    prompt = PROMPTS[0]
    expected = references["prompts"][prompt]
    sent: Any = [int(word[1:]) + 3 for word in prompt.split()] if as_ids else prompt
    done = client.completions.create(model="tiny", prompt=sent, max_tokens=TOKENS, temperature=0)
    assert done.choices[0].text == expected.text
    assert done.choices[0].finish_reason == expected.finish_reason
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, len(expected.token_ids))
    assert done.usage.total_tokens == 3 + len(expected.token_ids)


def test_streamed_completion_adds_up_with_usage(client, references) -> None:  # type: ignore[no-untyped-def]
    expected = references["prompts"][PROMPTS[2]]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[2],
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *with_text, last = chunks
    assert "".join(c.choices[0].text for c in with_text) == expected.text
    assert [c.choices[0].finish_reason for c in with_text][-1] == expected.finish_reason
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, len(expected.token_ids))


def test_chat_completion_uses_the_template_and_matches_the_engine(client, references) -> None:  # type: ignore[no-untyped-def]
    # system w1 w2, user w5 w6 w7, then the assistant's turn: role words w250/w251/w252, </s> = 2
    assert references["chat_ids"] == [253, 4, 5, 2, 254, 8, 9, 10, 2, 255]
    expected = references["chat"]
    done = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=TOKENS, temperature=0)
    assert done.choices[0].message.content == expected.text
    assert done.choices[0].message.role == "assistant" and done.object == "chat.completion"
    assert done.usage is not None and done.usage.prompt_tokens == 10
    assert done.usage.completion_tokens == len(expected.token_ids)


def test_streamed_chat_framing_is_exact(server: RunningServer, references) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": CHAT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" and p["model"] == "tiny" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1
    reasons = [p["choices"][0]["finish_reason"] for p in payloads]
    assert reasons[-1] == references["chat"].finish_reason and set(reasons[:-1]) == {None}
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    assert text == references["chat"].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_cut_the_text_openai_style(client, references, stream) -> None:  # type: ignore[no-untyped-def]
    full = references["prompts"][PROMPTS[0]].text
    words = full.split(" ")
    stop = f"{words[2][-1]} {words[3][:2]}"  # spans two tokens' text
    expected = full[: full.find(stop)]
    args: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": TOKENS, "temperature": 0}
    if stream:
        chunks = list(client.completions.create(**args, stop=["zzz", stop], stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        done = client.completions.create(**args, stop=stop)
        text, reason = done.choices[0].text, done.choices[0].finish_reason
    assert (text, reason) == (expected, "stop")


@pytest.mark.parametrize(
    ("pieces", "stops", "shown", "stopped"),
    [
        (["ab", "c"], ["x"], ["ab", "c"], False),
        (["a", "b STO", "P!"], ["STOP"], ["a", "b ", ""], True),
        (["STX", "Y"], ["STOP"], ["STX", "Y"], False),
        (["ST", "X"], ["STOP"], ["", "STX"], False),
        (["hello wor", "ld"], ["o w", "ld"], ["hell"], True),
        (["aab"], ["ab"], ["a"], True),
    ],
)
def test_stop_matcher_holds_back_only_what_may_begin_a_stop(pieces, stops, shown, stopped) -> None:  # type: ignore[no-untyped-def]
    matcher = StopMatcher(stops)
    out: list[str] = []
    hit = False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            break
    assert (out, hit) == (shown, stopped)


async def test_many_concurrent_clients_get_the_engines_outputs(server: RunningServer, references) -> None:  # type: ignore[no-untyped-def]
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as aio:

        async def complete(prompt: str, stream: bool) -> str:
            args: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
            if not stream:
                return str((await aio.completions.create(**args)).choices[0].text)
            return "".join(
                [c.choices[0].text async for c in await aio.completions.create(**args, stream=True)]
            )

        async def chat() -> str | None:
            done = await aio.chat.completions.create(
                model="tiny", messages=CHAT, max_tokens=TOKENS, temperature=0
            )
            return done.choices[0].message.content

        jobs = [complete(p, stream) for p in PROMPTS[:3] for stream in (False, True)] + [chat(), chat()]
        got = await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)
    expected = [references["prompts"][p].text for p in PROMPTS[:3] for _ in range(2)]
    expected += [references["chat"].text] * 2
    assert got == expected


# -- disconnects -----------------------------------------------------------------------------------


def _tokens_generated(server: RunningServer) -> int:
    async def read() -> int:
        return int(server.engine.stats()["tokens_generated"])

    return int(server.call(read()))


def test_a_client_leaving_mid_stream_cancels_its_request(server, client, references) -> None:  # type: ignore[no-untyped-def]
    generated = _tokens_generated(server)
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(
            client.completions.create, model="tiny", prompt=PROMPTS[3], max_tokens=TOKENS, temperature=0
        )
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events >= 3:
                    break  # leaving the blocks drops the connection mid-stream
        assert other.result(timeout=60).choices[0].text == references["prompts"][PROMPTS[3]].text
    assert server.wait_until_quiet(timeout=10)
    assert _tokens_generated(server) - generated < LONG  # cut short, not run to its end


def test_a_client_leaving_a_whole_answer_cancels_it(server: RunningServer) -> None:
    generated = _tokens_generated(server)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0}
    with (
        httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.25)) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/completions", json=body)
    assert server.wait_until_quiet(timeout=10)
    assert _tokens_generated(server) - generated < LONG  # cut short, not run to its end
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'runahead_http_requests_total{endpoint="/v1/completions",status="499"}' in metrics


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "status", "message", "param"), BAD_REQUESTS)
def test_bad_requests_get_precise_openai_errors(server, path, body, status, message, param) -> None:  # type: ignore[no-untyped-def]
    response = _post_raw(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


def _post_raw(server: RunningServer, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


def test_bad_requests_leave_a_running_stream_alone(server, client, references) -> None:  # type: ignore[no-untyped-def]
    expected = references["prompts"][PROMPTS[2]].text
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=TOKENS, temperature=0, stream=True
    )
    parts = [next(iter(stream)).choices[0].text]
    for path, body, status, *_ in BAD_REQUESTS:
        assert _post_raw(server, path, body).status_code == status
    parts += [chunk.choices[0].text for chunk in stream]
    assert "".join(parts) == expected


def test_the_openai_client_sees_the_error_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="w1", max_tokens=600)
    assert caught.value.status_code == 400 and caught.value.code == "context_length_exceeded"
    assert caught.value.param == "max_tokens" and "model's context of 512" in caught.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="other", prompt="w1", max_tokens=2)
    assert missing.value.code == "model_not_found"


def test_unknown_routes_and_methods_answer_in_json(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/v1/nothing").json()["error"]["message"] == "Not Found: GET /v1/nothing"
        wrong = http.get("/v1/completions")
        assert wrong.status_code == 405 and "Method Not Allowed" in wrong.json()["error"]["message"]


def test_a_tokenizer_without_chat_template_is_named(tmp_path: Path) -> None:
    with running_server(build_tiny_model("qwen3_moe", tmp_path)) as plain:
        response = httpx.post(f"{plain.url}/v1/chat/completions", json=GOOD_CHAT, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "has no chat template" in error["message"] and error["code"] == "no_chat_template"


# -- metrics ---------------------------------------------------------------------------------------

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? [-+0-9.eE]+$')


def _samples(text: str) -> dict[str, float]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    bad = [line for line in lines if not SAMPLE.match(line)]
    assert not bad, bad
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


def test_metrics_parse_as_prometheus_text_and_count_requests(server: RunningServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    ok = 'runahead_http_requests_total{endpoint="/v1/completions",status="200"}'
    refused = 'runahead_http_requests_total{endpoint="/v1/completions",status="400"}'
    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = _samples(http.get("/metrics").text)
        for _ in range(3):
            assert http.post("/v1/completions", json={**GOOD, "max_tokens": 1}).status_code == 200
        assert http.post("/v1/completions", json={**GOOD, "top_p": 2}).status_code == 400
        response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = _samples(response.text)
    list(text_string_to_metric_families(response.text))  # the reference parser accepts it
    assert after[ok] - before.get(ok, 0) == 3 and after[refused] - before.get(refused, 0) == 1
    assert after["runahead_completion_tokens_total"] - before["runahead_completion_tokens_total"] == 3
    assert after["runahead_engine_tokens_generated_total"] >= after["runahead_completion_tokens_total"]
    for name in ("cache_hits", "cache_misses", "cache_fetches", "cache_evictions", "compute_busy_seconds"):
        assert f"runahead_engine_{name}_total" in after
    assert after["runahead_engine_requests_active"] == 0 and after["runahead_http_requests_active"] == 1


# -- serve() ---------------------------------------------------------------------------------------


def _lines(stream: Any, into: queue.Queue[str]) -> None:
    for line in stream:
        into.put(line)


def _wait_for(lines: queue.Queue[str], seen: list[str], pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"no line matched {pattern!r} in {timeout} s: {seen}")


def test_serve_runs_until_sigint_and_logs_json(chat_model: Path) -> None:
    script = (
        "import asyncio, sys\nfrom runahead.server import serve\n"
        "try:\n    asyncio.run(serve(sys.argv[1], port=0, model_name='tiny', log_json=True,"
        " dtype='float32'))\n"
        "except KeyboardInterrupt:\n    pass\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(chat_model)], stderr=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=_lines, args=(process.stderr, lines), daemon=True).start()
    try:
        port = _wait_for(lines, seen, r"Uvicorn running on http://127\.0\.0\.1:(\d+)", 60).group(1)
        done = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=GOOD, timeout=30)
        # dtype pinned: auto's timing race, run beside a busy test suite, is not what this test is about
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2, done.text
        _wait_for(lines, seen, r'"event": "request"', 10)
        process.send_signal(signal.SIGINT)
        _wait_for(lines, seen, r'"event": "engine closed"', 30)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    records = [json.loads(line) for line in seen if line.startswith("{")]
    request = next(r for r in records if r["event"] == "request")
    assert request["status"] == 200 and request["tokens"] == 2 and request["path"] == "/v1/completions"
    assert request["method"] == "POST" and request["duration_ms"] > 0 and request["level"] == "info"


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"top_p": 5e-324}, {"top_p": 1e-9, "top_k": 1}])
def test_extreme_sampling_values_are_served(server: RunningServer, extreme: dict[str, float]) -> None:
    # found by the schema fuzzer: a subnormal temperature or top_p once made the sampler's
    # probabilities NaN, which stopped the engine for everyone
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, **extreme}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=30).status_code == 200
