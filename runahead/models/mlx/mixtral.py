"""Mixtral on MLX: the plain decoder; the router takes the top-k logits, then a softmax over those k.

mlx-lm ignores ``sliding_window``; this model applies it as transformers does (the released
Mixtral configs have none, so the two agree on them).
"""

from __future__ import annotations

import mlx.core as mx

from runahead.models.mlx.base import MLXModel


class MixtralMLX(MLXModel):
    """Mixtral (see :class:`runahead.models.mlx.base.MLXModel`)."""

    def route(
        self, layer: int, hidden: mx.array, normed: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """The top-k router logits (mlx-lm's order), softmaxed over the k."""
        p, k = f"{layer}.", self.config.top_k
        gates = self.linear(self.post_normed(layer, hidden, normed), p + "router")
        ids = mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k]
        scores = mx.softmax(mx.take_along_axis(gates, ids, axis=-1), axis=-1, precise=True)
        return ids, scores
