"""Qwen3.5 / Qwen3.6 MoE in GGUF (``qwen35moe``): what llama.cpp's converter changes, both ways.

``convert_hf_to_gguf.py`` (``Qwen3_5MoeTextModel``: ``Qwen3NextModel`` plus the V-head reordering
base) writes the Gated DeltaNet layers as ``attn_qkv`` (``in_proj_qkv``), ``attn_gate``
(``in_proj_z``), ``ssm_beta`` / ``ssm_alpha`` (``in_proj_b`` / ``in_proj_a``), ``ssm_conv1d``
(the depthwise kernel squeezed to ``[C, K]``), ``ssm_dt.bias`` (``dt_bias``), ``ssm_a``
(``-exp(A_log)``), ``ssm_norm`` and ``ssm_out``; every RMSNorm weight but ``ssm_norm`` as ``1 + w``
(llama.cpp scales by the stored weight); and, when there are more value heads than key heads, the
value heads reordered from grouped (by key head) to tiled order in every tensor that has them. The
metadata adds the ``ssm.*`` sizes, ``attention.recurrent_layers``, ``full_attention_interval``, the
rotated dimensions and the M-RoPE sections.

:func:`to_gguf` applies those changes to one HF tensor (before its name is mapped);
:func:`from_gguf` undoes them for the loader (the reordering exactly; ``A_log = log(-ssm_a)`` and
``w = stored - 1`` to float32 rounding, so the reference for exactness is the dequantized file).
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCH = "qwen35moe"
MROPE_DEFAULT = [11, 11, 10, 0]
"""The M-RoPE sections the converter writes when the config has none (llama.cpp requires them)."""

Array = np.ndarray[Any, Any]


def _heads(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """``(key heads, value heads per key head, key head dim, value head dim)``."""
    k, v = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    return k, v // k, int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])


def _reorder(x: Array, axis: int, groups: int, per: int, dim: int, inverse: bool = False) -> Array:
    """Value heads along ``axis`` from grouped ``[groups, per, dim]`` to tiled ``[per, groups, dim]``
    order (``inverse``: back)."""
    x = np.moveaxis(x, axis, 0)
    first, second = (per, groups) if inverse else (groups, per)
    x = x.reshape(first, second, dim, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def moves(name: str, config: dict[str, Any]) -> bool:
    """Whether the converter may reorder HF tensor ``name``'s values (its value heads): only
    linear-attention tensors, and only with more than one value head per key head."""
    return _heads(config)[1] != 1 and "linear_attn." in name


def _value_heads(name: str, x: Array, config: dict[str, Any], inverse: bool) -> Array:
    """The converter's value-head reordering of one linear-attention tensor (or its inverse)."""
    k, per, kd, vd = _heads(config)
    if not moves(name, config):
        return x
    if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
        qk = 2 * k * kd
        return np.concatenate([x[:qk], _reorder(x[qk:], 0, k, per, vd, inverse)])
    if name.endswith("in_proj_z.weight"):
        return _reorder(x, 0, k, per, vd, inverse)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return _reorder(x, 0, k, per, 1, inverse)
    if name.endswith("out_proj.weight"):
        return _reorder(x, 1, k, per, vd, inverse)
    return x


def _one_plus(name: str) -> bool:
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def to_gguf(name: str, x: Array, config: dict[str, Any]) -> tuple[str, Array]:
    """``(HF name for the name map, data)`` of one HF tensor as the converter stores it."""
    x = _value_heads(name, x, config, inverse=False)
    if name.endswith(".A_log"):
        import torch  # torch's exp, as the converter computes it (numpy's differs in the last bit)

        return name, (-torch.exp(torch.from_numpy(x))).numpy()
    if name.endswith(".dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias", x
    if name.endswith("conv1d.weight"):
        return name, np.ascontiguousarray(x.reshape(x.shape[0], x.shape[-1]))
    if _one_plus(name):
        return name, x + np.float32(1)
    return name, x


def from_gguf(name: str, x: Array, config: dict[str, Any], shape: tuple[int, ...]) -> Array:
    """The HF tensor ``name`` (of ``shape``) back from the GGUF's float32 data ``x``."""
    if name.endswith(".A_log"):
        x = np.log(-x)
    elif _one_plus(name):
        x = x - np.float32(1)
    x = x.reshape(shape)
    if name.endswith("conv1d.weight"):
        x = x.reshape(shape[0], -1)  # reorder along channels of the squeezed kernel
        return _value_heads(name, x, config, inverse=True).reshape(shape)
    return _value_heads(name, x, config, inverse=True)


def layer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's kind, from ``layer_types`` or every ``full_attention_interval``-th layer full."""
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        return [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(int(config["num_hidden_layers"]))
        ]
    return [str(t) for t in types]


def add_metadata(writer: Any, config: dict[str, Any]) -> None:
    """The keys ``Qwen3NextModel`` / ``_Qwen35MRopeMixin`` add to the common ones."""
    k, per, kd, vd = _heads(config)
    writer.add_ssm_conv_kernel(int(config["linear_conv_kernel_dim"]))
    writer.add_ssm_state_size(kd)
    writer.add_ssm_group_count(k)
    writer.add_ssm_time_step_rank(k * per)
    writer.add_ssm_inner_size(vd * k * per)
    recurrent = [t == "linear_attention" for t in layer_types(config)]
    writer.add_array(f"{ARCH}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(int(config.get("full_attention_interval", 4)))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_rope_dimension_count(int(head_dim * partial))
    sections = list(rope.get("mrope_section", MROPE_DEFAULT))
    writer.add_rope_dimension_sections([*sections, 0, 0, 0, 0][:4])


def raw_config(key: Any, blocks: int) -> dict[str, Any]:
    """``config.json`` keys of the linear attention from the metadata (``key(name, default)`` reads
    ``qwen35moe.<name>``)."""
    k, value_heads = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    recurrent = key("attention.recurrent_layers", None)
    if recurrent is None:
        interval = int(key("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(blocks)]
    head_dim = int(key("attention.key_length"))
    return {
        "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:blocks]],
        "linear_num_key_heads": k,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length")),
        "partial_rotary_factor": int(key("rope.dimension_count", head_dim // 4)) / head_dim,
    }
