"""Tiny random MoE models written as GGUF files, the way llama.cpp's converter writes them.

:func:`build_tiny_gguf` builds a tiny model with :func:`modelhelpers.build_tiny_model`, then
writes its weights with the ``gguf`` package's ``GGUFWriter`` under the tensor names and metadata
keys of llama.cpp's ``convert_hf_to_gguf.py`` (stacked ``blk.N.ffn_{gate,up,down}_exps``, router
``ffn_gate_inp`` in F32, norms in F32, llama's q/k rows permuted for its interleaved RoPE), matrices
quantized with ``gguf.quants`` (bit-identical to llama.cpp's quantizer for Q4_0 / Q8_0; a matrix whose
rows are not whole blocks falls back to F16 as the converter does). Nothing is downloaded.

:func:`dequantized_folder` is the float32 reference for architectures transformers cannot load
from GGUF (olmoe, Mixtral as ``llama``): the HF folder with every weight replaced by what the GGUF
holds, dequantized with ``gguf.quants``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modelhelpers import build_tiny_model

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}
"""Our ``model_type`` -> the GGUF ``general.architecture`` the converter writes."""

OVERRIDES: dict[str, dict[str, Any]] = {
    # Expert widths and shared experts in whole 32-weight blocks (H = 64, I = 96: not square).
    "qwen3_moe": {"moe_intermediate_size": 96},
    "qwen2_moe": {"moe_intermediate_size": 96, "shared_expert_intermediate_size": 64},
    # The converter drops OLMoE's clip_qkv and llama.cpp does not clip: the GGUF model has none.
    "olmoe": {"intermediate_size": 96, "clip_qkv": None},
    # GGUF's llama has no sliding window; llama.cpp renormalises Mixtral's top-k, as transformers does.
    "mixtral": {"intermediate_size": 96, "sliding_window": None},
}

_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_EXPERT_PARTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", ".bias")
"""Tensors the converter always keeps in float32."""


def gguf_name(hf_name: str) -> str | None:
    """The converter's name for a non-expert HF tensor, or None for an expert's."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    if ".experts." in hf_name:
        return None
    return f"blk.{layer}.{_PER_LAYER[rest]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute``: q/k rows for llama.cpp's interleaved RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kind_of(name: str, data: np.ndarray, kind: str) -> str:
    if data.ndim < 2 or name.endswith(_F32):
        return "F32"
    if kind.startswith("Q") and data.shape[-1] % 32:
        return "F16"  # the converter's fallback for rows that are not whole blocks
    return kind


def _state(hf: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors files as float32 numpy (bf16 included)."""
    from safetensors.torch import load_file

    state: dict[str, np.ndarray] = {}
    for file in sorted(hf.glob("*.safetensors")):
        state.update({name: t.float().numpy() for name, t in load_file(file).items()})
    return state


def hf_tensors(hf: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The config and the float32 GGUF-named tensors of a saved HF folder (experts stacked)."""
    config = json.loads((hf / "config.json").read_text())
    state = _state(hf)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    llama = config["model_type"] == "mixtral"
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in state.items():
        value = value.astype(np.float32)
        target = gguf_name(name)
        if target is None:  # model.layers.L.<moe>.experts.E.<part>.weight
            parts = name.split(".")
            stacked = f"blk.{parts[2]}.{_EXPERT_PARTS[parts[6]]}.weight"
            experts.setdefault(stacked, {})[int(parts[5])] = value
            continue
        if llama and target.endswith(("attn_q.weight", "attn_k.weight")):
            value = _permute(value, heads if target.endswith("attn_q.weight") else kv)
        if target.endswith("ffn_gate_inp_shexp.weight"):
            # 1-D, as older converters wrote it (same ggml extents as today's [H, 1]); transformers
            # 5.24 adds a dim to it and fails on the 2-D form.
            value = value.reshape(-1)
        tensors[target] = value
    for stacked, by_expert in experts.items():
        tensors[stacked] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return config, tensors


def write_gguf(
    hf: Path, out: Path, kind: str = "Q4_0", split_tensors: int = 0, tokenizer: bool = False
) -> Path:
    """Write the HF folder ``hf`` as a GGUF at ``out``: matrices as ``kind``, the converter's layout.

    ``split_tensors`` > 0 writes split files of that many tensors each (``-0000K-of-0000N.gguf``);
    returns the (first) file's path. ``tokenizer`` adds a byte-level BPE vocabulary and chat template
    to the metadata (``tokenizer.ggml.*``) from the folder's ``tokenizer.json``.
    """
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    config, tensors = hf_tensors(hf)
    arch = GGUF_ARCH[config["model_type"]]
    writer = GGUFWriter(out, arch, split_max_tensors=split_tensors)
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_feed_forward_length(config["intermediate_size"])
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "qwen3moe":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}[kind])
    if tokenizer:
        _add_tokenizer(writer, hf, config)
    for name, data in tensors.items():
        chosen = _kind_of(name, data, kind)
        if chosen == "F32":
            writer.add_tensor(name, data)
        elif chosen == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = GGMLQuantizationType[chosen]
            writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_tensors:
        return out.with_name(f"{out.stem}-00001-of-{len(writer.tensors):05d}.gguf")
    return out


def _add_tokenizer(writer: Any, hf: Path, config: dict[str, Any]) -> None:
    """A ``gpt2`` (byte-level BPE) vocabulary as the converter writes one: tokens, types, merges, ids."""
    raw = json.loads((hf / "tokenizer.json").read_text())
    vocab: dict[str, int] = raw["model"]["vocab"]
    special = {t["content"]: t["id"] for t in raw.get("added_tokens", [])}
    tokens = [""] * config["vocab_size"]
    for token, index in {**vocab, **special}.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # CONTROL / NORMAL
    merges = raw["model"].get("merges", [])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(config["eos_token_id"])
    chat = (hf / "tokenizer_config.json").read_text() if (hf / "tokenizer_config.json").is_file() else "{}"
    template = json.loads(chat).get("chat_template")
    if template is None and (hf / "chat_template.jinja").is_file():
        template = (hf / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def build_tiny_gguf(
    arch: str, folder: Path, kind: str = "Q4_0", seed: int = 0, **options: Any
) -> tuple[Path, Path]:
    """A tiny random ``arch`` model as ``(GGUF file, its HF folder)``; ``options``: :func:`write_gguf`'s."""
    hf = build_tiny_model(arch, folder / "hf", seed=seed, **OVERRIDES[arch])
    return write_gguf(hf, folder / f"tiny-{kind}.gguf", kind, **options), hf


def dequantized_folder(gguf_path: Path, hf: Path, out: Path) -> Path:
    """The HF folder ``hf`` with each weight replaced by the GGUF's, dequantized to float32 (gguf.quants).

    A transformers-loadable float32 copy of exactly what the GGUF holds: the reference for
    architectures transformers cannot load from GGUF. Experts are split back into the hub's names.
    """
    from gguf import GGUFReader, quants
    from safetensors.numpy import save_file

    reader = GGUFReader(gguf_path)
    stored = {
        t.name: quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        for t in reader.tensors
    }
    config = json.loads((hf / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    out.mkdir(parents=True, exist_ok=True)
    state = _state(hf)
    for name in state:
        target = gguf_name(name)
        if target is None:
            parts = name.split(".")
            value = stored[f"blk.{parts[2]}.{_EXPERT_PARTS[parts[6]]}.weight"][int(parts[5])]
        else:
            value = stored[target]
            if config["model_type"] == "mixtral" and target.endswith(("attn_q.weight", "attn_k.weight")):
                h = heads if target.endswith("attn_q.weight") else kv
                value = value.reshape(h, value.shape[0] // h // 2, 2, *value.shape[1:])
                value = value.swapaxes(1, 2).reshape(state[name].shape)
        state[name] = np.ascontiguousarray(value.reshape(state[name].shape).astype(np.float32))
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
