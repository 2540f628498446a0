"""OLMoE on MLX: q/k norms over the whole projections (``qk_norm="full"``), optional q/k/v clipping;
the shared router of :class:`runahead.models.mlx.base.MLXModel` (softmax, top-k, optional renorm)."""

from __future__ import annotations

from runahead.models.mlx.base import MLXModel


class OlmoeMLX(MLXModel):
    """OLMoE: everything it differs by is in its config (see :mod:`runahead.models.olmoe`)."""
