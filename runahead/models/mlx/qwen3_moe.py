"""Qwen3-MoE on MLX: per-head q/k norms (the config's ``qk_norm="head"``) and mlx-lm's Qwen3 router."""

from __future__ import annotations

import mlx.core as mx

from runahead.models.mlx.base import MLXModel


class Qwen3MoeMLX(MLXModel):
    """Qwen3-MoE (see :class:`runahead.models.mlx.base.MLXModel`)."""

    def route(
        self, layer: int, hidden: mx.array, normed: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """Softmax over all experts, the top k (in mlx-lm's order), renormalised if ``norm_topk_prob``."""
        c, p = self.config, f"{layer}."
        gates = mx.softmax(
            self.linear(self.post_normed(layer, hidden, normed), p + "router"), axis=-1, precise=True
        )
        ids = mx.argpartition(gates, kth=-c.top_k, axis=-1)[..., -c.top_k :]
        scores = mx.take_along_axis(gates, ids, axis=-1)
        if c.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return ids, scores
