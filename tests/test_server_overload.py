"""Overload: a bounded admission queue (429 with Retry-After), a per-request time limit (504), and no
state left behind per finished request, in the server or anywhere in the engine."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runahead.engine import Engine, EngineOverloaded
from runahead.sampling import SamplingParams
from runahead.server import ServerConfig

from modelhelpers import build_tiny_model
from serverhelpers import RunningServer, build_chat_model, running_server

LONG = {"model": "tiny", "prompt": "w5 w17", "max_tokens": 400, "ignore_eos": True, "stream": True}
SHORT = {"model": "tiny", "prompt": "w5 w17", "max_tokens": 2, "temperature": 0}
CACHE = 0.17  # 4 of the 24 experts cached: 2 requests run at once (top-2)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("overload-model"))


@pytest.fixture(scope="module")
def busy(chat_model: Path) -> Iterator[RunningServer]:
    with running_server(chat_model, cache_fraction=CACHE, max_waiting=1) as running:
        yield running


def _room(server: RunningServer) -> int:
    async def read() -> int:
        return server.engine.room()

    return int(server.call(read()))


def _open_streams(server: RunningServer, stack: ExitStack, count: int) -> None:
    """Open ``count`` long streams (held by the engine once their headers came: the handler queues
    a request before it answers); leaving ``stack`` drops them."""
    http = stack.enter_context(httpx.Client(base_url=server.url, timeout=60))
    for _ in range(count):
        response = stack.enter_context(http.stream("POST", "/v1/completions", json=LONG))
        assert response.status_code == 200


def test_requests_beyond_max_waiting_get_429_with_retry_after(busy: RunningServer) -> None:
    capacity = busy.engine.capacity
    assert (busy.engine.runtime.max_active, capacity) == (2, 3)
    with ExitStack() as stack:
        _open_streams(busy, stack, capacity)
        assert _room(busy) == 0
        refused = httpx.post(f"{busy.url}/v1/completions", json=SHORT, timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and "retry later" in error["message"]
        with (
            openai.OpenAI(base_url=f"{busy.url}/v1", api_key="x", max_retries=0, timeout=30) as client,
            pytest.raises(openai.RateLimitError),
        ):
            client.completions.create(model="tiny", prompt="w1", max_tokens=2)
        assert _room(busy) == 0  # the refusals queued nothing
    assert busy.wait_until_quiet(timeout=30)  # leaving the streams cancelled them
    assert _room(busy) == capacity
    assert httpx.post(f"{busy.url}/v1/completions", json=SHORT, timeout=30).status_code == 200


def test_answers_of_one_request_are_admitted_all_or_none(busy: RunningServer) -> None:
    with ExitStack() as stack:
        _open_streams(busy, stack, 1)
        assert _room(busy) == 2
        refused = httpx.post(f"{busy.url}/v1/completions", json={**SHORT, "n": 3}, timeout=30)
        assert (
            refused.status_code == 429
            and "3 answer(s) asked, room for 2" in refused.json()["error"]["message"]
        )
        assert _room(busy) == 2  # nothing of it was queued
        done = httpx.post(f"{busy.url}/v1/completions", json={**SHORT, "n": 2}, timeout=60)
        assert done.status_code == 200 and len(done.json()["choices"]) == 2
    too_many = httpx.post(f"{busy.url}/v1/completions", json={**SHORT, "n": 4}, timeout=30)
    assert too_many.status_code == 400
    assert "holds at most 3 requests at once" in too_many.json()["error"]["message"]


def test_a_request_past_the_time_limit_gets_504(chat_model: Path) -> None:
    config = ServerConfig(request_timeout_s=0.3)
    with running_server(chat_model, config=config, cache_fraction=0.5) as server:
        whole = httpx.post(f"{server.url}/v1/completions", json={**LONG, "stream": False}, timeout=30)
        assert whole.status_code == 504, whole.text
        assert (
            whole.json()["error"]["code"] == "timeout"
            and "time limit of 0.3 s" in whole.json()["error"]["message"]
        )
        streamed = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=30)
        events = [
            line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
        assert server.wait_until_quiet(timeout=10)
        assert httpx.post(f"{server.url}/v1/completions", json=SHORT, timeout=30).status_code == 200


async def test_the_engine_refuses_beyond_its_capacity_without_queueing(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3_moe", tmp_path)
    params = SamplingParams(max_tokens=300)
    async with await Engine.open(str(model), cache_fraction=CACHE, max_waiting=2) as engine:
        held = [engine.submit([5, 6], params) for _ in range(engine.capacity)]
        assert engine.room() == 0 and engine.capacity == 4
        with pytest.raises(EngineOverloaded, match=r"4 requests are running or waiting.*max_waiting 2"):
            engine.submit([5, 6], params)
        assert len(engine.runtime.handles) == 4
        for generation in held:
            generation.cancel()
        for _ in range(200):
            if engine.room() == 4:
                break
            await asyncio.sleep(0.01)
        assert engine.room() == 4
    with pytest.raises(ValueError, match="max_waiting must be >= 0, got -1"):
        await Engine.open(str(model), cache_fraction=CACHE, max_waiting=-1)


# -- nothing kept per finished request -------------------------------------------------------------


def _sizes(roots: dict[str, Any], depth: int = 4) -> dict[str, int]:
    """The length of every container reachable from ``roots`` through runahead objects' attributes."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()

    def walk(path: str, value: Any, level: int) -> None:
        if id(value) in seen or level > depth:
            return
        seen.add(id(value))
        if getattr(value, "maxlen", None) is not None:
            return  # a deque with a bound (the mode chooser's log of windows) cannot grow past it
        if isinstance(value, dict | list | set | frozenset | tuple) or type(value).__name__ in (
            "deque",
            "Queue",
        ):
            sizes[path] = value.qsize() if hasattr(value, "qsize") else len(value)
            return
        if not type(value).__module__.startswith("runahead"):
            return
        names = list(getattr(value, "__dict__", {}))
        names += [n for cls in type(value).__mro__ for n in getattr(cls, "__slots__", ())]
        for name in names:
            if hasattr(value, name):
                walk(f"{path}.{name}", getattr(value, name), level + 1)

    for name, root in roots.items():
        walk(name, root, 0)
    return sizes


def _engine_objects(server: RunningServer) -> dict[str, Any]:
    """The engine, its actors (the runtime keeps no reference to them) and the app's own objects."""
    from runahead.actors import ComputeScheduler, ExpertFetcher, JobIssuer
    from runahead.server.app import OpenAIRoutes
    from runahead.server.logs import AccessLog

    engine = server.engine
    roots: dict[str, Any] = {"engine": engine}
    for kind in (JobIssuer, ExpertFetcher, ComputeScheduler, OpenAIRoutes, AccessLog):
        # type(), not isinstance(): isinstance reads ``__class__``, which some objects the collector
        # holds compute (a deprecated torch alias warns when looked at)
        found = [o for o in gc.get_objects() if issubclass(type(o), kind) and _serves(o, engine)]
        assert len(found) == 1, kind
        roots[kind.__name__] = found[0]
    metrics = roots["AccessLog"].metrics
    for name in ("requests", "duration"):  # prometheus children, one per label set
        roots[f"metrics.{name}"] = getattr(metrics, name)._metrics
    return roots


def _serves(thing: Any, engine: Engine) -> bool:
    """Whether an actor, route table or access log found by the garbage collector is this engine's."""
    if hasattr(thing, "cache"):
        return thing.cache is engine.runtime.cache
    if hasattr(thing, "engine"):
        return thing.engine is engine
    collectors = thing.metrics.registry._collector_to_names
    return any(getattr(c, "engine", None) is engine for c in collectors)


def _traffic(server: RunningServer, rounds: int) -> None:
    """Every way a request ends: whole, streamed, n > 1, stop string, refused, bad, abandoned."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for i in range(rounds):
            assert http.post("/v1/completions", json={**SHORT, "prompt": f"w{i + 5} w9"}).status_code == 200
            assert (
                http.post("/v1/completions", json={**SHORT, "n": 2, "seed": i, "temperature": 1}).status_code
                == 200
            )
            body = {**SHORT, "stream": True, "logprobs": 2, "stream_options": {"include_usage": True}}
            assert http.post("/v1/completions", json=body).text.endswith("data: [DONE]\n\n")
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 3}
            assert http.post("/v1/chat/completions", json={**chat, "stop": "w"}).status_code == 200
            assert http.post("/v1/completions", json={**SHORT, "top_p": 7}).status_code == 400
            with http.stream("POST", "/v1/completions", json=LONG) as response:
                next(response.iter_lines())  # and leave
    assert server.wait_until_quiet(timeout=30)


def test_nothing_is_kept_per_finished_request(busy: RunningServer) -> None:
    _traffic(busy, 1)  # warm up: every code path has run, the cache has seen its experts
    before = _sizes(_engine_objects(busy))
    _traffic(busy, 2)
    after = _sizes(_engine_objects(busy))
    grown = {path: (before.get(path, 0), size) for path, size in after.items() if size > before.get(path, 0)}
    # only the cache's per-expert bookkeeping may still grow, up to one entry per expert of the model
    experts = busy.engine.runtime.backend.num_layers * 8
    per_expert = ("engine.runtime.cache.", "engine.runtime.health.failing", "ExpertFetcher.hints.")
    unbounded = {
        path: sizes for path, sizes in grown.items() if not path.startswith(per_expert) or sizes[1] > experts
    }
    assert not unbounded, unbounded
    reached = {path.split(".")[0] for path in after}  # the actors', cache's, backend's, server's state
    assert reached >= {"engine", "JobIssuer", "ExpertFetcher", "ComputeScheduler", "metrics"}, reached
    assert len(after) > 35
