"""Gemma 4 MoE on MLX (the paper's second model): a dense GeGLU MLP beside the routed experts.

The arithmetic of :mod:`runahead.models.gemma4` (which the torch backend runs and the tests hold to
transformers), on MLX: sliding layers with ``head_dim`` heads and default RoPE, global layers with
``global_head_dim`` heads (K reused as V where ``attention_k_eq_v``) and proportional RoPE over part
of each head; q/k norms, a weightless v norm, unscaled scores, a normed attention output; the router
on the residual (weightless norm, learnt scale, softmax top-k renormalised, per-expert scales);
GeGLU experts read ``pre_feedforward_layernorm_2``; the layer's end adds the normed sum of the
dense MLP and the experts and scales by ``layer_scalar``; logits are soft-capped.

Hugging Face folders and mlx-lm's conversions of them (float or quantized; experts under
``experts.switch_glu``, the checkpoint's names otherwise unchanged).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from runahead.models.mlx.base import MLXModel
from runahead.models.mlx.checkpoint import Checkpoint


class Gemma4MLX(MLXModel):
    """Gemma 4 MoE (see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        c: Any = self.config
        self.arch: Any = checkpoint.arch
        angles = int(c.full_rotary_fraction * c.global_head_dim // 2)
        turned = mx.arange(0, 2 * angles, 2, dtype=mx.float32) / c.global_head_dim
        still = mx.full((c.global_head_dim // 2 - angles,), mx.inf)
        # mx.fast.rope's ``freqs`` are periods (1 / inverse frequency); an infinite one never turns.
        self.periods = {
            "sliding_attention": c.sliding_rope_theta
            ** (mx.arange(0, c.head_dim, 2, dtype=mx.float32) / c.head_dim),
            "full_attention": mx.concatenate([c.full_rope_theta**turned, still]),
        }
        # in the dtype the embedding's rows come in (a quantized table's: its scales', not uint32)
        rows = self.weights.get("embed.scales", self.weights["embed"])
        self.embed_scale = mx.array(c.hidden_size**0.5, dtype=rows.dtype)
        self.scale = 1.0  # the q/k norms set the scores' size
        mx.eval(list(self.periods.values()))

    def kv_heads(self, layer: int) -> int:
        """Sliding layers' ``num_key_value_heads``; global layers' own count."""
        return int(self.arch.heads(self.config, layer)[0])

    def embed(self, tokens: mx.array) -> mx.array:
        """Embeddings scaled by ``sqrt(hidden_size)`` in the weights' dtype."""
        return super().embed(tokens) * self.embed_scale

    def rope(self, x: mx.array, offset: int, layer: int) -> mx.array:
        """Default RoPE on sliding layers, proportional (part of each head) on global ones."""
        periods = self.periods[self.config.layer_types[layer]]
        return mx.fast.rope(
            x, x.shape[-1], traditional=False, base=None, scale=1.0, offset=offset, freqs=periods
        )

    def project_qkv(self, layer: int, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q and k normed per head, v weightless-normed (taken from k's projection where K = V)."""
        p, t, eps = f"{layer}.", x.shape[0], self.config.rms_norm_eps
        hd = int(self.arch.heads(self.config, layer)[1])
        q = self.linear(x, p + "q_proj").reshape(t, -1, hd)
        k = self.linear(x, p + "k_proj").reshape(t, -1, hd)
        v = self.linear(x, p + "v_proj").reshape(t, -1, hd) if p + "v_proj" in self.weights else k
        q, k = self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm")
        return q.reshape(t, -1), k.reshape(t, -1), mx.fast.rms_norm(v, None, eps).reshape(t, -1)

    def attention_output(self, layer: int, x: mx.array, attn: mx.array) -> mx.array:
        """``post_attention_norm(o_proj(attn))``."""
        return self.norm(self.linear(attn, f"{layer}.o_proj"), f"{layer}.post_attn_norm")

    post_norm_feeds_all = False  # the router reads its own scaled norm, the experts pre_ff_norm_2

    def route(
        self, layer: int, hidden: mx.array, normed: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """The router on the residual (its own scaled norm: ``normed`` is not what it reads): softmax
        top-k, renormalised, times ``per_expert_scale``."""
        c, w, p = self.config, self.weights, f"{layer}."
        x = mx.fast.rms_norm(hidden, None, c.rms_norm_eps) * w[p + "router_scale"] * c.hidden_size**-0.5
        probs = mx.softmax(self.linear(x, p + "router").astype(mx.float32), axis=-1, precise=True)
        ids = mx.argpartition(-probs, kth=c.top_k - 1, axis=-1)[..., : c.top_k]
        scores = mx.take_along_axis(probs, ids, axis=-1)
        scores = scores / scores.sum(axis=-1, keepdims=True)
        return ids, (scores * w[p + "per_expert_scale"][ids]).astype(hidden.dtype)

    def expert_input(self, layer: int, hidden: mx.array) -> mx.array:
        """The experts read ``pre_feedforward_layernorm_2`` of the residual."""
        return self.norm(hidden, f"{layer}.pre_ff_norm_2")

    def activation(self, gate: mx.array, up: mx.array) -> mx.array:
        """GeGLU with GELU's tanh approximation."""
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1.0 + mx.tanh(inner)) * up

    def moe_finish(
        self, layer: int, hidden: mx.array, routed: mx.array, normed: mx.array | None = None
    ) -> mx.array:
        """Normed experts' sum plus the normed dense MLP, normed, added, scaled by ``layer_scalar``
        (the dense MLP reads its own norm, ``pre_ff_norm``: ``normed`` is not used)."""
        p = f"{layer}."
        x = self.norm(hidden, p + "pre_ff_norm")
        dense = self.linear(
            self.activation(self.linear(x, p + "mlp_gate"), self.linear(x, p + "mlp_up")), p + "mlp_down"
        )
        both = self.norm(dense, p + "post_ff_norm_1") + self.norm(routed, p + "post_ff_norm_2")
        return (hidden + self.norm(both, p + "post_ff_norm")) * self.weights[p + "layer_scalar"]

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm, LM head, then ``cap * tanh(logits / cap)``."""
        logits = super().logits(hidden)
        cap = self.config.final_logit_softcap  # type: ignore[attr-defined]
        return logits if cap is None else mx.tanh(logits / cap) * cap
