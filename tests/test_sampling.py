"""The sampler does what its parameters say, and a seeded request draws the same tokens whatever
it is batched with.

Distributions are checked by drawing many tokens from fixed logits: the tokens a cut removes never
appear, and the others appear as often as the renormalised softmax says (within a tolerance far
below the differences a wrong temperature, top-k or top-p would make).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from runahead.engine import Engine
from runahead.sampling import Sampler, SamplingParams

from modelhelpers import build_tiny_model

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
DRAWS = 8_000


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    sampler = Sampler(params)
    counts = torch.zeros(len(logits))
    for _ in range(DRAWS):
        counts[sampler.sample(logits)] += 1
    return counts / DRAWS


def expected(logits: torch.Tensor, temperature: float, keep: list[int]) -> torch.Tensor:
    probs = torch.zeros(len(logits))
    probs[keep] = torch.softmax(logits[keep] / temperature, dim=-1)
    return probs


def test_greedy_is_the_argmax_and_a_tiny_temperature_is_greedy() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -5.0])
    for temperature in (0.0, 1e-7):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=1))
        assert {sampler.sample(logits) for _ in range(50)} == {1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_softmax(temperature: float) -> None:
    got = frequencies(SamplingParams(temperature=temperature, seed=3))
    want = expected(LOGITS, temperature, list(range(6)))
    assert torch.allclose(got, want, atol=0.022), (got, want)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_top_k_keeps_the_k_likeliest_in_proportion(top_k: int) -> None:
    got = frequencies(SamplingParams(temperature=1.0, top_k=top_k, seed=4))
    want = expected(LOGITS, 1.0, list(range(top_k)))  # LOGITS are sorted, likeliest first
    assert torch.allclose(got, want, atol=0.022), (got, want)
    assert got[top_k:].sum() == 0


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float) -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    before = torch.cumsum(probs, dim=0) - probs  # LOGITS are sorted: cumulative mass before each
    keep = [i for i in range(6) if before[i] < top_p]
    assert 0 < len(keep) < 6  # each p here cuts something and keeps something
    got = frequencies(SamplingParams(temperature=1.0, top_p=top_p, seed=5))
    assert torch.allclose(got, expected(LOGITS, 1.0, keep), atol=0.022), (got, keep)
    assert got[len(keep) :].sum() == 0


def test_top_k_then_top_p_then_temperature_compose() -> None:
    # temperature 2 flattens; top-k 4 drops the two least likely; top-p 0.7 of what is left
    scaled = torch.softmax(LOGITS[:4] / 2.0, dim=-1)
    before = torch.cumsum(scaled, dim=0) - scaled
    keep = [i for i in range(4) if before[i] < 0.7]
    got = frequencies(SamplingParams(temperature=2.0, top_k=4, top_p=0.7, seed=6))
    assert torch.allclose(got, expected(LOGITS, 2.0, keep), atol=0.022), (got, keep)


def test_a_seed_fixes_the_draws_and_another_seed_changes_them() -> None:
    def draws(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(LOGITS) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("sampling"))


@pytest.mark.parametrize("policy", ["runahead", "sync"])
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_crowd(model: Path, policy: str) -> None:
    """Each request has its own generator, and batch-invariant compute gives it the same logits in
    any group, so its sampled tokens cannot depend on the others (nor on the schedule)."""
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    others = [[9, 3], [100, 2, 7, 7], [33], [61, 62, 63]]

    async def main() -> tuple[list[int], list[int]]:
        async with await Engine.open(
            str(model), cache_fraction=0.34, policy=policy, batch_invariant=True
        ) as engine:
            alone = (await engine.complete([5, 17, 42], seeded)).token_ids
            crowd = [
                engine.complete(p, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
                for i, p in enumerate(others)
            ]
            together, *_ = await asyncio.gather(engine.complete([5, 17, 42], seeded), *crowd)
            return alone, together.token_ids

    alone, together = asyncio.run(main())
    assert alone == together and len(set(alone)) > 1  # sampled (varied), and the same both times
