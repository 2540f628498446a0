"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, the paper's family).

Differs from the common decoder in :mod:`runahead.models.base` by a per-head RMSNorm on q and k
(over ``head_dim``, before RoPE), and experts ``moe_intermediate_size`` wide. Routing: softmax over
all experts, top-k, renormalised when ``norm_topk_prob`` (True in the released models, False in
transformers' default config). No shared expert. Checkpoints: ``model.layers.L.mlp.experts.E.*``
(hub) or stacked ``mlp.experts.gate_up_proj`` / ``down_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from runahead.models.base import MoEConfig, MoEModel, require


class Qwen3MoeModel(MoEModel):
    """Qwen3-MoE, split into the runtime's jobs (see :class:`runahead.models.base.MoEModel`)."""

    model_type: ClassVar[str] = "qwen3_moe"

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse a Qwen3-MoE ``config.json``; the sliding window applies only with ``use_sliding_window``."""
        bias = bool(raw.get("attention_bias", False))
        return MoEConfig.from_dict(
            raw,
            intermediate_size=int(require(raw, "moe_intermediate_size")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            qk_norm="head",
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None,
        )
