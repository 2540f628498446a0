"""OLMoE (OLMoE-1B-7B): RMSNorm over the whole q and k projections, optional q/k/v clipping.

Differs from the common decoder in :mod:`runahead.models.base` by q/k norms applied to the full
projection (``[heads * head_dim]``, before splitting into heads and before RoPE) and by
``clip_qkv``, which clamps q, k and v after the norms. Routing: softmax, top-k, renormalised only
when ``norm_topk_prob`` (False in OLMoE-1B-7B). Experts are ``intermediate_size`` wide; checkpoints
use the hub's ``mlp.experts.E.{gate,up,down}_proj`` names or the stacked form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from runahead.models.base import MoEConfig, MoEModel, require


class OlmoeModel(MoEModel):
    """OLMoE, split into the runtime's jobs (see :class:`runahead.models.base.MoEModel`)."""

    model_type: ClassVar[str] = "olmoe"

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse an OLMoE ``config.json``."""
        bias = bool(raw.get("attention_bias", False))
        clip = raw.get("clip_qkv")
        return MoEConfig.from_dict(
            raw,
            intermediate_size=int(require(raw, "intermediate_size")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            qk_norm="full",
            clip_qkv=float(clip) if clip is not None else None,
            qkv_bias=bias,
            o_bias=bias,
        )
