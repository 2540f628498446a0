"""``runahead convert``: a Hugging Face MoE folder to a GGUF file in llama.cpp's layout.

What llama.cpp's ``convert_hf_to_gguf.py`` writes for the same checkpoint, written with the ``gguf``
package's ``GGUFWriter``: tensor names from ``gguf``'s own ``TensorNameMap`` (``token_embd``,
``blk.N.attn_q``, the router ``ffn_gate_inp``, ...), each layer's routed experts stacked into
``blk.N.ffn_{gate,up,down}_exps`` (from per-expert tensors or transformers' stacked ``gate_up_proj``),
llama's q/k rows permuted for its interleaved RoPE, the ``<arch>.*`` and ``general.*`` metadata, and
the tokenizer (byte-level BPE as ``gpt2``: tokens, token types, merges, special ids, chat template;
Gemma 4's BPE with byte fallback as ``gemma4``).
Per-architecture changes live in their own modules: :mod:`~runahead.models.gguf_qwen35`,
:mod:`~runahead.models.gguf_gpt_oss`, :mod:`~runahead.models.gguf_gemma4` (experts kept fused as
``ffn_gate_up_exps``).

Types follow the converter's rules: 1-D tensors, norms, biases and the routers stay F32; every other
matrix takes the requested type. ``F32``, ``F16`` and ``Q8_0`` are the converter's ``--outtype``;
``Q4_0`` (which the converter leaves to ``llama-quantize``) is what ``llama-quantize --pure ... Q4_0``
makes of the F32 file: every such matrix Q4_0. ``gguf.quants`` quantizes bit-identically to llama.cpp;
a matrix whose rows are not whole blocks falls back to F16, as in the converter.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from runahead.models import gguf_gemma4, gguf_gpt_oss, gguf_qwen35

log = logging.getLogger(__name__)

KINDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}
"""Types ``convert`` writes matrices in -> ``general.file_type`` (llama.cpp's ``LlamaFileType``)."""

ARCHITECTURES = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "olmoe": "olmoe",
    "mixtral": "llama",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_5_moe_text": "qwen35moe",
    "gpt_oss": "gpt-oss",
    **dict.fromkeys(gguf_gemma4.MODEL_TYPES, gguf_gemma4.ARCH),
}
"""``config.json``'s ``model_type`` -> the GGUF architecture llama.cpp's converter writes."""

PRE_TOKENIZER = {
    "qwen3_moe": "qwen2",
    "qwen2_moe": "qwen2",
    "olmoe": "olmo",
    "mixtral": "default",
    "qwen3_5_moe": "qwen35",
    "qwen3_5_moe_text": "qwen35",
    "gpt_oss": "gpt-4o",
}
"""``tokenizer.ggml.pre`` per ``model_type`` (the converter finds it by hashing the tokenizer's output
on a test text; these are its answers for the architectures' published tokenizers)."""

_EXPERT_PARTS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_F32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
_SKIPPED = (
    "mtp.",
    "model.visual.",
    "model.audio_tower.",
    "model.vision_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)
"""Tensors not written: multi-token prediction layers and the vision / audio towers."""


class ConvertError(ValueError):
    """The folder cannot be converted; the message names the file, key or tensor at fault."""


def _first(config: dict[str, Any], *keys: str, default: Any = ConvertError) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is ConvertError:
        raise ConvertError(f"config.json lacks {' / '.join(keys)}")
    return default


def read_hf_config(folder: Path) -> dict[str, Any]:
    """``config.json`` (a multimodal wrapper's ``text_config``), with ``model_type`` checked."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder}: no config.json (not a Hugging Face model folder)")
    config: dict[str, Any] = json.loads(path.read_text())
    if isinstance(config.get("text_config"), dict):  # a multimodal wrapper: its text model
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    model_type = str(config.get("model_type"))
    if model_type not in ARCHITECTURES:
        raise ConvertError(
            f"{path}: model_type {model_type!r} is not supported; convertible: {', '.join(ARCHITECTURES)}"
        )
    return config


def _tensors(folder: Path) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    """Every tensor of the folder's safetensors files, float32 numpy (bf16 / f16 widened exactly)."""
    import torch
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{folder}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(_SKIPPED):
                    continue
                data = handle.get_tensor(name).to(torch.float32).numpy()
                yield name.replace("model.language_model.", "model.", 1), data


def _permute(w: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """The converter's ``LlamaModel.permute``: q/k rows reordered for llama.cpp's interleaved RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_alias(name: str) -> str:
    """The name the converter gives an HF tensor before mapping it (``dt_bias``, gpt-oss's ``sinks``,
    Gemma 4's ``layer_scalar``)."""
    if name.endswith(".dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias"
    if name.endswith(("self_attn.sinks", ".layer_scalar")):
        return name + ".weight"
    return name


def gguf_name(name: str, config: dict[str, Any]) -> str:
    """The GGUF name of the non-expert HF tensor ``name`` (``gguf``'s ``TensorNameMap``, as the converter)."""
    import gguf

    arch = ARCHITECTURES[config["model_type"]]
    if arch == gguf_gemma4.ARCH and (own := gguf_gemma4.gguf_name(name)) is not None:
        return own
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_arch_enum(arch)], int(config["num_hidden_layers"]))
    target = names.get_name(hf_alias(name), try_suffixes=(".weight", ".bias"))
    if target is None:
        raise ConvertError(f"tensor {name} has no GGUF name for {arch}")
    return str(target)


def expert_part(name: str) -> tuple[int, int | None, str] | None:
    """``(layer, expert or None when stacked, role)`` of an expert tensor's HF name; None for others.

    Roles: ``gate``, ``up``, ``down``, or ``gate_up`` (transformers 5's stacked ``[E, 2I, H]``).
    """
    parts = name.split(".")
    if "experts" not in parts or "layers" not in parts:
        return None
    layer, tail = int(parts[parts.index("layers") + 1]), parts[parts.index("experts") + 1 :]
    if tail and tail[0].isdigit() and len(tail) > 1 and tail[1] in _EXPERT_PARTS:
        return layer, int(tail[0]), _EXPERT_PARTS[tail[1]]
    if tail and tail[0] in ("gate_up_proj", "down_proj"):
        return layer, None, tail[0].removesuffix("_proj")
    raise ConvertError(f"expert tensor {name} is not in a layout convert knows")


def q_k_permutation(target: str, config: dict[str, Any]) -> int:
    """Heads to permute GGUF tensor ``target``'s rows by (llama's q/k for interleaved RoPE), else 0."""
    if ARCHITECTURES[config["model_type"]] != "llama":
        return 0
    heads = int(config["num_attention_heads"])
    if target.endswith("attn_q.weight"):
        return heads
    if target.endswith("attn_k.weight"):
        return int(config.get("num_key_value_heads") or heads)
    return 0


def gguf_tensors(folder: Path, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    """``(GGUF name, float32 data)`` of every tensor, experts stacked per layer and role."""
    experts = int(_first(config, "num_local_experts", "num_experts"))
    pending: dict[tuple[int, str], dict[int, np.ndarray[Any, Any]]] = {}
    qwen35 = ARCHITECTURES[config["model_type"]] == gguf_qwen35.ARCH
    gpt_oss = ARCHITECTURES[config["model_type"]] == gguf_gpt_oss.ARCH
    gemma4 = ARCHITECTURES[config["model_type"]] == gguf_gemma4.ARCH
    if gemma4:
        yield gguf_gemma4.rope_freqs(config)
    for name, value in _tensors(folder):
        if gpt_oss and ".experts." in name:
            try:
                yield from gguf_gpt_oss.expert_tensors(name, value, int(name.split(".")[2]))
            except ValueError as err:
                raise ConvertError(f"{folder}: {err}") from None
            continue
        part = expert_part(name)
        if part is None:
            if qwen35:
                name, value = gguf_qwen35.to_gguf(name, value, config)
            target = gguf_name(name, config)
            if heads := q_k_permutation(target, config):
                value = _permute(value, heads)
            yield target, value
            continue
        layer, expert, role = part
        if role == "gate_up" and gemma4:  # kept fused, as transformers stacks it
            yield f"blk.{layer}.ffn_gate_up_exps.weight", value
        elif role == "gate_up":  # gate rows, then up rows
            half = value.shape[-2] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(value[..., :half, :])
            yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(value[..., half:, :])
        elif expert is None:
            yield f"blk.{layer}.ffn_{role}_exps.weight", value
        else:
            group = pending.setdefault((layer, role), {})
            group[expert] = value
            if len(group) == experts:
                yield f"blk.{layer}.ffn_{role}_exps.weight", np.stack([group[e] for e in range(experts)])
                del pending[layer, role]
    if pending:
        layer, role = next(iter(pending))
        raise ConvertError(
            f"{folder}: layer {layer} has {len(pending[layer, role])} of {experts} experts' {role}"
        )


def _arch_enum(arch: str) -> str:
    """``gguf.MODEL_ARCH`` member name of a GGUF architecture name."""
    import gguf

    return next(a.name for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)


def tensor_kind(name: str, data: np.ndarray[Any, Any], kind: str) -> str:
    """The type the converter stores tensor ``name`` in when the file's type is ``kind``."""
    if data.ndim <= 1 or name.endswith(_F32_SUFFIXES) or not name.endswith(".weight"):
        return "F32"
    if kind.startswith("Q") and data.shape[-1] % 32:
        return "F16"  # the converter's fallback for rows that are not whole blocks
    return kind


def _add_metadata(writer: Any, folder: Path, config: dict[str, Any], kind: str) -> None:
    """``general.*`` and ``<arch>.*`` keys as the converter's ``set_gguf_parameters`` writes them."""
    import gguf

    arch = ARCHITECTURES[config["model_type"]]
    writer.add_type("model")
    writer.add_name(folder.resolve().name)
    writer.add_quantization_version(2)  # GGML_QNT_VERSION
    writer.add_file_type(KINDS[kind])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    if config.get("intermediate_size") is not None:
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    if config.get("num_key_value_heads") is not None and arch != gguf_gemma4.ARCH:  # gemma4: per layer
        writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "linear" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for name, add in (
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(name) is not None:
                add(rope[name])
    elif rope_type not in (None, "default", "mrope"):
        raise ConvertError(
            f"{folder / 'config.json'}: RoPE scaling {rope_type!r} is not converted (only linear)"
        )
    theta = config.get("rope_theta") or rope.get("rope_theta")
    if theta is not None:
        writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else config["rms_norm_eps"])
    writer.add_expert_count(_first(config, "num_local_experts", "num_experts"))
    writer.add_expert_used_count(_first(config, "num_experts_per_tok", "top_k_experts"))
    if config.get("head_dim") is not None and arch != gguf_gemma4.ARCH:  # gemma4: global and sliding
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch in ("qwen2moe", "qwen3moe", gguf_qwen35.ARCH):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == gguf_qwen35.ARCH:
        gguf_qwen35.add_metadata(writer, config)
    if arch == gguf_gpt_oss.ARCH:
        gguf_gpt_oss.add_metadata(writer, config)
    if arch == gguf_gemma4.ARCH:
        gguf_gemma4.add_metadata(writer, config)
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(
            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        )


def _add_tokenizer(writer: Any, folder: Path, config: dict[str, Any], pre: str | None) -> None:
    """The converter's ``_set_vocab_gpt2``: a byte-level BPE vocabulary, its merges, special ids and
    chat template (Gemma 4: :func:`runahead.models.gguf_gemma4.add_tokenizer`);
    ``tokenizer.ggml.model = none`` for a folder without ``tokenizer.json``."""
    import gguf

    if not (folder / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: writing no vocabulary (tokenizer.ggml.model = none)", folder)
        writer.add_tokenizer_model("none")
        return
    if ARCHITECTURES[config["model_type"]] == gguf_gemma4.ARCH:
        try:
            return gguf_gemma4.add_tokenizer(writer, folder)
        except ValueError as err:
            raise ConvertError(
                f"{err}; convert without a vocabulary (--no-vocab) to write the weights alone"
            ) from None
    raw = json.loads((folder / "tokenizer.json").read_text())
    model = raw.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ConvertError(
            f"{folder / 'tokenizer.json'}: only byte-level BPE tokenizers are converted (this one is "
            f"{model.get('type')}{' with byte fallback' if model.get('byte_fallback') else ''}); "
            "convert without a vocabulary (--no-vocab) to write the weights alone"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    size = int(config.get("vocab_size") or len(tokenizer.vocab))
    by_id = {index: token for token, index in tokenizer.vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            looks_special = token.startswith("<|") and token.endswith("|>")
            tokens.append(token)
            types.append(
                gguf.TokenType.CONTROL
                if added[index].special or looks_special
                else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or PRE_TOKENIZER[config["model_type"]])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True)
    processors = raw.get("post_processor") or {}
    if any(p.get("type") == "ByteLevel" for p in processors.get("processors", [processors])):
        # llama.cpp's newer gguf-py reads a ByteLevel post-processor as adding neither BOS nor EOS
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(writer, quiet=True)


def convert(
    folder: str | Path,
    out: str | Path,
    kind: str = "Q4_0",
    *,
    split_max_tensors: int = 0,
    split_max_size: int = 0,
    pre_tokenizer: str | None = None,
    vocab: bool = True,
) -> list[Path]:
    """Write the HF model in ``folder`` as a GGUF at ``out`` with matrices (experts included) as ``kind``.

    ``split_max_tensors`` / ``split_max_size`` (bytes) > 0 write split files
    (``<out stem>-0000K-of-0000N.gguf``, as ``gguf-split`` names them). ``pre_tokenizer`` overrides
    ``tokenizer.ggml.pre``; ``vocab=False`` writes no vocabulary (``tokenizer.ggml.model = none``).
    Returns the files written.
    Raises :class:`ConvertError` naming what cannot be converted.
    """
    import gguf

    folder, out = Path(folder), Path(out)
    kind = kind.upper()
    if kind not in KINDS:
        raise ConvertError(f"type {kind!r} is not written; choose one of {', '.join(KINDS)}")
    config = read_hf_config(folder)
    split = bool(split_max_tensors or split_max_size)
    writer = gguf.GGUFWriter(
        out,
        ARCHITECTURES[config["model_type"]],
        split_max_tensors=split_max_tensors,
        split_max_size=split_max_size,
        use_temp_file=not split,  # bounded memory; the writer's spill file serves one output file only
    )
    _add_metadata(writer, folder, config, kind)
    if vocab:
        _add_tokenizer(writer, folder, config, pre_tokenizer)
    else:
        writer.add_tokenizer_model("none")
    for name, data in gguf_tensors(folder, config):
        chosen = tensor_kind(name, data, kind)
        if chosen == "F32":
            writer.add_tensor(name, data)
        elif chosen == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[chosen]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    total, shared, expert, count = writer.get_total_parameter_count()
    writer.add_size_label(gguf.size_label(total, shared, expert, count))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if not split:
        return [out]
    shards = len(writer.tensors)
    return [out.with_name(f"{out.stem}-{k:05d}-of-{shards:05d}.gguf") for k in range(1, shards + 1)]
