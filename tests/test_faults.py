"""Faults on the real backend: a failed read hurts only the requests that needed that expert.

A tiny model's experts are read from its safetensors file through the engine. Faults are injected
the way a disk produces them: a store wrapper that fails chosen reads (EIO, a short read, a lost
permission), and the model file truncated and restored while the engine serves. The requests that
need a failing expert get an error naming it and the file; every other request gets
transformers' tokens; the engine keeps serving, says ``degraded`` meanwhile and ``ok`` after.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.engine import Engine
from runahead.health import RequestFailed
from runahead.jobs import ExpertKey
from runahead.sampling import SamplingParams

from modelhelpers import build_tiny_model, reference_greedy

PROMPTS = [[5, 17, 42], [9, 3, 11, 80], [100, 2, 7, 7], [33, 34], [61, 62, 63], [120, 4]]
TOKENS = 8
EXPERTS = 16
PARAMS = SamplingParams(max_tokens=TOKENS)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[set[ExpertKey]]]:
    """A saved tiny model, transformers' greedy tokens per prompt, and the experts each one routes to."""
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("faults"), num_experts=EXPERTS)
    from transformers import AutoModelForCausalLM

    tokens = reference_greedy(path, PROMPTS, TOKENS)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    top_k = reference.config.num_experts_per_tok
    used = []
    with torch.no_grad():
        for prompt, continuation in zip(PROMPTS, tokens, strict=True):
            routed = reference(torch.tensor([prompt + continuation[:-1]]), output_router_logits=True)
            used.append(
                {
                    ExpertKey(layer, int(e))
                    for layer, logits in enumerate(routed.router_logits)
                    for e in logits.topk(top_k, dim=-1).indices.flatten()
                }
            )
    return path, tokens, used


class FailingStore:
    """Wraps the engine's expert store; reads of ``bad`` raise ``error()`` while ``failing``."""

    def __init__(self, inner: Any, bad: ExpertKey, error: Any) -> None:
        self.inner, self.bad, self.error = inner, bad, error
        self.failing = True
        self.failed = 0

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor) -> None:
        if self.failing and ExpertKey(layer, expert) == self.bad:
            self.failed += 1
            raise self.error()
        await self.inner.read_into(layer, expert, slot)

    def close(self) -> None:
        self.inner.close()


def expert_used_by_few(used: list[set[ExpertKey]]) -> ExpertKey:
    """An expert some prompts route to and others never do."""
    counts: dict[ExpertKey, int] = {}
    for keys in used:
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
    return min((k for k, n in counts.items() if n <= len(used) // 2), key=lambda k: (-counts[k], k))


async def outcomes(engine: Engine) -> list[list[int] | RequestFailed]:
    async def one(prompt: list[int]) -> list[int] | RequestFailed:
        try:
            return (await engine.complete(prompt, PARAMS)).token_ids
        except RequestFailed as error:
            return error

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


FAULTS = {
    "eio": lambda: OSError(errno.EIO, "Input/output error", "model.safetensors"),
    "short-read": lambda: ValueError("model.safetensors: file is truncated: expected bytes 10..20"),
    "permission": lambda: PermissionError(errno.EACCES, "Permission denied", "model.safetensors"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failing_expert_fails_only_its_users_and_the_engine_recovers(model, fault: str) -> None:  # type: ignore[no-untyped-def]
    path, expected, used = model
    bad = expert_used_by_few(used)
    users = {i for i, keys in enumerate(used) if bad in keys}
    assert 0 < len(users) < len(PROMPTS)

    async def main() -> tuple[list[Any], dict[str, object], list[Any], dict[str, object], int]:
        async with await Engine.open(str(path), cache_fraction=0.25) as engine:
            backend: Any = engine.runtime.backend
            store = backend.store = FailingStore(backend.store, bad, FAULTS[fault])
            first = await outcomes(engine)
            degraded = engine.health()
            store.failing = False  # the disk is fine again
            second = await outcomes(engine)
            await asyncio.sleep(0.01)
            return first, degraded, second, engine.health(), engine.runtime.cache.pinned_count()

    first, degraded, second, healthy, pinned = asyncio.run(main())
    for i, outcome in enumerate(first):
        if i in users:
            assert isinstance(outcome, RequestFailed), (i, outcome)
            assert f"reading expert {bad.expert} of layer {bad.layer} failed" in str(outcome)
            assert "model.safetensors" in str(outcome)
        else:
            assert outcome == expected[i], i  # the others are untouched
    assert degraded["status"] == "degraded" and f"expert {bad.expert} of layer {bad.layer}" in str(
        degraded["reason"]
    )
    assert second == expected  # the expert is read again once the disk recovers
    assert healthy["status"] == "ok" and pinned == 0


def test_a_model_file_truncated_and_restored_while_serving(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source, expected, _ = model
    path = tmp_path / "model"
    shutil.copytree(source, path)
    weights = path / "model.safetensors"
    original = weights.read_bytes()

    async def main() -> tuple[list[int], Any, dict[str, object], list[int], dict[str, object]]:
        async with await Engine.open(str(path), cache_fraction=0.25) as engine:
            before = (await engine.complete(PROMPTS[0], PARAMS)).token_ids
            layout = engine.runtime.backend.store.layout  # type: ignore[attr-defined]
            first_expert = min(r.offset for ranges in layout.ranges.values() for r in ranges)
            os.truncate(weights, first_expert)  # every expert's bytes are gone
            try:
                await engine.complete(PROMPTS[1], PARAMS)
                during: Any = None
            except RequestFailed as error:
                during = error
            degraded = engine.health()
            weights.write_bytes(original)  # restored in place
            after = (await engine.complete(PROMPTS[1], PARAMS)).token_ids
            return before, during, degraded, after, engine.health()

    before, during, degraded, after, healthy = asyncio.run(main())
    assert before == expected[0]
    assert isinstance(during, RequestFailed)
    assert "model.safetensors" in str(during) and "truncated" in str(during)
    assert degraded["status"] == "degraded"
    assert after == expected[1] and healthy["status"] == "ok"


def test_a_model_file_replaced_under_the_engine_is_not_read(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The store keeps the files it opened: a file renamed over the model's (an update, an
    accident) changes nothing until the engine is reopened, rather than mixing two models."""
    source, expected, _ = model
    path = tmp_path / "model"
    shutil.copytree(source, path)

    async def main() -> list[list[int]]:
        async with await Engine.open(str(path), cache_fraction=0.25) as engine:
            garbage = path / "other.safetensors"
            garbage.write_bytes(os.urandom((path / "model.safetensors").stat().st_size))
            os.replace(garbage, path / "model.safetensors")
            return [(await engine.complete(p, PARAMS)).token_ids for p in PROMPTS[:3]]

    assert asyncio.run(main()) == expected[:3]


def test_closing_the_store_under_running_streams_ends_them_with_a_clear_error(model) -> None:  # type: ignore[no-untyped-def]
    """The store closed while reads are in flight (a bug in an embedding app, say): the reads in
    flight finish, later ones are refused, and every stream ends with an error saying so."""
    path, _, _ = model

    async def main() -> list[BaseException | None]:
        async with await Engine.open(str(path), cache_fraction=0.25) as engine:
            started = asyncio.Event()

            async def consume(prompt: list[int]) -> None:
                async for _ in engine.generate(prompt, SamplingParams(max_tokens=200)):
                    started.set()

            tasks = [asyncio.create_task(consume(p)) for p in PROMPTS[:4]]
            await started.wait()
            await asyncio.to_thread(engine.runtime.backend.store.close)  # type: ignore[attr-defined]
            return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60))

    outcomes = asyncio.run(main())
    assert all(isinstance(o, RequestFailed) for o in outcomes), outcomes
    assert all("expert store is closed" in str(o) for o in outcomes), outcomes
