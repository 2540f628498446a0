"""The server under faults: a failing disk degrades it without stopping it; a dead engine stops it.

A read that fails answers only the requests that needed it, with an error naming the file; the
others and later ones are served, ``/health`` says ``degraded`` with the reason meanwhile and
``ok`` once reads succeed again. An engine that cannot go on stops the server, which says why and
exits non-zero so a supervisor restarts it.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from runahead import cli
from runahead.backends.torch import TorchBackend

from modelhelpers import build_tiny_model, reference_greedy
from serverhelpers import RunningServer, running_server

PROMPT = [5, 17, 42]
TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("server-faults"))
    return path, reference_greedy(path, [PROMPT], TOKENS)[0]


class BadDisk:
    """Every expert read fails with EIO while ``failing`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.failing = inner, True

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor) -> None:
        if self.failing:
            raise OSError(errno.EIO, "Input/output error", "model.safetensors")
        await self.inner.read_into(layer, expert, slot)

    def close(self) -> None:
        self.inner.close()


def complete(server_url: str, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": stream}
    return httpx.post(f"{server_url}/v1/completions", json=body, timeout=60)


def test_a_failing_disk_degrades_the_server_and_it_recovers(model: tuple[Path, list[int]]) -> None:
    path, expected = model
    with running_server(path, cache_fraction=0.25) as server:
        disk: BadDisk = server.call(_wrap_store(server))
        failed = complete(server.url)
        streamed = complete(server.url, stream=True)
        degraded = httpx.get(f"{server.url}/health", timeout=10)
        disk.failing = False
        served = complete(server.url)
        healthy = httpx.get(f"{server.url}/health", timeout=10)
        assert server.wait_until_quiet()

    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "model.safetensors" in error["message"]
    assert "Input/output error" in error["message"] and "reading expert" in error["message"]
    assert streamed.status_code == 200 and "model.safetensors" in streamed.text  # an error event
    assert degraded.status_code == 200
    assert degraded.json()["status"] == "degraded" and "model.safetensors" in degraded.json()["reason"]
    assert served.status_code == 200 and served.json()["choices"][0]["logprobs"] is None
    tokens = _token_ids(path, served.json()["choices"][0]["text"])
    assert tokens == expected[: len(tokens)] and len(tokens) >= 1
    assert healthy.json()["status"] == "ok" and healthy.json()["reads_failed"] >= 2


async def _wrap_store(server: RunningServer) -> BadDisk:
    backend: Any = server.engine.runtime.backend
    backend.store = disk = BadDisk(backend.store)
    return disk


def _token_ids(path: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(path).encode(text))


def test_the_server_exits_non_zero_when_the_engine_stops(
    model: tuple[Path, list[int]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = model

    async def dead(self: TorchBackend, group: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(TorchBackend, "compute", dead)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    box: dict[str, int] = {}
    thread = threading.Thread(
        target=lambda: box.update(
            code=cli.main(["serve", str(path), "--port", str(port), "--model-name", "tiny"])
        ),
        daemon=True,
    )
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    answers = []
    for _ in range(3):  # each request's first group fails; the third failure in a row stops it
        try:
            answers.append(complete(url).status_code)
        except httpx.TransportError:
            break
    thread.join(30)
    assert not thread.is_alive() and box["code"] == 1
    assert answers and all(code in (500, 503) for code in answers)
    err = capsys.readouterr().err
    assert (
        "the engine stopped" in err and "3 groups in a row failed" in err and "illegal memory access" in err
    )
