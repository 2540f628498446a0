"""Log-probabilities through the engine, judged by transformers' log-softmax on the same tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runahead.engine import Engine
from runahead.sampling import MAX_LOGPROBS, SamplingParams

from modelhelpers import build_tiny_model, reference_logits

PROMPT = [5, 17, 42, 9, 3, 100, 7]
TOKENS = 4
TOP = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("logprobs-model"))


@pytest.mark.parametrize("prefill_chunk", [3, 256], ids=["chunked", "whole"])
async def test_prompt_and_token_logprobs_are_transformers_log_softmax(
    model: Path, prefill_chunk: int
) -> None:
    params = SamplingParams(max_tokens=TOKENS, logprobs=TOP, prompt_logprobs=TOP)
    async with await Engine.open(str(model), cache_fraction=0.5, prefill_chunk=prefill_chunk) as engine:
        chunks = [chunk async for chunk in engine.generate(PROMPT, params)]
    generated = [c.token_id for c in chunks]
    expected = torch.log_softmax(reference_logits(model, PROMPT + generated).float(), dim=-1)
    # prompt token i (i >= 1) is scored by the row before it; generated token j by row len(PROMPT)-1+j
    scored = list(chunks[0].prompt_logprobs) + [c.logprob for c in chunks]
    assert [s.token for s in scored if s is not None] == PROMPT[1:] + generated
    assert all(not c.prompt_logprobs for c in chunks[1:])
    for row, entry in enumerate(scored):
        assert entry is not None
        assert entry.logprob == pytest.approx(expected[row, entry.token].item(), abs=2e-4)
        values, ids = torch.topk(expected[row], TOP)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=2e-4)
    for chunk in chunks:  # greedy: each token is its row's likeliest, with exactly the top value
        assert chunk.logprob is not None and chunk.logprob.logprob == chunk.logprob.top[0][1]


async def test_logprobs_are_off_unless_asked(model: Path) -> None:
    async with await Engine.open(str(model), cache_fraction=0.5) as engine:
        chunks = [c async for c in engine.generate(PROMPT, SamplingParams(max_tokens=2))]
        zero = [c async for c in engine.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=0))]
    assert all(c.logprob is None and not c.prompt_logprobs for c in chunks)
    assert all(c.logprob is not None and c.logprob.top == () for c in zero)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprob_counts_are_checked(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must lie in \[0, {MAX_LOGPROBS}\], got 21"):
        SamplingParams(**{name: MAX_LOGPROBS + 1})  # type: ignore[arg-type]
