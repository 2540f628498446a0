"""Mixtral (Mixtral-8x7B, 8x22B): the plain decoder with a sliding window and always-renormalised top-k.

No q/k norm, no biases, no shared expert. Routing: softmax over all experts, top-k, always
renormalised over the k. Attention may slide (``sliding_window``; ``None`` in the released
configs). Checkpoints name the MoE block ``block_sparse_moe`` with experts' ``w1`` (gate), ``w3``
(up), ``w2`` (down); transformers' stacked form uses ``mlp.experts.gate_up_proj`` / ``down_proj``
and ``mlp.gate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from runahead.models.base import MoEConfig, MoEModel, require


class MixtralModel(MoEModel):
    """Mixtral, split into the runtime's jobs (see :class:`runahead.models.base.MoEModel`)."""

    model_type: ClassVar[str] = "mixtral"
    moe_prefixes: ClassVar[tuple[str, ...]] = ("block_sparse_moe", "mlp")
    expert_matrices: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse a Mixtral ``config.json``: experts are ``intermediate_size`` wide."""
        window = raw.get("sliding_window")
        return MoEConfig.from_dict(
            raw,
            intermediate_size=int(require(raw, "intermediate_size")),
            norm_topk_prob=True,
            sliding_window=int(window) if window else None,
        )
