"""Cancellation on the real-time torch backend: at any moment, with reads queued, in flight or done.

The sim's virtual time orders events one way; on real time a cancellation can land between the
JobIssuer releasing a blocked job's pins and the ExpertFetcher hearing of it, while a link worker
picks that job's next read. These tests make that moment happen on purpose (a store whose reads
wait at a gate after their bytes landed) and at random (many rounds of random cancels through the
Engine), and check that nothing crashes, the other requests get transformers' tokens, and every
pin, KV cache and queue entry is released.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.backends.torch import TorchBackend
from runahead.engine import Engine
from runahead.jobs import RequestSpec
from runahead.loops import loop_factory
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams

from modelhelpers import build_tiny_model, float32_expert_bytes, reference_greedy

PROMPTS = [(5, 17, 42), (9, 3), (100, 2, 7, 7), (33,)]
TOKENS = 10
EXPERTS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("cancel"), num_experts=EXPERTS)
    return path, reference_greedy(path, PROMPTS, TOKENS)


class GatedStore:
    """An expert store whose reads land their bytes, then wait at ``gate`` before reporting.

    While the gate is shut the link is busy and the demand queue fills up; opening it in the same
    breath as a cancellation lets the link workers choose their next read before the fetcher has
    read the cancellation's notice: the interleaving real time produces by chance.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.landed = 0

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor) -> None:
        await self.inner.read_into(layer, expert, slot)
        self.landed += 1
        await self.gate.wait()

    def close(self) -> None:
        self.inner.close()


def spec(request: int) -> RequestSpec:
    return RequestSpec(request, TOKENS, prompt=PROMPTS[request], sampling=SamplingParams(max_tokens=TOKENS))


async def _until(condition: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.0005)


@pytest.mark.parametrize("moment", ["before-reads", "reads-queued", "after-first-token"])
@pytest.mark.parametrize("requests", [1, 3])
@pytest.mark.parametrize("depth", [1, 2])
def test_cancel_with_reads_queued_in_flight_or_done(model, moment: str, requests: int, depth: int) -> None:  # type: ignore[no-untyped-def]
    path, expected = model
    slots = 2 * requests + 2  # the deadlock rule's minimum, plus a little: most experts miss
    backend = TorchBackend.open(str(path), cache_slots=slots, store="disk")
    store = backend.store = GatedStore(backend.store)
    runtime = Runtime(backend, RuntimeConfig(cache_slots=slots, link_queue_depth=depth))

    async def main() -> list[tuple[list[int], bool]]:
        async with runtime:
            handles = runtime.submit(*(spec(r) for r in range(requests)))
            victim = handles[-1]
            if moment == "before-reads":
                store.gate.set()
                victim.cancel()
            elif moment == "reads-queued":
                # every link worker holds a landed read; more reads wait in the demand queue
                await _until(lambda: store.landed >= depth)
                victim.cancel()
                store.gate.set()  # the workers pick their next reads before the fetcher's Forget
            else:
                store.gate.set()
                await _until(lambda: len(victim.tokens) >= 1)
                victim.cancel()
            return [(await h.result(), h.cancelled) for h in handles]

    try:
        results = asyncio.run(main())
    finally:
        backend.close()
    *others, (victim_tokens, cancelled) = results
    for request, (tokens, was_cancelled) in enumerate(others):
        assert tokens == expected[request] and not was_cancelled
    assert victim_tokens == expected[requests - 1][: len(victim_tokens)]
    assert cancelled and len(victim_tokens) < TOKENS
    assert runtime.cache.is_idle() and runtime.cache.pinned_count() == 0
    assert not backend._requests  # every KV cache freed


@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "link-capped"])
def test_random_cancellations_through_the_engine_never_hurt_the_others(model, capped: bool) -> None:  # type: ignore[no-untyped-def]
    """Many rounds on one engine: random requests, random cancel times, random victims. Link-capped:
    every read is held on its reader thread until its link time (~1-2 ms) has passed (so cancels land
    while reads wait there), on the loop the server runs (uvloop where installed)."""
    path, expected = model
    rng = random.Random(1234)
    rounds = 30
    link_bandwidth = float32_expert_bytes(path) / 0.002 if capped else None

    async def round_(engine: Engine) -> tuple[int, int]:
        count = rng.randint(1, len(PROMPTS))
        chosen = rng.sample(range(len(PROMPTS)), count)
        lengths = {p: rng.randint(1, TOKENS) for p in chosen}
        got: dict[int, list[int]] = {p: [] for p in chosen}

        async def consume(p: int) -> None:
            async for chunk in engine.generate(list(PROMPTS[p]), SamplingParams(max_tokens=lengths[p])):
                got[p].append(chunk.token_id)

        tasks = {p: asyncio.create_task(consume(p)) for p in chosen}
        victims = rng.sample(chosen, rng.randint(1, count))
        await asyncio.sleep(rng.choice([0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.03)]))
        for p in victims:
            tasks[p].cancel()
        outcomes = await asyncio.gather(*tasks.values(), return_exceptions=True)
        for p, outcome in zip(tasks, outcomes, strict=True):
            assert outcome is None or isinstance(outcome, asyncio.CancelledError), outcome
            assert got[p] == expected[p][: len(got[p])]
            if p not in victims:
                assert outcome is None and len(got[p]) == lengths[p]
        await _until(lambda: not engine.runtime.handles and not engine.runtime.backend._requests)  # type: ignore[attr-defined]
        assert engine.runtime.cache.pinned_count() == 0
        return len(victims), sum(len(got[p]) < lengths[p] for p in victims)

    async def main() -> list[tuple[int, int]]:
        async with await Engine.open(
            str(path), cache_fraction=0.2, policy="runahead", link_bandwidth=link_bandwidth
        ) as engine:
            return [await round_(engine) for _ in range(rounds)]

    with asyncio.Runner(loop_factory=loop_factory() if capped else None) as runner:
        stats = runner.run(main())
    cut_short = sum(short for _, short in stats)
    assert cut_short >= rounds // 3, stats  # most cancellations really landed mid-generation
