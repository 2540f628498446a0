"""Tiny random MoE models written as GGUF files by ``runahead convert`` (llama.cpp's layout).

:func:`build_tiny_gguf` builds a tiny model with :func:`modelhelpers.build_tiny_model`, then
converts it with :func:`runahead.models.gguf_convert.convert` (names, metadata and types as
llama.cpp's ``convert_hf_to_gguf.py``; ``bench/gguf_converter_check.py`` compares the two).
Nothing is downloaded.

:func:`dequantized_folder` is the float32 reference for architectures transformers cannot load
from GGUF (olmoe, Mixtral as ``llama``): the HF folder with every weight replaced by what the GGUF
holds, dequantized with ``gguf.quants``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modelhelpers import build_tiny_model

GGUF_ARCH = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "olmoe": "olmoe",
    "mixtral": "llama",
    "qwen3_5_moe": "qwen35moe",
    "gpt_oss": "gpt-oss",
    "gemma4": "gemma4",
}
"""Our ``model_type`` -> the GGUF ``general.architecture`` the converter writes."""

LOGIT_TOLERANCE = {"qwen3_5_moe": 4e-4}
"""Float32 logit tolerance where 1e-4 is too tight: Qwen3.5's linear attention against transformers'
reference path differs by up to ~3e-4 on some of several concurrent requests, from the GGUF and from
its dequantized safetensors twin alike (measured 2026-12-01); greedy tokens are still equal."""

OVERRIDES: dict[str, dict[str, Any]] = {
    # Expert widths and shared experts in whole 32-weight blocks (H = 64, I = 96: not square).
    "qwen3_moe": {"moe_intermediate_size": 96},
    "qwen2_moe": {"moe_intermediate_size": 96, "shared_expert_intermediate_size": 64},
    # The converter drops OLMoE's clip_qkv and llama.cpp does not clip: the GGUF model has none.
    "olmoe": {"intermediate_size": 96, "clip_qkv": None},
    # GGUF's llama has no sliding window; llama.cpp renormalises Mixtral's top-k, as transformers does.
    "mixtral": {"intermediate_size": 96, "sliding_window": None},
    "qwen3_5_moe": {"moe_intermediate_size": 96, "shared_expert_intermediate_size": 64},
    # Every expert and dense-MLP row in whole 32-weight blocks; experts stay fused (ffn_gate_up_exps).
    "gemma4": {"hidden_size": 64, "moe_intermediate_size": 96, "intermediate_size": 64},
    # GGUF has no swiglu constants (llama.cpp: 7.0) and ggml truncates YaRN's correction range.
    "gpt_oss": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "swiglu_limit": 7.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": True,
        },
    },
}


def write_gguf(
    hf: Path, out: Path, kind: str = "Q4_0", split_tensors: int = 0, tokenizer: bool = False
) -> Path:
    """``runahead convert`` of the HF folder ``hf`` to ``out`` (matrices as ``kind``); the (first) file.

    ``split_tensors`` > 0 writes split files of that many tensors each (``-0000K-of-0000N.gguf``);
    ``tokenizer`` writes the folder's byte-level BPE vocabulary and chat template (the tiny models'
    word-level tokenizer is not one: without it the file has no vocabulary).
    """
    from runahead.models.gguf_convert import convert

    return convert(hf, out, kind, split_max_tensors=split_tensors, vocab=tokenizer)[0]


def build_tiny_gguf(
    arch: str, folder: Path, kind: str = "Q4_0", seed: int = 0, **options: Any
) -> tuple[Path, Path]:
    """A tiny random ``arch`` model as ``(GGUF file, its HF folder)``; ``options``: :func:`write_gguf`'s."""
    hf = build_tiny_model(arch, folder / "hf", seed=seed, **OVERRIDES[arch])
    return write_gguf(hf, folder / f"tiny-{kind}.gguf", kind, **options), hf


def retyped(
    path: Path, out: Path, kind: str, names: tuple[str, ...], values: dict[str, np.ndarray] | None = None
) -> Path:
    """A copy of the GGUF ``path`` at ``out`` with tensors ``names`` stored as ``kind``: requantized
    with ``gguf.quants`` where it can quantize ``kind`` (Q4_1, ...), else random bytes of the right
    count (Q4_K, ...: only the type matters to a loader that must refuse it); ``values``: tensors
    written with these float32 values instead."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    reader = GGUFReader(path)
    writer = GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    qtype = GGMLQuantizationType[kind]
    for tensor in reader.tensors:
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        if values and tensor.name in values:
            writer.add_tensor(tensor.name, values[tensor.name])
            continue
        if tensor.name not in names:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        try:
            data = quants.quantize(quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape), qtype)
        except NotImplementedError:
            block, size = GGML_QUANT_SIZES[qtype]
            rows = np.random.default_rng(0).integers(0, 256, (*shape[:-1], shape[-1] // block * size))
            data = rows.astype(np.uint8)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def dequantized_folder(gguf_path: Path, hf: Path, out: Path) -> Path:
    """The HF folder ``hf`` with each weight replaced by the GGUF's, dequantized to float32 (gguf.quants).

    A transformers-loadable float32 copy of exactly what the GGUF holds: the reference for
    architectures transformers cannot load from GGUF. Each HF tensor is found as
    ``runahead convert`` names it (experts: a slice of the stacked tensor; llama's q/k rows
    permuted back).
    """
    from gguf import GGUFReader, quants
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    from runahead.models import gguf_gpt_oss, gguf_qwen35
    from runahead.models.gguf_convert import expert_part, gguf_name, q_k_permutation, read_hf_config

    reader = GGUFReader(gguf_path)
    stored = {
        t.name: quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        for t in reader.tensors
    }
    config = read_hf_config(hf)
    state = {n: t.float().numpy() for f in sorted(hf.glob("*.safetensors")) for n, t in load_file(f).items()}
    out.mkdir(parents=True, exist_ok=True)
    gpt_oss = GGUF_ARCH.get(config["model_type"]) == "gpt-oss"
    for name, value in state.items():
        part = None if gpt_oss else expert_part(name)
        if gpt_oss and ".experts." in name:
            found = gguf_gpt_oss.hf_experts(name, stored.__getitem__, int(name.split(".")[2]))
        elif part is not None:
            layer, expert, role = part
            found = stored[f"blk.{layer}.ffn_{role}_exps.weight"]  # Gemma 4: stacked, gate_up fused
            found = found if expert is None else found[expert]
        else:
            target = gguf_name(name, config)
            found = stored[target]
            if GGUF_ARCH[config["model_type"].removesuffix("_text")] == gguf_qwen35.ARCH:
                found = gguf_qwen35.from_gguf(name, found, config, value.shape)
            if heads := q_k_permutation(target, config):  # undo the converter's permutation
                found = found.reshape(heads, found.shape[0] // heads // 2, 2, *found.shape[1:]).swapaxes(1, 2)
        state[name] = np.ascontiguousarray(np.asarray(found, dtype=np.float32).reshape(value.shape))
    save_file(state, str(out / "model.safetensors"))
    for extra in hf.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "model.safetensors.index.json":
            shutil.copy(extra, out / extra.name)
    return out


def transformers_gguf(gguf_path: Path, hf: Path) -> Any:
    """transformers' own GGUF loading of ``gguf_path`` (float32), with the HF config passed in: its
    qwen3_moe mapping ignores ``expert_feed_forward_length`` (FACTS.md)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf)
    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        config=config,
        dtype=torch.float32,
        attn_implementation="eager",
    )


def reference_model(arch: str, gguf_path: Path, hf: Path, folder: Path) -> Any:
    """transformers on the GGUF's dequantized weights: its own GGUF loader for qwen3moe, else the
    float32 folder of :func:`dequantized_folder` (written under ``folder``)."""
    from transformers import AutoModelForCausalLM

    if GGUF_ARCH[arch] == "qwen3moe":
        return transformers_gguf(gguf_path, hf).eval()
    return AutoModelForCausalLM.from_pretrained(
        dequantized_folder(gguf_path, hf, folder / "dequantized"),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()


GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
"""Ids 0-3 of :func:`save_gemma_tokenizer`'s vocabulary, as in Gemma's."""


def save_gemma_tokenizer(path: Path, vocab_size: int) -> None:
    """A tokenizer of Gemma's kind in ``path``: BPE over text whose spaces are ``▁``, with byte
    fallback to the 256 ``<0xNN>`` tokens (ids 4-259) and a ``Replace / ByteFallback / Fuse`` decoder;
    trained offline on the package's corpus, with the ChatML template of :mod:`runahead.tokenizer` (what
    llama.cpp's Gemma 4 converter reads as ``gemma4``; the byte-level BPE of the others is not one)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from runahead.tokenizer import CHAT_TEMPLATE, corpus

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    bpe.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    trainer = trainers.BpeTrainer(  # specials, then the bytes, then what it learns
        vocab_size=vocab_size, special_tokens=[*GEMMA_SPECIALS, *byte_tokens], show_progress=False
    )
    bpe.train_from_iterator(corpus().splitlines(), trainer)
    data = json.loads(bpe.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in GEMMA_SPECIALS]  # bytes: vocab
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
