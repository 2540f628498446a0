"""The engine API: concurrent generations from many tasks, streaming, cancellation, bad input."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.engine import Engine
from runahead.health import RequestFailed
from runahead.sampling import SamplingParams

from modelhelpers import build_tiny_model

PROMPTS = ["w5 w17 w42", "w9 w3", "w100 w2 w7 w7", "w33", "w1 w2 w3 w4 w5 w6 w7", "w60 w61"]
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[int]]]:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("engine"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    expected = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=TOKENS,
                min_new_tokens=TOKENS,
                do_sample=False,
            )
            expected[prompt] = out[0, ids.shape[1] :].tolist()
    return path, expected


def loops() -> list[Callable[[], asyncio.AbstractEventLoop]]:
    factories: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]
    try:
        import uvloop

        factories.append(uvloop.new_event_loop)
    except ImportError:  # uvloop is optional
        pass
    return factories


def run(
    factory: Callable[[], asyncio.AbstractEventLoop], main: Callable[[], Coroutine[Any, Any, Any]]
) -> Any:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


@pytest.mark.parametrize("loop", loops(), ids=lambda f: f.__module__.split(".")[0])
def test_many_tasks_generate_at_once_and_get_transformers_tokens(model, loop) -> None:  # type: ignore[no-untyped-def]
    path, expected = model
    params = SamplingParams(max_tokens=TOKENS)

    async def main() -> tuple[list[Any], list[list[int]]]:
        async with await Engine.open(str(path), cache_fraction=0.34) as engine:
            completions = await asyncio.gather(*(engine.complete(p, params) for p in PROMPTS))
            streamed = [[chunk.token_id async for chunk in engine.generate(PROMPTS[0], params)]]
            assert engine.runtime.cache.is_idle()
            return completions, streamed

    completions, streamed = run(loop, main)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert completion.token_ids == expected[prompt]
        assert completion.finish_reason == "length" and completion.prompt_tokens == len(prompt.split())
    assert streamed[0] == expected[PROMPTS[0]]


def test_streamed_text_adds_up_to_the_completion(model) -> None:  # type: ignore[no-untyped-def]
    path, _ = model

    async def main() -> tuple[list[Any], Any]:
        async with await Engine.open(str(path)) as engine:
            chunks = [c async for c in engine.generate([5, 17, 42], SamplingParams(max_tokens=8))]
            done = await engine.complete([5, 17, 42], SamplingParams(max_tokens=8))
            return chunks, done

    chunks, done = asyncio.run(main())
    assert [c.token_id for c in chunks] == done.token_ids
    assert "".join(c.text for c in chunks).strip() == done.text.strip()
    assert [c.index for c in chunks] == list(range(8))
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_cancelling_the_consumer_frees_the_request_at_once(model) -> None:  # type: ignore[no-untyped-def]
    path, expected = model

    async def main() -> tuple[list[int], list[int], bool, int]:
        async with await Engine.open(str(path), cache_fraction=0.34) as engine:
            got: list[int] = []

            async def consume() -> None:
                async for chunk in engine.generate(PROMPTS[1], SamplingParams(max_tokens=200)):
                    got.append(chunk.token_id)

            other = asyncio.create_task(engine.complete(PROMPTS[0], SamplingParams(max_tokens=TOKENS)))
            task = asyncio.create_task(consume())
            while len(got) < 3:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            finished = await other
            await asyncio.sleep(0.05)  # let the actors settle
            open_requests = len(engine.runtime.backend._requests)  # type: ignore[attr-defined]
            return got, finished.token_ids, engine.runtime.cache.is_idle(), open_requests

    got, other, idle, open_requests = asyncio.run(main())
    assert 3 <= len(got) < 200
    assert other == expected[PROMPTS[0]]  # the cancellation did not disturb the other request
    assert idle and open_requests == 0


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "the prompt is empty"),
        ([5, 300], SamplingParams(), r"outside the vocabulary \[0, 256\)"),
        ([5] * 500, SamplingParams(max_tokens=20), "exceeds the model's context of 512 tokens"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(model, prompt, params, message) -> None:  # type: ignore[no-untyped-def]
    path, expected = model

    async def main() -> list[int]:
        async with await Engine.open(str(path)) as engine:
            with pytest.raises(ValueError, match=message):
                await engine.complete(prompt, params)
            return (await engine.complete(PROMPTS[3], SamplingParams(max_tokens=TOKENS))).token_ids

    assert asyncio.run(main()) == expected[PROMPTS[3]]  # the engine still serves after a bad request


def test_bad_sampling_values_are_named() -> None:
    with pytest.raises(ValueError, match="top_p must lie in"):
        SamplingParams(top_p=1.5)


def test_closing_the_engine_ends_every_running_stream_with_a_clear_error(model) -> None:  # type: ignore[no-untyped-def]
    path, _ = model

    async def main() -> tuple[list[BaseException | None], dict[str, object]]:
        engine = await Engine.open(str(path), cache_fraction=0.34)
        started = asyncio.Event()

        async def consume(prompt: str) -> None:
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=200)):
                started.set()

        tasks = [asyncio.create_task(consume(p)) for p in PROMPTS[:3]]
        await started.wait()
        await asyncio.wait_for(engine.close(), 30)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        with pytest.raises(RequestFailed, match="the engine is closed"):
            await engine.complete(PROMPTS[0], SamplingParams(max_tokens=2))
        return list(outcomes), engine.health()

    outcomes, health = asyncio.run(main())
    assert all(isinstance(o, RequestFailed) and "the engine was closed" in str(o) for o in outcomes), outcomes
    assert health["status"] == "failed" and health["reason"] == "the engine is closed"
