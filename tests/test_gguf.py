"""GGUF models with experts kept quantized in the cache: greedy tokens equal the float32 reference.

Tiny random models of each architecture are written as GGUF (llama.cpp's names and metadata, see
:mod:`ggufhelpers`: ``runahead convert``) at Q4_0 and Q8_0. The judge is transformers on the
*dequantized* weights: its own GGUF loader (``gguf_file=``) for qwen3moe; for the others, which
transformers 5.24 cannot load from GGUF (olmoe, Mixtral as ``llama``, qwen2moe with the
converter's 2-D ``ffn_gate_inp_shexp``, and the rest), the HF folder with every weight replaced by the GGUF's,
dequantized with ``gguf.quants``. The runtime runs 8 requests at once with 8 cache slots for 24
experts, reading the experts' quantized bytes from the file with O_DIRECT, under every policy.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ggufhelpers import (
    GGUF_ARCH,
    LOGIT_TOLERANCE,
    OVERRIDES,
    build_tiny_gguf,
    dequantized_folder,
    reference_model,
    retyped,
    save_gemma_tokenizer,
    write_gguf,
)
from test_torch_backend import PROMPTS, TOKENS, run

from runahead.models import qkernel
from runahead.models.base import DENSE_ROLES, ModelLoadError
from runahead.models.gguf import load_gguf
from runahead.models.layout import STORED_TYPES
from runahead.models.loader import load_model, load_reference_slot
from runahead.models.quant import dequantize, widened
from runahead.store import DiskStore, HostStore, SlotPool

from simhelpers import POLICIES

CASES = [(arch, kind) for kind in ("Q4_0", "Q8_0") for arch in GGUF_ARCH]
Q8_0_POLICIES = ("sync", "prefetch-gate")
"""Q8_0 differs from Q4_0 in the slot's arithmetic, not in scheduling: beside the reference run
(``runahead``) it runs the baseline and a prefetcher; every policy runs at Q4_0, the paper's format."""
POLICY_CASES = [
    (case, policy) for case in CASES for policy in (POLICIES if case[1] == "Q4_0" else Q8_0_POLICIES)
]


def _reference(arch: str, gguf_path: Path, hf: Path, folder: Path) -> Any:
    """transformers on the GGUF's dequantized weights (its own GGUF loader where it has one)."""
    return reference_model(arch, gguf_path, hf, folder)


def _checked_run(arch: str, kind: str, folder: Path) -> dict[str, Any]:
    """A tiny GGUF and the runtime's greedy tokens on it, checked against the reference.

    8 requests at once, 8 cache slots for 24 experts (policy ``runahead``). Greedy decoding equals
    the reference's exactly when, at every step, the reference's argmax after the same prefix is the
    token chosen: one teacher-forced reference pass over each prompt + our tokens checks all steps
    (cheaper than the reference's own step-by-step ``generate``), and bounds the logits too.
    """
    path, hf = build_tiny_gguf(arch, folder, kind)
    reference = _reference(arch, path, hf, folder)
    tokens, logits, runtime = run(path, "runahead", requests=8, slots=8, barrier=False)
    assert runtime.cache.stats.fetches > 0 and runtime.cache.stats.evictions > 0
    with torch.no_grad():
        for index, prompt in enumerate(PROMPTS):
            assert len(tokens[index]) == TOKENS
            sequence = torch.tensor([prompt + tokens[index]])
            ref = reference(sequence).logits[0, len(prompt) - 1 : -1]
            assert ref.argmax(-1).tolist() == tokens[index], f"request {index}: greedy tokens differ"
            assert (torch.stack(logits[index]) - ref).abs().max().item() < LOGIT_TOLERANCE.get(arch, 1e-4)
    return {"path": path, "kind": kind, "expected": tokens}


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], dict[str, Any]]:
    """``get(arch, kind)``: :func:`_checked_run` of that case, built once per module."""
    done: dict[tuple[str, str], dict[str, Any]] = {}

    def get(arch: str, kind: str) -> dict[str, Any]:
        if (arch, kind) not in done:
            done[arch, kind] = _checked_run(arch, kind, tmp_path_factory.mktemp(f"{arch}-{kind}"))
        return done[arch, kind]

    return get


@pytest.mark.parametrize(("arch", "kind"), CASES)
def test_tokens_and_logits_equal_the_reference(gguf_models: Any, arch: str, kind: str) -> None:
    assert len(gguf_models(arch, kind)["expected"]) == len(PROMPTS)


@pytest.mark.parametrize(("case", "policy"), POLICY_CASES, ids=[f"{a}-{k}-{p}" for (a, k), p in POLICY_CASES])
def test_every_policy_generates_the_reference_tokens(
    gguf_models: Any, case: tuple[str, str], policy: str
) -> None:
    model = gguf_models(*case)
    tokens, _, runtime = run(model["path"], policy, requests=8, slots=8)
    assert tokens == model["expected"]
    assert runtime.cache.stats.fetches > 0 and runtime.cache.stats.evictions > 0


@pytest.mark.parametrize(("arch", "kind"), CASES)
def test_slots_hold_experts_as_stored(gguf_models: Any, arch: str, kind: str) -> None:
    _, layout = load_gguf(gguf_models(arch, kind)["path"])
    biases = ("F32",) * 3 if arch == "gpt_oss" else ()  # gpt-oss's gate, up and down biases
    assert layout.stored and layout.slot_format(0).kinds == (kind, kind, kind, *biases)
    per_block, block_bytes = STORED_TYPES[kind]
    h, i = layout.hidden_size, layout.intermediate_size
    bias_bytes = 4 * (2 * i + h) if biases else 0
    assert layout.slot_numel == 3 * h * i // per_block * block_bytes + bias_bytes  # bytes, as stored


@pytest.mark.skipif(not qkernel.available(), reason="no C compiler here")
@pytest.mark.parametrize(("arch", "kind"), CASES)
def test_dense_matrices_stay_as_the_file_stores_them(gguf_models: Any, arch: str, kind: str) -> None:
    """On the kernel path (what every run above used) the projections, shared experts, LM head and
    embedding stay as stored blocks (those the converter reordered by whole blocks reordered back as blocks),
    and hold exactly the weights a widened load has."""
    path = gguf_models(arch, kind)["path"]
    model, _ = load_gguf(path, dense_as_stored=True)
    plain, _ = load_gguf(path)
    kept = {key for key, w in model.weights.items() if w.dtype == torch.uint8}
    assert "embed" in kept and all(key.rpartition(".")[2] in DENSE_ROLES | {"embed"} for key in kept)
    assert model.dtype == torch.float32  # the compute dtype, though the embedding is blocks
    ids = torch.tensor([3, 0, 3, 7])
    assert torch.equal(model.embedding_rows(ids), torch.nn.functional.embedding(ids, plain.weights["embed"]))
    assert all(model.weights[key].shape[2] == STORED_TYPES[kind][1] for key in kept)
    for key, w in model.weights.items():
        if key in kept:
            assert torch.equal(widened(w, torch.float32), plain.weights[key]), key
        else:
            assert w.dtype == torch.float32 and torch.equal(w, plain.weights[key]), key
    if arch == "mixtral":  # llama's q/k rows, permuted by the converter: permuted back as whole rows
        assert {"0.q_proj", "0.k_proj"} <= kept
    if arch == "qwen3_5_moe":  # the value heads, reordered by the converter: by whole rows here too
        assert {"0.in_proj_qkv", "0.in_proj_z", "1.q_gate"} <= kept


@pytest.mark.skipif(not qkernel.available(), reason="no C compiler here")
def test_an_f16_files_dense_matrices_stay_half_width_and_give_the_reference_tokens(tmp_path: Path) -> None:
    checked = _checked_run("qwen3_moe", "F16", tmp_path)  # tokens and logits against the reference
    model, _ = load_gguf(checked["path"], dense_as_stored=True)
    assert model.weights["0.q_proj"].dtype == model.weights["lm_head"].dtype == torch.float16
    assert model.weights["embed"].dtype == model.dtype == torch.float32  # looked up: widened at load


@pytest.mark.skipif(not qkernel.available(), reason="no C compiler here")
def test_a_large_stored_matrix_runs_many_rows_through_the_kernel_a_few_at_a_time(
    gguf_models: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More rows than the kernel takes at once: a small stored matrix is widened for the call, a large
    one (an LM head) goes through the kernel in slices; both give the widened product's values."""
    import runahead.models.products as products

    model, _ = load_gguf(gguf_models("qwen3_moe", "Q4_0")["path"], dense_as_stored=True)
    w = model.weights["lm_head"]
    assert w.dtype == torch.uint8
    x = torch.randn(3 * qkernel.max_rows() + 5, model.config.hidden_size)
    expected = x @ widened(w, torch.float32).T
    widening = model.dense(x, "lm_head")
    monkeypatch.setattr(products, "WIDEN_MAX_WEIGHTS", 0)
    sliced = model.dense(x, "lm_head")
    assert sliced.shape == expected.shape == widening.shape
    assert torch.allclose(widening, expected, atol=1e-5) and torch.allclose(sliced, expected, atol=1e-5)
    assert torch.equal(sliced[:1], model.dense(x[:1], "lm_head"))  # a slice's rows: as the kernel's alone


@pytest.mark.parametrize(("arch", "kind"), [("qwen3_moe", "Q4_0"), ("mixtral", "Q8_0")])
def test_host_store_and_prefill_waves(gguf_models: Any, arch: str, kind: str) -> None:
    model = gguf_models(arch, kind)
    tokens, _, _ = run(model["path"], "runahead", requests=5, slots=4, store="host")
    assert tokens == {i: model["expected"][i] for i in range(5)}
    tokens, _, _ = run(model["path"], "runahead", requests=8, slots=6, barrier=False, chunk=2)
    assert tokens == model["expected"]


def test_gpt_oss_mxfp4_experts_stay_mxfp4_and_give_the_reference_tokens(tmp_path: Path) -> None:
    """The hub's gpt-oss type: experts MXFP4 (as llama.cpp's converter writes them), slots hold it."""
    from transformers import AutoModelForCausalLM

    q8, hf = build_tiny_gguf("gpt_oss", tmp_path, "Q8_0")
    names = tuple(f"blk.{k}.ffn_{r}_exps.weight" for k in range(3) for r in ("gate", "up", "down"))
    path = retyped(q8, tmp_path / "mxfp4.gguf", "MXFP4", names)
    _, layout = load_gguf(path)
    assert layout.slot_format(0).kinds == ("MXFP4", "MXFP4", "MXFP4", "F32", "F32", "F32")
    reference = AutoModelForCausalLM.from_pretrained(
        dequantized_folder(path, hf, tmp_path / "dequantized"),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    tokens, logits, runtime = run(path, "runahead", requests=4, slots=6, barrier=False)
    assert runtime.cache.stats.evictions > 0
    with torch.no_grad():
        for index in range(4):
            sequence = torch.tensor([PROMPTS[index] + tokens[index]])
            ref = reference(sequence).logits[0, len(PROMPTS[index]) - 1 : -1]
            assert ref.argmax(-1).tolist() == tokens[index]
            assert (torch.stack(logits[index]) - ref).abs().max().item() < 1e-4


# --- the store: quantized bytes at unaligned offsets ----------------------------------------------


@pytest.fixture(scope="module")
def q4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tiny_gguf("qwen3_moe", tmp_path_factory.mktemp("q4"), "Q4_0")


def test_disk_store_reads_the_files_bytes_into_byte_slots(q4: tuple[Path, Path]) -> None:
    import asyncio

    path, _ = q4
    _, layout = load_model(path)
    offsets = [r.offset for rs in layout.ranges.values() for r in rs]
    assert any(o % 4096 for o in offsets)  # GGUF aligns to 32 bytes only: most reads are unaligned
    pool = SlotPool.for_layout(4, layout)
    assert pool.dtype == torch.uint8 and pool.slot_numel == layout.slot_format(0).nbytes
    for store in (DiskStore(layout), HostStore(layout)):
        with store:

            async def read_all(store: Any = store) -> None:
                for key in sorted(layout.ranges):
                    await store.read_into(*key, pool.slot(0))
                    assert torch.equal(pool.slot(0), load_reference_slot(layout, *key))

            asyncio.run(read_all())
            payload = sum(r.nbytes for rs in layout.ranges.values() for r in rs)
            assert store.bytes_read == payload == len(layout.ranges) * layout.slot_numel


def test_dequantized_slot_equals_the_gguf_packages_dequantizer(q4: tuple[Path, Path]) -> None:
    from gguf import GGUFReader, quants

    path, _ = q4
    model, layout = load_model(path)
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down_exps.weight")
    want = quants.dequantize(tensor.data, tensor.tensor_type)[3]  # expert 3's down [H, I]
    slot = load_reference_slot(layout, 1, 3)
    part = layout.slot_format(1).parts[2]
    got = dequantize(slot[part.start : part.stop], part.kind, part.shape)
    assert np.array_equal(got.numpy(), want)
    flat = model.expert_weights(1, slot, torch.float32)
    h, i = layout.hidden_size, layout.intermediate_size
    assert flat.shape == (3 * h * i,) and torch.equal(flat[2 * h * i :].view(h, i), got)


def test_split_files_load_like_one(q4: tuple[Path, Path], tmp_path: Path) -> None:
    path, hf = q4
    first = write_gguf(hf, tmp_path / "split.gguf", "Q4_0", split_tensors=12)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) > 2 and first == parts[0]
    one, one_layout = load_model(path)
    split, split_layout = load_model(parts[-1])  # any part names the whole model
    expert_files = {r.path for rs in split_layout.ranges.values() for r in rs}
    assert len(expert_files) > 1 and expert_files <= {str(p) for p in parts}  # experts in several parts
    for key in [(0, 0), (2, 7)]:
        assert torch.equal(load_reference_slot(one_layout, *key), load_reference_slot(split_layout, *key))
    assert all(torch.equal(one.weights[k], split.weights[k]) for k in one.weights)
    parts[1].unlink()
    with pytest.raises(ModelLoadError, match=f"missing part {parts[1].name}"):
        load_model(first)


# --- bad files are refused by name ----------------------------------------------------------------


def test_truncated_file_is_refused_naming_file_and_tensor(q4: tuple[Path, Path], tmp_path: Path) -> None:
    path, _ = q4
    bad = tmp_path / "truncated.gguf"
    shutil.copy(path, bad)
    os.truncate(bad, bad.stat().st_size - 3000)
    with pytest.raises(
        ModelLoadError, match=rf"{bad}: tensor [\w.]+ \(\w+ \[[\d, ]+\]\) .*past the file's end"
    ):
        load_model(bad)


def test_tensor_bytes_not_matching_its_shape_are_refused(q4: tuple[Path, Path], tmp_path: Path) -> None:
    from gguf import GGUFReader

    path, _ = q4
    bad = tmp_path / "grown.gguf"
    shutil.copy(path, bad)
    reader = GGUFReader(bad, "r+")
    victim = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    victim.field.parts[3][2] = 9  # 9 experts declared, 8 experts' bytes before the next tensor
    reader.data.flush()
    del reader
    with pytest.raises(ModelLoadError, match=rf"{bad}: tensor blk\.0\.ffn_gate_exps\.weight .*past tensor"):
        load_model(bad)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_unsupported_expert_type_is_refused_by_name(tmp_path: Path, kind: str) -> None:
    from modelhelpers import build_tiny_model

    # Q4_K blocks hold 256 weights: experts 256 wide
    hf = build_tiny_model("qwen3_moe", tmp_path / "hf", hidden_size=256, moe_intermediate_size=256)
    path = retyped(
        write_gguf(hf, tmp_path / "q8.gguf", "Q8_0"),
        tmp_path / f"{kind}.gguf",
        kind,
        ("blk.1.ffn_up_exps.weight",),
    )
    with pytest.raises(ModelLoadError, match=rf"{path}: tensor blk\.1\.ffn_up_exps\.weight has type {kind}"):
        load_model(path)


def test_unsupported_resident_type_is_refused_by_name(q4: tuple[Path, Path], tmp_path: Path) -> None:
    path = retyped(q4[0], tmp_path / "q8_1.gguf", "Q8_1", ("blk.1.attn_q.weight",))
    with pytest.raises(ModelLoadError, match=rf"{path}: tensor blk\.1\.attn_q\.weight has type Q8_1"):
        load_model(path)


def test_gemma4_rope_freqs_that_are_not_proportional_rope_are_refused(tmp_path: Path) -> None:
    path, _ = build_tiny_gguf("gemma4", tmp_path, "Q8_0")  # global heads 24 wide: 12 pairs, 3 turn
    freqs = np.ones(12, dtype=np.float32)  # every pair turning: proportional RoPE over whole heads
    whole = retyped(path, tmp_path / "whole.gguf", "F32", (), {"rope_freqs.weight": freqs})
    assert load_gguf(whole)[0].config.full_rotary_fraction == 1.0
    freqs[5] = 0.5  # a scaled frequency: not what proportional RoPE writes
    bad = retyped(path, tmp_path / "bad.gguf", "F32", (), {"rope_freqs.weight": freqs})
    with pytest.raises(ModelLoadError, match=rf"{bad}: tensor rope_freqs\.weight \[12\] is not proportional"):
        load_gguf(bad)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4"])
def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path, arch: str) -> None:
    """Byte-level BPE (``gpt2``), and Gemma's BPE with byte fallback (llama.cpp's ``gemma4``)."""
    from runahead.models.loader import load_tokenizer
    from runahead.tokenizer import CHAT_TEMPLATE, has_tokenizer, save_tokenizer

    from modelhelpers import VOCAB, build_tiny_model

    hf = build_tiny_model(arch, tmp_path / "hf", **{**OVERRIDES[arch], "vocab_size": 512})
    for stale in ("tokenizer.json", "tokenizer_config.json"):
        (hf / stale).unlink(missing_ok=True)
    (save_gemma_tokenizer if arch == "gemma4" else save_tokenizer)(hf, 512)
    path = write_gguf(hf, tmp_path / "tok.gguf", "Q8_0", tokenizer=True)
    assert has_tokenizer(path) and VOCAB < 512
    from transformers import AutoTokenizer

    ours, original = load_tokenizer(path), AutoTokenizer.from_pretrained(hf)
    text = "the cat sat on the mat \u2603"  # a snowman: bytes the vocabularies do not hold whole
    assert ours.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    chat = [{"role": "user", "content": "hello"}]
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    from runahead.cli import main

    argv = ["generate", str(path), "--prompt", text, "--max-tokens", "3", "--cache-fraction", "0.5", "--json"]
    assert main(argv) == 0


def test_gguf_config_gives_the_sim_the_bytes_a_fetch_moves(q4: tuple[Path, Path]) -> None:
    from runahead.generate import recorded_spec

    path, _ = q4
    _, layout = load_model(path)
    from runahead.specs import load_model_spec

    for spec in (recorded_spec(path, "tiny-q4"), load_model_spec(path)):
        assert spec.bits_per_weight == 4.5
        assert spec.expert_bytes == layout.slot_numel  # the sim's fetch moves what the store reads
