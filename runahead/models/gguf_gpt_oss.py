"""gpt-oss in GGUF (``gpt-oss``): llama.cpp's expert layout, both ways.

transformers keeps gpt-oss's experts transposed with gate and up interleaved (``gate_up_proj
[E, H, 2I]``, ``down_proj [E, I, H]``, biases ``[E, 2I]`` / ``[E, H]``); ``convert_hf_to_gguf.py``
(``GptOssModel``) writes them split and in ggml's orientation: ``ffn_gate_exps`` / ``ffn_up_exps``
``[E, I, H]`` (the even / odd columns), ``ffn_down_exps [E, H, I]``, and the biases as
``ffn_{gate,up,down}_exps.bias``; the attention sinks as ``attn_sinks.weight``. The hub's MXFP4
experts it repacks into ggml's MXFP4; ``runahead convert`` takes only dequantized checkpoints (it
refuses ``*_blocks`` / ``*_scales`` by name) and writes the requested type, while the loader reads
MXFP4 experts as stored (:mod:`runahead.models.quant`).

The GGUF has no keys for the clamped SwiGLU's constants: llama.cpp always uses ``alpha = 1.702`` and
``limit = 7.0`` (the published models' values), and so does a model loaded from GGUF. YaRN RoPE is
read from the ``rope.scaling.*`` keys; its correction range is truncated, as ggml computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

ARCH = "gpt-oss"
Array = np.ndarray[Any, Any]


def expert_tensors(name: str, x: Array, layer: int) -> Iterator[tuple[str, Array]]:
    """``(GGUF name, data)`` of one of transformers' stacked gpt-oss expert tensors."""
    p = f"blk.{layer}."
    if name.endswith(("_blocks", "_scales")):
        raise ValueError(
            f"tensor {name} is MXFP4: convert a dequantized checkpoint (transformers' "
            "Mxfp4Config(dequantize=True), then save_pretrained)"
        )
    if name.endswith("gate_up_proj"):  # [E, H, 2I] -> [E, 2I, H]: gate the even rows, up the odd
        t = np.swapaxes(x, -1, -2)
        yield p + "ffn_gate_exps.weight", np.ascontiguousarray(t[:, ::2])
        yield p + "ffn_up_exps.weight", np.ascontiguousarray(t[:, 1::2])
    elif name.endswith("gate_up_proj_bias"):
        yield p + "ffn_gate_exps.bias", np.ascontiguousarray(x[..., ::2])
        yield p + "ffn_up_exps.bias", np.ascontiguousarray(x[..., 1::2])
    elif name.endswith("down_proj"):
        yield p + "ffn_down_exps.weight", np.ascontiguousarray(np.swapaxes(x, -1, -2))
    elif name.endswith("down_proj_bias"):
        yield p + "ffn_down_exps.bias", x
    else:
        raise ValueError(f"expert tensor {name} is not one of gpt-oss's")


def hf_experts(name: str, stored: Callable[[str], Array], layer: int) -> Array:
    """transformers' stacked tensor ``name`` rebuilt from the GGUF's (``stored(gguf name)``: float32)."""
    p = f"blk.{layer}."
    if name.endswith("gate_up_proj"):
        gate, up = stored(p + "ffn_gate_exps.weight"), stored(p + "ffn_up_exps.weight")
        both = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])  # [E, 2I, H]
        return np.ascontiguousarray(np.swapaxes(both, -1, -2))
    if name.endswith("gate_up_proj_bias"):
        gate, up = stored(p + "ffn_gate_exps.bias"), stored(p + "ffn_up_exps.bias")
        return np.stack([gate, up], axis=-1).reshape(gate.shape[0], -1)
    if name.endswith("down_proj"):
        return np.ascontiguousarray(np.swapaxes(stored(p + "ffn_down_exps.weight"), -1, -2))
    return stored(p + "ffn_down_exps.bias")


def add_metadata(writer: Any, config: dict[str, Any]) -> None:
    """The keys ``GptOssModel`` adds to the common ones."""
    writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_expert_feed_forward_length(int(config["intermediate_size"]))


def raw_config(key: Any) -> dict[str, Any]:
    """``config.json`` keys of gpt-oss from the metadata (``key(name, default)`` reads ``gpt-oss.<name>``)."""
    raw: dict[str, Any] = {
        "sliding_window": int(key("attention.sliding_window")),
        "intermediate_size": int(key("expert_feed_forward_length")),
        "attention_bias": True,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    }
    theta = float(key("rope.freq_base", 150000.0))
    if key("rope.scaling.type", "none") == "yarn":
        raw["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": True,
        }
    else:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return raw
