"""The mlx backend: greedy tokens equal mlx-lm's own decode of the same folder, float32 and 4-bit.

Tiny random models of each architecture the backend runs, saved by transformers (float32) and
converted by ``mlx_lm.convert`` (4-bit, group 32, every expert matrix quantized). Several requests
run at once with a cache far smaller than the model's experts (read from the files with O_DIRECT),
under ``sync``, ``runahead``, ``prefetch-gate`` and a static grouping, with prompts prefilled in
chunks whose experts do not fit the cache at once (waves). Float32 folders must also give
transformers' tokens, and the torch backend's. Skipped where MLX is not installed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from runahead.backends.mlx import MLXBackend
from runahead.engine import Engine
from runahead.models.description import ModelLoadError
from runahead.sampling import SamplingParams

from mlxhelpers import MLX_ARCHS, build_mlx_model, convert, mlx_lm_greedy, run_requests, transformers_greedy

TOKENS = 10
PROMPTS = [(5, 17, 42, 9), (3, 99, 7), (120, 4, 4, 66, 8, 31), (200,)]
SLOTS = 8  # of 3 layers x 8 experts = 24: the deadlock rule's minimum for 4 requests at top-2
POLICIES = ["sync", "runahead", "prefetch-gate", "runahead/grouping=static:2:2"]


@pytest.fixture(scope="module", params=list(MLX_ARCHS))
def folders(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A float32 folder and its 4-bit mlx-lm conversion, with mlx-lm's greedy tokens for each."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    plain = build_mlx_model(arch, root / "f32", quantized=True)
    q4 = convert(plain, root / "q4")
    return {
        "arch": arch,
        "f32": plain,
        "q4": q4,
        "expected": {"f32": mlx_lm_greedy(plain, PROMPTS, TOKENS), "q4": mlx_lm_greedy(q4, PROMPTS, TOKENS)},
    }


def run(path: Path, policy: str, *, chunk: int = 2, store: str = "disk") -> tuple[dict[int, list[int]], Any]:
    backend = MLXBackend.open(str(path), cache_slots=SLOTS, store=store, device="cpu")
    tokens, _ = run_requests(backend, policy, PROMPTS, TOKENS, slots=SLOTS, chunk=chunk)
    return tokens, backend


@pytest.mark.parametrize("kind", ["f32", "q4"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_mlx_lm(folders: dict[str, Any], policy: str, kind: str) -> None:
    tokens, backend = run(folders[kind], policy)
    assert [tokens[i] for i in range(len(PROMPTS))] == folders["expected"][kind]
    assert backend.store.reads > SLOTS  # the cache was too small: experts were evicted and read again
    if kind == "q4":
        assert backend.checkpoint.mlx_format
        assert all(f.quant is not None and f.quant.bits == 4 for f in backend.checkpoint.formats.values())


def test_float32_equals_transformers_and_the_torch_backend(folders: dict[str, Any]) -> None:
    """mlx-lm's tokens (the reference above) are transformers', and the torch backend's are too."""
    from runahead.backends.torch import TorchBackend

    expected = folders["expected"]["f32"]
    assert transformers_greedy(folders["f32"], PROMPTS, TOKENS) == expected
    torch_tokens, _ = run_requests(
        TorchBackend.open(str(folders["f32"]), cache_slots=SLOTS), "runahead", PROMPTS, TOKENS, slots=SLOTS
    )
    mlx_tokens, _ = run(folders["f32"], "runahead")
    assert torch_tokens == mlx_tokens
    assert [mlx_tokens[i] for i in range(len(PROMPTS))] == expected


def test_host_store_and_whole_prompts(folders: dict[str, Any]) -> None:
    tokens, backend = run(folders["q4"], "runahead", chunk=256, store="host")
    assert [tokens[i] for i in range(len(PROMPTS))] == folders["expected"]["q4"]
    assert backend.pools.installs > SLOTS


@pytest.mark.parametrize("folders", ["qwen3_moe"], indirect=True)  # one is enough
@pytest.mark.parametrize("store", ["disk", "host"])
def test_a_capped_link_paces_every_fetch_and_changes_no_token(folders: dict[str, Any], store: str) -> None:
    bandwidth = 20e6  # bytes per second: well below this machine's disk and memory
    backend = MLXBackend.open(
        str(folders["q4"]), cache_slots=SLOTS, store=store, device="cpu", link_bandwidth=bandwidth
    )
    nbytes = {key: sum(p.nbytes for p in pieces) for key, pieces in backend.checkpoint.experts.items()}
    tokens, runtime = run_requests(backend, "runahead", PROMPTS, TOKENS, slots=SLOTS)
    assert [tokens[i] for i in range(len(PROMPTS))] == folders["expected"]["q4"]
    reads = runtime.recorder.fetches
    assert len(reads) > SLOTS
    for read in reads:  # the host store's bytes are in memory already: the link still takes its time
        assert read.end - read.start >= nbytes[read.key.layer, read.key.expert] / bandwidth - 1e-6


@pytest.mark.parametrize("folders", ["qwen3_moe"], indirect=True)  # one is enough
def test_cancellation_through_the_engine_leaves_the_others_exact(folders: dict[str, Any]) -> None:
    expected = folders["expected"]["q4"]

    async def main() -> tuple[list[list[int]], list[int]]:
        async with await Engine.open(
            str(folders["q4"]), backend="mlx", cache_fraction=0.34, policy="runahead", prefill_chunk=2
        ) as engine:

            async def one(i: int, cancel_after: int | None) -> list[int]:
                out: list[int] = []
                async for chunk in engine.generate(list(PROMPTS[i]), SamplingParams(max_tokens=TOKENS)):
                    out.append(chunk.token_id)
                    if cancel_after is not None and len(out) >= cancel_after:
                        break  # leaving the stream cancels the request
                return out

            victim = one(3, 2)
            results = await asyncio.gather(*(one(i, None) for i in range(3)), victim)
            for _ in range(200):
                if not engine.runtime.handles:
                    break
                await asyncio.sleep(0.01)
            assert engine.runtime.cache.pinned_count() == 0
            assert not engine.runtime.backend._requests  # type: ignore[attr-defined]
            return list(results[:3]), results[3]

    others, cut = asyncio.run(main())
    assert others == expected[:3]
    assert cut == expected[3][:2]


@pytest.mark.parametrize("folders", ["qwen3_moe"], indirect=True)  # one is enough
def test_a_quantization_entry_that_does_not_match_its_tensors_is_refused(
    folders: dict[str, Any], tmp_path: Path
) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folders["q4"], bad)
    config = json.loads((bad / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config[key]["bits"] = 8  # the tensors are 4-bit
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"tensor model\.\S+\.weight: expected .*8-bit"):
        MLXBackend.open(str(bad), cache_slots=SLOTS)
    del config["quantization"], config["quantization_config"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"tensor model\.\S+ is quantized .* no quantization"):
        MLXBackend.open(str(bad), cache_slots=SLOTS)


@pytest.mark.parametrize("folders", ["qwen3_moe"], indirect=True)  # one is enough
def test_logprobs_and_seeded_sampling_equal_the_torch_backends(folders: dict[str, Any]) -> None:
    """Log-probs (of sampled and prompt tokens, with their top ones) and seeded sampling through the
    engine: the same as the torch backend's on the same float32 folder."""

    async def collect(backend: str) -> tuple[list[Any], list[int]]:
        async with await Engine.open(
            str(folders["f32"]), backend=backend, cache_fraction=0.34, prefill_chunk=2
        ) as engine:
            scored = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2)
            chunks = [chunk async for chunk in engine.generate(list(PROMPTS[2]), scored)]
            sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7)
            tokens = [chunk.token_id async for chunk in engine.generate(list(PROMPTS[1]), sampled)]
            return chunks, tokens

    torch_chunks, torch_sampled = asyncio.run(collect("torch"))
    mlx_chunks, mlx_sampled = asyncio.run(collect("mlx"))
    assert mlx_sampled == torch_sampled
    assert [c.token_id for c in mlx_chunks] == [c.token_id for c in torch_chunks]
    prompt_mlx, prompt_torch = mlx_chunks[0].prompt_logprobs, torch_chunks[0].prompt_logprobs
    assert len(prompt_mlx) == len(PROMPTS[2]) - 1 == len(prompt_torch)
    pairs = [(c.logprob, t.logprob) for c, t in zip(mlx_chunks, torch_chunks, strict=True)]
    for ours, theirs in [*pairs, *zip(prompt_mlx, prompt_torch, strict=True)]:
        assert ours is not None and theirs is not None
        assert ours.token == theirs.token and abs(ours.logprob - theirs.logprob) < 1e-4
        assert [i for i, _ in ours.top] == [i for i, _ in theirs.top]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(ours.top, theirs.top, strict=True))
