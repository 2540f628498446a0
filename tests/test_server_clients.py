"""What clients send: logprobs, echo, n, seed, stream_options, batches of prompts.

Through the real ``openai`` client and the exact request shapes lm-evaluation-harness's
``local-completions`` / ``local-chat-completions`` models send (written out from its
``openai_completions.py``), against transformers' own greedy tokens and log-softmax on the same model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from serverhelpers import RunningServer, build_chat_model, running_server

CHAT: list[Any] = [{"role": "user", "content": "w5 w6 w7"}]
CONTEXT = [8, 20, 45, 12]  # "w5 w17 w42 w9"
CONTINUATIONS = [[6, 103], [10]]
EOS = 2


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("clients-model"))


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[RunningServer]:
    with running_server(chat_model, cache_fraction=0.5) as running:
        yield running


@pytest.fixture(scope="module")
def reference(chat_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture()
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as sync:
        yield sync


def log_softmax(reference: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at every position of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def greedy(reference: Any, ids: list[int], count: int) -> list[int]:
    """transformers' greedy continuation, stopping after EOS."""
    out: list[int] = []
    for _ in range(count):
        token = int(log_softmax(reference, ids + out)[-1].argmax())
        out.append(token)
        if token == EOS:
            break
    return out


def text_of(server: RunningServer, ids: list[int]) -> str:
    return str(server.engine.tokenizer.decode(ids, skip_special_tokens=True))


def token_of(server: RunningServer, token: int) -> str:
    return str(server.engine.tokenizer.decode([token]))


# -- logprobs --------------------------------------------------------------------------------------


def test_completion_logprobs_are_transformers_log_softmax(server, client, reference) -> None:  # type: ignore[no-untyped-def]
    done = client.completions.create(model="tiny", prompt=CONTEXT, max_tokens=5, temperature=0, logprobs=3)
    generated = greedy(reference, CONTEXT, 5)
    expected = log_softmax(reference, CONTEXT + generated)
    choice = done.choices[0]
    assert choice.text == text_of(server, generated)
    lp = choice.logprobs
    assert lp is not None and lp.tokens == [token_of(server, t) for t in generated]
    for j, token in enumerate(generated):
        row = expected[len(CONTEXT) - 1 + j]
        assert lp.token_logprobs[j] == pytest.approx(row[token].item(), abs=2e-4)
        values, ids = torch.topk(row, 3)
        top = lp.top_logprobs[j]
        assert {token_of(server, i) for i in ids.tolist()} <= set(top)
        for i, value in zip(ids.tolist(), values.tolist(), strict=True):
            assert top[token_of(server, i)] == pytest.approx(value, abs=2e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]


def test_chat_logprobs_are_transformers_log_softmax(server, client, reference) -> None:  # type: ignore[no-untyped-def]
    done = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    ids = server.engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    generated = greedy(reference, ids, 4)
    expected = log_softmax(reference, ids + generated)
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [c.token for c in content] == [token_of(server, t) for t in generated]
    for j, (entry, token) in enumerate(zip(content, generated, strict=True)):
        row = expected[len(ids) - 1 + j]
        assert entry.logprob == pytest.approx(row[token].item(), abs=2e-4)
        assert entry.bytes == list(entry.token.encode())
        values, top_ids = torch.topk(row, 2)
        assert [t.token for t in entry.top_logprobs] == [token_of(server, i) for i in top_ids.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=2e-4)


def test_streamed_logprobs_add_up_to_the_whole_answers(client) -> None:  # type: ignore[no-untyped-def]
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": "w5 w17",
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 2,
    }
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks]
    assert whole is not None and all(s is not None for s in streamed)
    for name in ("tokens", "token_logprobs", "text_offset"):
        assert [x for s in streamed for x in getattr(s, name)] == getattr(whole, name), name


# -- lm-evaluation-harness -------------------------------------------------------------------------


def lm_eval_loglikelihood_payload(prompts: list[list[int]]) -> dict[str, Any]:
    """LocalCompletionsAPI._create_payload(generate=False), tokenized_requests=True."""
    return {
        "model": "tiny",
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def lm_eval_parse_logprobs(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs, as it reads the answer."""
    result = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(
            tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=True)
        )
        result.append((sum(token_logprobs), is_greedy))
    return result


def test_lm_eval_loglikelihood_requests_get_transformers_scores(server, reference) -> None:  # type: ignore[no-untyped-def]
    prompts = [CONTEXT + continuation for continuation in CONTINUATIONS]
    greedy_one = greedy(reference, CONTEXT, 2)
    prompts.append(CONTEXT + greedy_one)  # a continuation that is greedy at every token
    headers = {"Authorization": "Bearer EMPTY"}  # what TemplateAPI.header sends
    response = httpx.post(
        f"{server.url}/v1/completions",
        json=lm_eval_loglikelihood_payload(prompts),
        headers=headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    out = response.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for choice, prompt in zip(out["choices"], prompts, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1  # the prompt, then one generated token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert choice["text"].startswith(text_of(server, prompt))
    got = lm_eval_parse_logprobs(out, [len(CONTEXT)] * len(prompts))
    for (score, is_greedy), prompt in zip(got, prompts, strict=True):
        expected = log_softmax(reference, prompt)
        rows = range(len(CONTEXT) - 1, len(prompt) - 1)
        want = sum(expected[r, prompt[r + 1]].item() for r in rows)
        assert score == pytest.approx(want, abs=5e-4)
        assert is_greedy == all(int(expected[r].argmax()) == prompt[r + 1] for r in rows)
    assert got[-1][1] is True and got[0][1] is False


def test_lm_eval_generate_until_requests_get_transformers_greedy_text(server, reference) -> None:  # type: ignore[no-untyped-def]
    # LocalCompletionsAPI._create_payload(generate=True): until -> stop, plus the EOS string
    payload = {
        "prompt": [CONTEXT],
        "model": "tiny",
        "max_tokens": 6,
        "temperature": 0,
        "stop": ["\n\n", "</s>"],
        "seed": 1234,
    }
    out = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=60).json()
    assert out["choices"][0]["text"] == text_of(server, greedy(reference, CONTEXT, 6))
    # LocalChatCompletion._create_payload: stop cut to 4, max_tokens, seed
    chat = {
        "messages": CHAT,
        "model": "tiny",
        "max_tokens": 6,
        "temperature": 0,
        "stop": ["\n\n"],
        "seed": 1234,
    }
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    ids = server.engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    assert answer["choices"][0]["message"]["content"] == text_of(server, greedy(reference, ids, 6))


# -- n, seed, stream_options -----------------------------------------------------------------------


def test_n_answers_are_seeded_one_by_one(client) -> None:  # type: ignore[no-untyped-def]
    args: dict[str, Any] = {"model": "tiny", "prompt": "w5 w17", "max_tokens": 6, "temperature": 1.0}
    three = client.completions.create(**args, n=3, seed=7)
    assert [c.index for c in three.choices] == [0, 1, 2]
    singles = [client.completions.create(**args, seed=7 + i).choices[0].text for i in range(3)]
    assert [c.text for c in three.choices] == singles
    again = client.completions.create(**args, n=3, seed=7)
    assert [c.text for c in again.choices] == singles
    assert len(set(singles)) > 1  # distinct seeds sample differently on this model
    assert three.usage is not None and three.usage.prompt_tokens == 2
    assert three.usage.completion_tokens == sum(len(t.split()) for t in singles)


def test_streamed_n_answers_with_usage(client) -> None:  # type: ignore[no-untyped-def]
    args: dict[str, Any] = {"model": "tiny", "messages": CHAT, "max_tokens": 5, "temperature": 1.0, "seed": 3}
    whole = client.chat.completions.create(**args, n=2)
    chunks = list(
        client.chat.completions.create(**args, n=2, stream=True, stream_options={"include_usage": True})
    )
    *deltas, last = chunks
    texts = ["", ""]
    for chunk in deltas:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens


def test_echo_without_logprobs_puts_the_prompt_first(client, server, reference) -> None:  # type: ignore[no-untyped-def]
    done = client.completions.create(
        model="tiny", prompt="w5 w17 w42 w9", max_tokens=3, temperature=0, echo=True
    )
    assert done.choices[0].text == "w5 w17 w42 w9" + text_of(server, greedy(reference, CONTEXT, 3))
    assert done.choices[0].logprobs is None


def test_streamed_echo_and_chat_logprobs_add_up_to_the_whole_answers(client) -> None:  # type: ignore[no-untyped-def]
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": "w5 w17 w42",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
    }
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    assert chunks[0].text.startswith("w5 w17 w42") and "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert [t for c in chunks for t in c.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert whole.logprobs.token_logprobs[0] is None and len(whole.logprobs.tokens) == 3 + 4
    chat: dict[str, Any] = {"model": "tiny", "messages": CHAT, "max_tokens": 4, "temperature": 0}
    content = (
        client.chat.completions.create(**chat, logprobs=True, top_logprobs=1).choices[0].logprobs.content
    )
    streamed = client.chat.completions.create(**chat, logprobs=True, top_logprobs=1, stream=True)
    entries = [e for c in streamed for e in ((c.choices[0].logprobs and c.choices[0].logprobs.content) or [])]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
