"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases and a sigmoid-gated shared expert.

Differs from the common decoder in :mod:`runahead.models.base` by biases on the q, k and v
projections (``qkv_bias``, True unless a config says otherwise; none on o), and by a shared expert
(``shared_expert_intermediate_size`` wide) that every token runs, scaled by
``sigmoid(shared_expert_gate(x))`` and added to the routed experts' sum. The shared expert is
resident. Routing: softmax, top-k, renormalised only when ``norm_topk_prob`` (False in the
released models). Routed experts are ``moe_intermediate_size`` wide.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from runahead.models.base import ModelLoadError, MoEConfig, MoEModel, require


class Qwen2MoeModel(MoEModel):
    """Qwen2-MoE, split into the runtime's jobs (see :class:`runahead.models.base.MoEModel`)."""

    model_type: ClassVar[str] = "qwen2_moe"

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse a Qwen2-MoE ``config.json``; a sliding window (on some layers only) is refused."""
        if raw.get("use_sliding_window"):
            raise ModelLoadError("qwen2_moe with use_sliding_window is not supported")
        return MoEConfig.from_dict(
            raw,
            intermediate_size=int(require(raw, "moe_intermediate_size")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_expert_size=int(require(raw, "shared_expert_intermediate_size")),
            shared_expert_gate=True,
            qkv_bias=bool(raw.get("qkv_bias", True)),
        )
