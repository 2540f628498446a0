"""Gemma 4 MoE in GGUF (``gemma4``): what llama.cpp's converter writes, both ways.

``convert_hf_to_gguf.py`` (``Gemma4Model``, on ``Gemma3Model``) keeps the routed experts fused as
transformers stacks them: ``blk.N.ffn_gate_up_exps [E, 2I, H]`` (gate rows, then up rows) and
``ffn_down_exps [E, H, I]``. The router's learnt ``scale`` becomes ``ffn_gate_inp.scale``, the
``per_expert_scale`` ``ffn_down_exps.scale`` (llama.cpp scales each expert's output by it, the
same product as scaling its routing weight) and ``layer_scalar`` ``layer_output_scale``; the dense
MLP beside the experts is ``ffn_{gate,up,down}`` behind ``ffn_norm`` / ``post_ffw_norm_1``, the
experts behind ``pre_ffw_norm_2`` / ``post_ffw_norm_2``. Norms are stored as ``w`` (Gemma 4's
RMSNorm scales by ``w``, so the converter adds no ``1``).

Proportional RoPE: ggml's NeoX RoPE turns the first dimensions of a head, so the converter turns
the whole global head (``rope.dimension_count`` = its width) and writes ``rope_freqs [D / 2]``:
``1`` for the turned pairs and ``1e30`` (a frequency divided to nothing) for the rest. The metadata
adds per-layer KV heads (``attention.head_count_kv``, an array), the global and sliding heads'
widths (``attention.key_length`` / ``key_length_swa``), ``rope.freq_base`` / ``freq_base_swa``, the
``attention.sliding_window_pattern`` (true for a sliding layer), ``final_logit_softcapping`` and
the expert width. A global layer without ``attn_v`` reuses K as V (``attention_k_eq_v``).

The vocabulary is Gemma's SentencePiece-style BPE (``tokenizer.json``: BPE with byte fallback,
``<0xNN>`` byte tokens, a ``Sequence`` decoder), written as llama.cpp's tokenizer model ``gemma4``
(the converter's ``LlamaHfVocab`` reading): every token in id order, score ``-1000``, type ``BYTE``,
``CONTROL`` (special), ``USER_DEFINED`` (other added tokens, and the chat markers llama.cpp must
render) or ``NORMAL``; the merges, special ids and chat template; no leading space, BOS added.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from runahead.models.description import ModelLoadError

ARCH = "gemma4"
MODEL_TYPES = ("gemma4", "gemma4_text")
NAMES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
"""HF tensors the converter names itself (``blk.N.<name>``), not through ``gguf``'s name map."""
VISIBLE = frozenset(
    (
        "<|channel>",
        "<channel|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|tool_response>",
        "<tool_response|>",
        '<|"|>',
    )
)
"""Added tokens the converter marks ``USER_DEFINED`` so that llama.cpp prints them (chat parsing)."""
UNTURNED = 1e30
"""The frequency factor of a pair proportional RoPE leaves still."""

Array = np.ndarray[Any, Any]


def gguf_name(name: str) -> str | None:
    """The GGUF name of the router's scales (``blk.N.ffn_gate_inp.scale`` ...); None for other tensors."""
    for tail, short in NAMES.items():
        if name.endswith("." + tail):
            return f"blk.{name.split('.')[2]}.{short}"
    return None


def _parsed(config: dict[str, Any]) -> Any:
    from runahead.models.gemma4 import Gemma4Description

    return Gemma4Description.parse_config(config)


def rope_freqs(config: dict[str, Any]) -> tuple[str, Array]:
    """The generated ``rope_freqs.weight``: ``1`` for the global head's turned pairs, then ``1e30``."""
    c = _parsed(config)
    turned = int(c.global_head_dim * c.full_rotary_fraction / 2)
    values = [1.0] * turned + [UNTURNED] * (c.global_head_dim // 2 - turned)
    return "rope_freqs.weight", np.array(values, dtype=np.float32)


def add_metadata(writer: Any, config: dict[str, Any]) -> None:
    """The keys ``Gemma3Model`` / ``Gemma4Model`` add to the common ones (their KV heads and head
    widths instead of the common scalars)."""
    c = _parsed(config)
    sliding = [t == "sliding_attention" for t in c.layer_types]
    if config.get("num_global_key_value_heads") is None and not config.get("per_layer_config"):
        writer.add_head_count_kv(c.num_kv_heads)
    else:
        writer.add_head_count_kv([c.num_kv_heads if s else c.global_kv_heads for s in sliding])
    writer.add_rope_freq_base(c.full_rope_theta)
    writer.add_rope_freq_base_swa(c.sliding_rope_theta)
    writer.add_key_length(c.global_head_dim)
    writer.add_value_length(c.global_head_dim)
    if c.final_logit_softcap:
        writer.add_final_logit_softcapping(c.final_logit_softcap)
    writer.add_sliding_window(c.sliding_window)
    writer.add_shared_kv_layers(int(config.get("num_kv_shared_layers") or 0))
    writer.add_embedding_length_per_layer_input(int(config.get("hidden_size_per_layer_input") or 0))
    writer.add_sliding_window_pattern(sliding)
    writer.add_key_length_swa(c.head_dim)
    writer.add_value_length_swa(c.head_dim)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_rope_dimension_count(c.global_head_dim)  # proportional: rope_freqs stills the rest
    writer.add_rope_dimension_count_swa(c.head_dim)


def add_tokenizer(writer: Any, folder: Path) -> None:
    """The converter's ``Gemma4Model.set_vocab`` for the tokenizer in ``folder``; ValueError naming
    what is wrong when ``tokenizer.json`` is not Gemma's kind (BPE with byte fallback)."""
    import gguf
    from transformers import AutoTokenizer

    raw = json.loads((folder / "tokenizer.json").read_text())
    model, decoder = raw.get("model", {}), raw.get("decoder") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback") or decoder.get("type") != "Sequence":
        raise ValueError(
            f"{folder / 'tokenizer.json'}: Gemma 4's vocabulary must be a BPE with byte fallback and a "
            f"Sequence decoder, as Gemma's (this one: {model.get('type')}, byte_fallback="
            f"{model.get('byte_fallback', False)}, decoder {decoder.get('type')})"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    base, by_id = int(tokenizer.vocab_size), {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    added = sorted((i, t) for t, i in tokenizer.get_added_vocab().items() if i >= base)
    tokens, types = [], []
    for index, token in [(i, by_id[i]) for i in range(base)] + added:
        if index < base and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            kind = gguf.TokenType.BYTE
        elif index in special:
            kind = gguf.TokenType.CONTROL
        else:
            kind = gguf.TokenType.NORMAL if index < base else gguf.TokenType.USER_DEFINED
        tokens.append(token)
        types.append(gguf.TokenType.USER_DEFINED if token in VISIBLE else kind)
    writer.add_tokenizer_model(ARCH)
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * len(tokens))
    writer.add_token_types(types)
    vocab = gguf.SpecialVocab(folder, load_merges=True)
    vocab.add_special_token["bos"] = True  # the converter sets it after the special vocabulary
    vocab.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)


def raw_config(key: Any, model: Any) -> dict[str, Any]:
    """``config.json`` keys of Gemma 4 from the metadata (``key(name, default)`` reads
    ``gemma4.<name>``) and ``model``'s (a :class:`runahead.models.gguf.GGUFModel`) tensors: whether
    the global layers have ``attn_v``, and the turned share of their heads from ``rope_freqs``."""
    pattern = [bool(s) for s in key("attention.sliding_window_pattern")]
    types = ["sliding_attention" if s else "full_attention" for s in pattern]
    heads = key("attention.head_count_kv")
    kv = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * len(types)
    head_dim, global_dim = int(key("attention.key_length_swa")), int(key("attention.key_length"))
    if int(key("rope.dimension_count_swa", head_dim)) != head_dim:
        raise ModelLoadError(
            f"{model.path}: {ARCH}.rope.dimension_count_swa {key('rope.dimension_count_swa')} != the "
            f"sliding heads' width {head_dim} (partial RoPE on sliding layers is not supported)"
        )
    freqs = model.dequantized("rope_freqs.weight").reshape(-1)
    turned = int(np.sum(freqs == 1.0))
    if freqs.shape != (global_dim // 2,) or not (
        np.all(freqs[:turned] == 1.0) and np.all(freqs[turned:] >= UNTURNED)
    ):
        raise ModelLoadError(
            f"{model.path}: tensor rope_freqs.weight {list(freqs.shape)} is not proportional RoPE over "
            f"{global_dim}-wide heads (1 for each turned pair, then 1e30)"
        )
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    return {
        "layer_types": types,
        "head_dim": head_dim,
        "global_head_dim": global_dim,
        "num_key_value_heads": next((k for k, s in zip(kv, pattern, strict=True) if s), kv[0]),
        "num_global_key_value_heads": kv[full[0]] if full else kv[0],
        "attention_k_eq_v": bool(full) and f"blk.{full[0]}.attn_v.weight" not in model.tensors,
        "sliding_window": int(key("attention.sliding_window")),
        "intermediate_size": int(key("feed_forward_length")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "enable_moe_block": True,
        "final_logit_softcapping": key("final_logit_softcapping", None),
        "hidden_size_per_layer_input": int(key("embedding_length_per_layer_input", 0)),
        "num_kv_shared_layers": int(key("attention.shared_kv_layers", 0)),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa"))},
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": float(key("rope.freq_base")),
                "partial_rotary_factor": 2 * turned / global_dim,
            },
        },
    }
