"""``runahead convert``: the command, its refusals, and llama.cpp loading what it writes.

The converted files' tokens against transformers are checked in ``test_gguf.py`` (every model there
is written by ``convert``). The llama.cpp tests need llama-cpp-python (``llama_cpp``) and skip
without it; ``bench/gguf_converter_check.py`` compares the files with llama.cpp's own converter.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ggufhelpers import OVERRIDES, save_gemma_tokenizer
from test_torch_backend import run

from runahead.cli import main
from runahead.models.gguf import GGUFModel
from runahead.models.gguf_convert import KINDS, ConvertError, convert
from runahead.tokenizer import save_tokenizer

from modelhelpers import build_tiny_model


def _with_bpe(arch: str, folder: Path) -> Path:
    """A tiny ``arch`` model with a byte-level BPE tokenizer (Gemma 4: Gemma's kind, BPE with byte
    fallback); llama.cpp needs a vocabulary."""
    hf = build_tiny_model(arch, folder, **{**OVERRIDES[arch], "vocab_size": 512})
    for stale in ("tokenizer.json", "tokenizer_config.json"):
        (hf / stale).unlink(missing_ok=True)
    (save_gemma_tokenizer if arch == "gemma4" else save_tokenizer)(hf, 512)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_bpe("qwen3_moe", tmp_path_factory.mktemp("convert") / "hf")


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_command_writes_each_type(
    tiny: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.gguf"
    assert main(["convert", str(tiny), str(out), "--type", kind.lower(), "--no-vocab"]) == 0
    assert str(out) in capsys.readouterr().out
    model = GGUFModel(out)
    assert model.kind("blk.0.ffn_gate_exps.weight") == kind
    assert model.kind("blk.0.ffn_gate_inp.weight") == "F32"  # the router, as the converter keeps it
    assert model.kind("blk.0.attn_norm.weight") == "F32"
    assert model.meta("general.file_type") == KINDS[kind]
    assert model.meta("qwen3moe.expert_feed_forward_length") == 96
    assert model.meta("tokenizer.ggml.model") == "none"


def test_split_output_names_every_part(tiny: Path, tmp_path: Path) -> None:
    files = convert(tiny, tmp_path / "s.gguf", "Q8_0", split_max_tensors=10, vocab=False)
    assert [f.name for f in files] == [
        f"s-{k:05d}-of-{len(files):05d}.gguf" for k in range(1, len(files) + 1)
    ]
    assert len(files) > 2 and all(f.is_file() for f in files)


def test_what_cannot_be_converted_is_refused_by_name(tiny: Path, tmp_path: Path) -> None:
    words = build_tiny_model("olmoe", tmp_path / "words", **OVERRIDES["olmoe"])  # a word-level tokenizer
    with pytest.raises(ConvertError, match=r"only byte-level BPE tokenizers.*\(--no-vocab\)"):
        convert(words, tmp_path / "x.gguf", "Q4_0")
    with pytest.raises(ConvertError, match="type 'Q4_K' is not written"):
        convert(tiny, tmp_path / "x.gguf", "q4_k", vocab=False)
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    with pytest.raises(ConvertError, match=r"model_type 'deepseek_v3' is not supported; convertible:"):
        convert(other, tmp_path / "x.gguf")
    gemma4 = build_tiny_model("gemma4", tmp_path / "gemma4", **OVERRIDES["gemma4"])
    with pytest.raises(
        ConvertError, match=r"Gemma 4's vocabulary must be a BPE with byte fallback.*\(--no-vocab\)"
    ):
        convert(gemma4, tmp_path / "x.gguf", "Q8_0")
    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(other), str(tmp_path / "x.gguf")])
    assert exit_.value.code == 2


def test_gemma4_hub_folder_converts_as_its_text_model(tmp_path: Path) -> None:
    """The hub's ``Gemma4ForConditionalGeneration`` folder (``text_config``, ``model.language_model.``,
    global heads as ``global_head_dim``): the same file as transformers' ``gemma4_text`` folder."""
    from gguf import GGUFReader

    from mlxhelpers import hub_wrap

    tied = {**OVERRIDES["gemma4"], "tie_word_embeddings": True}  # as the hub's (no lm_head tensor)
    text = build_tiny_model("gemma4", tmp_path / "text", **tied)
    hub = build_tiny_model("gemma4", tmp_path / "hub", **tied)
    hub_wrap(hub)
    files = [GGUFReader(convert(f, tmp_path / f"{f.name}.gguf", "Q8_0", vocab=False)[0]) for f in (text, hub)]
    fields = [{k: f.contents() for k, f in r.fields.items() if k not in ("general.name",)} for r in files]
    assert fields[0] == fields[1] and fields[0]["gemma4.attention.head_count_kv"] == [2, 1, 2, 1]
    tensors = [{t.name: np.asarray(t.data).tobytes() for t in r.tensors} for r in files]
    assert tensors[0] == tensors[1] and "blk.0.ffn_gate_up_exps.weight" in tensors[0]
    assert "output.weight" not in tensors[0]


def test_mxfp4_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    hf = build_tiny_model("gpt_oss", tmp_path / "hf", **OVERRIDES["gpt_oss"])
    blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    save_file({blocks: torch.zeros(6, 192, 2, 16, dtype=torch.uint8)}, str(hf / "model.safetensors"))
    with pytest.raises(ConvertError, match=f"tensor {blocks} is MXFP4: convert a dequantized checkpoint"):
        convert(hf, tmp_path / "x.gguf", vocab=False)


# --- llama.cpp loads what convert writes (optional: needs llama-cpp-python) --------------------------


def _llama_cpp_greedy(path: Path, prompt: list[int], tokens: int) -> list[int]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gemma4"])
def test_llama_cpp_gives_our_greedy_tokens_on_an_f32_file(tmp_path: Path, arch: str) -> None:
    pytest.importorskip("llama_cpp")
    path = convert(_with_bpe(arch, tmp_path / "hf"), tmp_path / "f32.gguf", "F32")[0]
    ours, _, _ = run(path, "runahead", requests=2, slots=8)
    from test_torch_backend import PROMPTS

    for index in range(2):
        assert _llama_cpp_greedy(path, PROMPTS[index], 8) == ours[index][:8]


def test_llama_cpp_loads_a_q4_0_file(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    path = convert(tiny, tmp_path / "q4.gguf", "Q4_0")[0]
    assert len(_llama_cpp_greedy(path, [5, 17, 42, 9], 4)) == 4
