"""Qwen2-MoE on MLX: q/k/v biases and a sigmoid-gated shared expert, both read from the config by
:class:`runahead.models.mlx.base.MLXModel` (:meth:`~runahead.models.mlx.base.MLXModel.moe_finish`)."""

from __future__ import annotations

from runahead.models.mlx.base import MLXModel


class Qwen2MoeMLX(MLXModel):
    """Qwen2-MoE: everything it differs by is in its config (see :mod:`runahead.models.qwen2_moe`)."""
