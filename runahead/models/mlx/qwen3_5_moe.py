"""Qwen3.5 / Qwen3.6 MoE on MLX (the paper's main model): Gated DeltaNet and gated full attention.

The arithmetic of :mod:`runahead.models.qwen3_5_moe` (which the torch backend runs and the tests
hold to transformers), on MLX: linear-attention layers carry a per-request convolution tail and
delta-rule matrix (:class:`RecurrentMLX`); full-attention layers split ``q_proj`` into queries and
an output gate, with per-head q/k norms and partial RoPE; every RMSNorm but the linear layers'
gated one scales by ``1 + w``. The MoE (softmax router, top-k renormalised, sigmoid-gated shared
expert) is the shared one of :class:`runahead.models.mlx.base.MLXModel`.

Hugging Face folders (the hub's multimodal wrapper or transformers' text-only model) and mlx-lm's
conversions of them (the mlx-community checkpoints, float or quantized): mlx-lm's ``sanitize``
stores the convolution as ``[C, kernel, 1]`` (the checkpoint turns it back) and the norms as
``1 + w`` (:meth:`Qwen3_5MoeMLX.norm` then adds nothing); its quantized ``q_proj`` splits by rows
as the float one does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from runahead.models.mlx.base import MLXModel, Segment
from runahead.models.mlx.checkpoint import Checkpoint


class RecurrentMLX:
    """A linear-attention layer's state: the convolution's last inputs ``[C, kernel - 1]`` and the
    recurrence ``[heads, key_dim, value_dim]`` (float32)."""

    def __init__(self, channels: int, kernel: int, heads: int, key_dim: int, value_dim: int) -> None:
        self.conv = mx.zeros((channels, kernel - 1), dtype=mx.float32)
        self.recurrent = mx.zeros((heads, key_dim, value_dim), dtype=mx.float32)
        self.length = 0
        mx.eval(
            self.conv, self.recurrent
        )  # made on the event loop's thread: no lazy graph may cross to compute's

    def arrays(self) -> list[mx.array]:
        """The arrays to evaluate after a group."""
        return [self.conv, self.recurrent]


class Qwen3_5MoeMLX(MLXModel):
    """Qwen3.5 / Qwen3.6 MoE (see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        c = self.config
        self.norm_offset = 0.0 if checkpoint.sanitized else 1.0
        for layer, kind in enumerate(c.layer_types):
            if kind != "full_attention":
                continue
            p = f"{layer}.q_proj"
            if p in self.quant:
                self.quant[f"{layer}.q_gate"] = self.quant[p]
            for part in ("", ".scales", ".biases"):  # each head's query rows, then its gate rows
                if p + part in self.weights:
                    both = self.weights[p + part].reshape(c.num_attention_heads, 2, c.head_dim, -1)
                    self.weights[p + part] = both[:, 0].reshape(-1, both.shape[-1])
                    self.weights[f"{layer}.q_gate{part}"] = both[:, 1].reshape(-1, both.shape[-1])
        mx.eval(list(self.weights.values()))

    def norm(self, x: mx.array, name: str) -> mx.array:
        """RMSNorm scaling by ``1 + w`` (Qwen3.5 stores its norm weights centred at zero; mlx-lm's
        conversions store ``1 + w``)."""
        return mx.fast.rms_norm(x, self.norm_offset + self.weights[name], self.config.rms_norm_eps)

    def layer_state(self, layer: int) -> Any:
        """A recurrent state for linear-attention layers, keys and values for the others."""
        la = self.config.linear_attention
        if self.config.layer_types[layer] != "linear_attention" or la is None:
            return super().layer_state(layer)
        return RecurrentMLX(la.conv_channels, la.conv_kernel, la.value_heads, la.key_dim, la.value_dim)

    def mix(self, layer: int, x: mx.array, segments: Sequence[Segment]) -> mx.array:
        """Gated DeltaNet on linear layers, gated softmax attention on the others."""
        if self.config.layer_types[layer] == "linear_attention":
            return self.linear_attention(layer, x, segments)
        return self.softmax_attention(layer, x, segments)

    def project_qkv(self, layer: int, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v of a full-attention layer, q and k with per-head (1 + w) norms."""
        c, p, t = self.config, f"{layer}.", x.shape[0]
        q = self.norm(self.linear(x, p + "q_proj").reshape(t, -1, c.head_dim), p + "q_norm").reshape(t, -1)
        k = self.norm(self.linear(x, p + "k_proj").reshape(t, -1, c.head_dim), p + "k_norm").reshape(t, -1)
        return q, k, self.linear(x, p + "v_proj")

    def attention_output(self, layer: int, x: mx.array, attn: mx.array) -> mx.array:
        """``o_proj(attn * sigmoid(gate))``: the output gate from ``q_proj``'s gate rows."""
        p = f"{layer}."
        return self.linear(attn * mx.sigmoid(self.linear(x, p + "q_gate")), p + "o_proj")

    def linear_attention(self, layer: int, x: mx.array, segments: Sequence[Segment]) -> mx.array:
        """Gated DeltaNet over each run, continuing (and advancing) its request's recurrent state."""
        la, w, p = self.config.linear_attention, self.weights, f"{layer}."
        assert la is not None
        mixed = self.linear(x, p + "in_proj_qkv")
        z = self.linear(x, p + "in_proj_z")
        beta = mx.sigmoid(self.linear(x, p + "in_proj_b")).astype(mx.float32)
        a = self.linear(x, p + "in_proj_a").astype(mx.float32)
        decay = -mx.exp(w[p + "A_log"].astype(mx.float32)) * _softplus(a + w[p + "dt_bias"])
        states: list[RecurrentMLX] = [state.layers[layer] for state, _, _ in segments]
        convolved, row = [], 0
        for state, (_, _, n) in zip(states, segments, strict=True):
            convolved.append(_causal_conv(mixed[row : row + n], state, w[p + "conv"]))
            row += n
        qkv = mx.concatenate(convolved) if len(convolved) > 1 else convolved[0]
        keys = la.key_heads * la.key_dim
        q, k, v = mx.split(qkv, [keys, 2 * keys], axis=-1)
        repeat = la.value_heads // la.key_heads
        q = mx.repeat(q.reshape(-1, la.key_heads, la.key_dim), repeat, axis=1).astype(mx.float32)
        k = mx.repeat(k.reshape(-1, la.key_heads, la.key_dim), repeat, axis=1).astype(mx.float32)
        v = v.reshape(-1, la.value_heads, la.value_dim).astype(mx.float32)
        q, k = _l2norm(q) / la.key_dim**0.5, _l2norm(k)
        if all(n == 1 for _, _, n in segments):  # a decode group: one batched step over every request
            out = _delta_rule(states, q[:, None], k[:, None], v[:, None], decay[:, None], beta[:, None])
        else:
            parts, row = [], 0
            for state, (_, _, n) in zip(states, segments, strict=True):
                rows = slice(row, row + n)
                parts.append(
                    _delta_rule(
                        [state],
                        q[None, rows],
                        k[None, rows],
                        v[None, rows],
                        decay[None, rows],
                        beta[None, rows],
                    )
                )
                row += n
            out = mx.concatenate(parts)
        for state, (_, _, n) in zip(states, segments, strict=True):
            state.length += n
        out = out.astype(x.dtype).reshape(-1, la.value_dim)
        normed = mx.fast.rms_norm(out, w[p + "linear_norm"], self.config.rms_norm_eps)
        gate = z.reshape(-1, la.value_dim).astype(mx.float32)
        out = (normed * (gate * mx.sigmoid(gate))).astype(x.dtype)
        return self.linear(out.reshape(x.shape[0], -1), p + "out_proj")


def _softplus(x: mx.array) -> mx.array:
    """torch's softplus (``log(1 + e^x)``, the identity above 20)."""
    return mx.where(x > 20, x, mx.log1p(mx.exp(mx.minimum(x, 20))))


def _l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _causal_conv(rows: mx.array, state: RecurrentMLX, weight: mx.array) -> mx.array:
    """SiLU of the causal depthwise convolution of ``rows [n, C]`` after the state's tail; keeps the tail."""
    n, tail = rows.shape[0], state.conv.shape[1]
    sequence = mx.concatenate([state.conv, rows.T.astype(state.conv.dtype)], axis=1)
    if tail:
        state.conv = sequence[:, -tail:]
    kernel = weight.reshape(weight.shape[0], -1).astype(mx.float32)
    out = kernel[:, :1] * sequence[:, :n]
    for j in range(1, kernel.shape[1]):
        out = out + kernel[:, j : j + 1] * sequence[:, j : j + n]
    return (out * mx.sigmoid(out)).T.astype(rows.dtype)


def _delta_rule(
    states: Sequence[RecurrentMLX], q: mx.array, k: mx.array, v: mx.array, decay: mx.array, beta: mx.array
) -> mx.array:
    """The gated delta rule, token by token, for ``B`` requests' runs of equal length ``n`` (float32):
    ``q``/``k`` ``[B, n, heads, key_dim]``, ``v`` ``[B, n, heads, value_dim]``, ``decay``/``beta``
    ``[B, n, heads]``. Returns ``[B * n, heads, value_dim]``; the states advance."""
    s = mx.stack([state.recurrent for state in states])
    outs = []
    for t in range(q.shape[1]):
        s = s * mx.exp(decay[:, t])[..., None, None]
        remembered = (s * k[:, t, :, :, None]).sum(axis=-2)
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((s * q[:, t, :, :, None]).sum(axis=-2))
    for i, state in enumerate(states):
        state.recurrent = s[i]
    out = mx.stack(outs, axis=1)
    return out.reshape(-1, *out.shape[2:])
