"""gpt-oss on MLX: expert biases, clamped SwiGLU, attention sinks, YaRN RoPE.

The arithmetic of :mod:`runahead.models.gpt_oss` on MLX. The experts' pools hold them as transformers
stores them (``gate_up_t [H, 2I]`` with gate and up interleaved, ``down_t [I, H]`` and both biases),
so a group's experts are two ``mx.gather_mm`` over slot indices plus gathered biases. Attention
passes the layer's sinks to ``mx.fast.scaled_dot_product_attention``; YaRN's interpolated
frequencies go to ``mx.fast.rope`` as periods and its attention factor scales q and k after RoPE.

Hugging Face folders with dequantized (float) experts only: the hub's MXFP4 experts are refused by
the loader, as on the torch backend, and mlx-lm's gpt-oss folders (which mlx-lm makes only from
those MXFP4 tensors) by :func:`runahead.models.mlx.checkpoint.load_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from runahead.models.description import ModelLoadError
from runahead.models.mlx.base import MLXModel
from runahead.models.mlx.checkpoint import Checkpoint


class GptOssMLX(MLXModel):
    """gpt-oss (see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        if self.quant:
            raise ModelLoadError("quantized gpt_oss folders do not run on the mlx backend yet")
        c: Any = self.config
        self.rope_factor = 1.0
        inv_freq = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float32) / c.head_dim)
        if c.yarn_factor != 1.0:
            import torch

            from runahead.models.gpt_oss import _yarn

            yarn, self.rope_factor = _yarn(c, torch.device("cpu"))
            inv_freq = yarn.numpy()
        self.periods = mx.array(1.0 / inv_freq)

    def rope(self, x: mx.array, offset: int, layer: int) -> mx.array:
        """YaRN RoPE: its frequencies as periods, cos and sin scaled by the attention factor."""
        out = mx.fast.rope(
            x, x.shape[-1], traditional=False, base=None, scale=1.0, offset=offset, freqs=self.periods
        )
        return out if self.rope_factor == 1.0 else out * self.rope_factor

    def attend(self, layer: int, q: mx.array, keys: mx.array, values: mx.array, mask: Any) -> mx.array:
        """Attention with the layer's sinks (one extra logit per head, dropped after the softmax)."""
        sinks = self.weights[f"{layer}.sinks"].astype(q.dtype)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask, sinks=sinks)

    def route(
        self, layer: int, hidden: mx.array, normed: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """Top-k of the router's logits (with its bias), softmaxed over just those k."""
        k = self.config.top_k
        logits = self.linear(self.post_normed(layer, hidden, normed), f"{layer}.router")
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        return ids, mx.softmax(mx.take_along_axis(logits, ids, axis=-1), axis=-1, precise=True)

    def moe_products(
        self,
        layer: int,
        hidden: mx.array,
        slots: mx.array,
        weights: mx.array,
        pools: Mapping[str, mx.array],
        normed: mx.array | None = None,
    ) -> tuple[mx.array, Any]:
        """The clamped-SwiGLU experts as stored, over slot indices: ``x @ gate_up + b``, then down."""
        c: Any = self.config
        x = self.switch_input(layer, hidden, normed)
        gate_up = mx.gather_mm(x, pools["gate_up_t.weight"], rhs_indices=slots)
        gate_up = gate_up + pools["gate_up_bias.weight"][slots][..., None, :]
        gate = mx.minimum(gate_up[..., ::2], c.swiglu_limit)
        up = mx.clip(gate_up[..., 1::2], -c.swiglu_limit, c.swiglu_limit)
        glu = (up + 1) * (gate * mx.sigmoid(gate * c.swiglu_alpha))
        y = mx.gather_mm(glu, pools["down_t.weight"], rhs_indices=slots)
        y = (y + pools["down_bias.weight"][slots][..., None, :]).squeeze(-2)
        return y * weights[..., None], y.dtype
