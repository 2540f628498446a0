"""The built models' tokenizer: text prompts, chat and the OpenAI client work on them end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runahead.cli import main
from runahead.medium import SMALL_CONFIG, build_cached
from runahead.models.loader import load_tokenizer
from runahead.tokenizer import SPECIAL_TOKENS, save_tokenizer

from serverhelpers import running_server

TINY = {
    **SMALL_CONFIG,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 600,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model built the way ``small`` and ``medium`` are, tokenizer included."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RUNAHEAD_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        return build_cached("tiny-qwen3-moe", TINY, "float32", progress=False)
    finally:
        mp.undo()


def reference(path: Path, ids: list[int], tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (stopping at the end of a turn, as the engine does)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = net.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False
        )
    new: list[int] = out[0, len(ids) :].tolist()
    return new[: new.index(2) + 1] if 2 in new else new


def test_the_trained_tokenizer_encodes_any_text_and_every_id_decodes(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, 600)
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == 600
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == list(SPECIAL_TOKENS)
    assert tokenizer.eos_token_id == 2
    for text in (
        "Hello",
        "Hello, how are you?",
        "naïve café, 日本語 and emoji 🙂",
        "def f(x):\n    return x",
    ):
        ids = tokenizer.encode(text)
        assert ids and tokenizer.decode(ids) == text
    assert len(tokenizer.encode("Hello there")) < 4  # merges learned from the text, not bytes
    words = [tokenizer.decode([i]) for i in range(len(SPECIAL_TOKENS), 600)]
    assert all(words[256:])  # learned tokens and filled-in word pairs all print as text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_folder_without_a_tokenizer_is_told_so(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in model.iterdir():
        if file.name in ("config.json", "model.safetensors"):
            (bare / file.name).symlink_to(file)
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_tokenizer(bare)
    with pytest.raises(SystemExit) as exit:
        main(["generate", str(bare), "--prompt", "Hello"])
    assert exit.value.code == 2
    assert "has no tokenizer, so it cannot take --prompt: give --prompt-ids" in capsys.readouterr().err
    assert main(["generate", str(bare), "--prompt-ids", "5,6", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("[0] ")  # token ids, not a blank line


def test_text_prompts_generate_transformers_tokens_as_text(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = load_tokenizer(model)
    expected = reference(model, tokenizer.encode("Hello"), 6)
    assert main(["generate", str(model), "--prompt", "Hello", "--max-tokens", "6", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["token_ids"] == expected
    assert row["text"] == tokenizer.decode(expected, skip_special_tokens=True) and row["text"].strip()


def test_chat_and_completions_through_the_openai_client(model: Path) -> None:
    from openai import OpenAI

    tokenizer = load_tokenizer(model)
    messages = [{"role": "user", "content": "Hello!"}]
    chat_ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert chat_ids[:1] == [1]  # <|im_start|> is one token
    expected_chat = tokenizer.decode(reference(model, chat_ids, 6), skip_special_tokens=True)
    expected_text = tokenizer.decode(reference(model, tokenizer.encode("Hello"), 6), skip_special_tokens=True)
    with running_server(model, model_name="tiny") as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True
            )
        )
    assert reply.choices[0].message.content == expected_chat and expected_chat.strip()
    assert streamed == expected_text and expected_text.strip()


def test_two_builders_of_one_model_wait_for_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes (two demos, two test workers) building the same model at once: the second
    finds the first's folder; a build killed half-way leaves a ``.partial`` folder that is redone."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("RUNAHEAD_CACHE", str(tmp_path))
    (tmp_path / "tiny-qwen3-moe.partial").mkdir()
    (tmp_path / "tiny-qwen3-moe.partial" / "config.json").write_text("{half")
    with ThreadPoolExecutor(2) as pool:
        built = list(
            pool.map(lambda _: build_cached("tiny-qwen3-moe", TINY, "float32", progress=False), range(2))
        )
    assert built[0] == built[1] == tmp_path / "tiny-qwen3-moe"
    assert (
        json.loads((built[0] / "config.json").read_text())["num_hidden_layers"] == TINY["num_hidden_layers"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen3-moe", "tiny-qwen3-moe.lock"]
    load_tokenizer(built[0])
