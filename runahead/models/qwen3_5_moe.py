"""Qwen3.5 / Qwen3.6 MoE (Qwen3.6-35B-A3B, the paper's main model): hybrid linear and gated full attention.

Three of every four layers (``layer_types``, or every ``full_attention_interval``-th layer full) mix
tokens with **Gated DeltaNet** linear attention: ``in_proj_qkv`` -> a causal depthwise convolution
of width ``linear_conv_kernel_dim`` -> SiLU -> q, k, v heads; q and k are L2-normalised, and a
per-head recurrent matrix ``S [key_dim, value_dim]`` is decayed by ``exp(g)`` and corrected by the
delta rule at every token (``beta = sigmoid(in_proj_b)``, ``g = -exp(A_log) * softplus(in_proj_a +
dt_bias)``); the output is RMS-normed per head, gated by ``silu(in_proj_z)`` and projected by
``out_proj``. A request carries each such layer's convolution tail and ``S``
(:class:`runahead.models.state.RecurrentLayer`) instead of keys and values.

The other layers are **gated** full attention: ``q_proj`` yields each head's query and a gate,
q/k get a per-head RMSNorm, RoPE turns only the first ``partial_rotary_factor`` of each head
(multimodal RoPE reduces to it for text), and the heads' output is scaled by ``sigmoid(gate)``
before ``o_proj``. Every RMSNorm except the linear layers' gated one stores ``w`` and scales by
``1 + w``. The MoE block: softmax router, top-k always renormalised, plus a resident shared expert
scaled by ``sigmoid(shared_expert_gate(x))``.

Checkpoints: the hub's ``Qwen3_5MoeForConditionalGeneration`` (config under ``text_config``,
tensors under ``model.language_model.``) or transformers' text-only ``qwen3_5_moe_text``; experts
per expert (``mlp.experts.E.{gate,up,down}_proj``) or stacked (``mlp.experts.gate_up_proj``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from runahead.models.base import (
    LinearAttentionConfig,
    ModelDescription,
    ModelLoadError,
    MoEConfig,
    MoEModel,
    Segment,
    require,
)
from runahead.models.state import LayerState, RecurrentLayer

LINEAR_WEIGHTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv", "dt_bias", "A_log")
"""Canonical names (after ``L.``) of a linear-attention layer's weights, besides its norm and ``out_proj``."""


class Qwen3_5MoeDescription(ModelDescription):
    """Qwen3.5 / Qwen3.6 MoE's description: config parsing, checkpoint names and shapes (no tensors)."""

    model_type: ClassVar[str] = "qwen3_5_moe"

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse a Qwen3.5-MoE text config (the hub's or transformers 5's spelling)."""
        if raw.get("attention_bias"):
            raise ModelLoadError("qwen3_5_moe with attention_bias is not supported")
        layers = int(require(raw, "num_hidden_layers"))
        types = raw.get("layer_types")
        if types is None:
            interval = int(raw.get("full_attention_interval", 4))
            types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
            ]
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        partial = float(params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
        if params.get("rope_type", params.get("type")) == "mrope":  # text positions: plain RoPE
            params["rope_type"] = "default"
        if "rope_theta" not in params and "rope_theta" in raw:
            params["rope_theta"] = raw["rope_theta"]
        heads = int(require(raw, "num_attention_heads"))
        head_dim = int(raw.get("head_dim") or int(require(raw, "hidden_size")) // heads)
        linear = LinearAttentionConfig(
            key_heads=int(raw.get("linear_num_key_heads", 16)),
            value_heads=int(raw.get("linear_num_value_heads", 32)),
            key_dim=int(raw.get("linear_key_head_dim", 128)),
            value_dim=int(raw.get("linear_value_head_dim", 128)),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        )
        return MoEConfig.from_dict(
            {**raw, "rope_parameters": params, "rope_scaling": None},
            intermediate_size=int(require(raw, "moe_intermediate_size")),
            norm_topk_prob=True,
            shared_expert_size=int(require(raw, "shared_expert_intermediate_size")),
            shared_expert_gate=True,
            qk_norm="head",
            layer_types=tuple(str(t) for t in types),
            rotary_dim=int(head_dim * partial),
            linear_attention=linear,
        )

    @classmethod
    def full_layers(cls, config: MoEConfig) -> list[int]:
        """Indices of the gated full-attention layers."""
        return [i for i, t in enumerate(config.layer_types) if t == "full_attention"]

    @classmethod
    def weight_names(cls, config: MoEConfig) -> dict[str, tuple[str, ...]]:
        """The common names, with linear-attention weights instead of q/k/v/o on linear layers."""
        names = super().weight_names(config)
        for layer, kind in enumerate(config.layer_types):
            if kind != "linear_attention":
                continue
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                del names[f"{layer}.{proj}"]
            p = f"model.layers.{layer}.linear_attn."
            for key in LINEAR_WEIGHTS:
                stored = {"conv": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log"}.get(
                    key, key + ".weight"
                )
                names[f"{layer}.{key}"] = (p + stored,)
            names[f"{layer}.linear_norm"] = (p + "norm.weight",)
            names[f"{layer}.out_proj"] = (p + "out_proj.weight",)
        return names

    @classmethod
    def weight_shapes(cls, config: MoEConfig) -> dict[str, tuple[int, ...]]:
        """Shapes of :meth:`weight_names`' tensors (``q_proj`` carries the gate rows too)."""
        shapes = super().weight_shapes(config)
        la, h = config.linear_attention, config.hidden_size
        assert la is not None
        values = la.value_heads * la.value_dim
        for layer, kind in enumerate(config.layer_types):
            if kind != "linear_attention":
                shapes[f"{layer}.q_proj"] = (2 * config.num_attention_heads * config.head_dim, h)
                continue
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                del shapes[f"{layer}.{proj}"]
            shapes.update(
                {
                    f"{layer}.in_proj_qkv": (la.conv_channels, h),
                    f"{layer}.in_proj_z": (values, h),
                    f"{layer}.in_proj_b": (la.value_heads, h),
                    f"{layer}.in_proj_a": (la.value_heads, h),
                    f"{layer}.conv": (la.conv_channels, 1, la.conv_kernel),
                    f"{layer}.dt_bias": (la.value_heads,),
                    f"{layer}.A_log": (la.value_heads,),
                    f"{layer}.linear_norm": (la.value_dim,),
                    f"{layer}.out_proj": (h, values),
                }
            )
        return shapes


class Qwen3_5MoeModel(Qwen3_5MoeDescription, MoEModel):
    """Qwen3.5 / Qwen3.6 MoE, split into the runtime's jobs (see :class:`runahead.models.base.MoEModel`)."""

    def __init__(self, config: MoEConfig, weights: Mapping[str, Tensor]) -> None:
        super().__init__(config, weights)
        # q_proj holds each head's query rows then its gate rows; split them once for two plain products.
        hd = config.head_dim
        for layer in self.full_layers(config):
            w = self.weights[f"{layer}.q_proj"]  # rows split; a block-stored matrix's blocks kept whole
            both = w.view(config.num_attention_heads, 2, hd, *w.shape[1:])
            self.weights[f"{layer}.q_proj"] = both[:, 0].reshape(-1, *w.shape[1:]).contiguous()
            self.weights[f"{layer}.q_gate"] = both[:, 1].reshape(-1, *w.shape[1:]).contiguous()

    # --- compute -----------------------------------------------------------------------------

    def norm(self, x: Tensor, key: str) -> Tensor:
        """RMSNorm scaling by ``1 + w`` in float32, as Qwen3.5 stores its norm weights centred at zero."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return (x32 * (1.0 + self.weights[key].float())).to(x.dtype)

    def layer_state(self, layer: int, capacity: int) -> LayerState:
        """A recurrent state for linear-attention layers, keys and values for the others."""
        la = self.config.linear_attention
        if self.config.layer_types[layer] != "linear_attention" or la is None:
            return super().layer_state(layer, capacity)
        return RecurrentLayer(
            la.conv_channels,
            la.conv_kernel,
            la.value_heads,
            la.key_dim,
            la.value_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def mix(self, layer: int, x: Tensor, segments: Sequence[Segment]) -> Tensor:
        """Gated DeltaNet on linear layers, gated softmax attention on the others."""
        if self.config.layer_types[layer] == "linear_attention":
            return self.linear_attention(layer, x, segments)
        return self.softmax_attention(layer, x, segments)

    def project_qkv(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v heads of a full-attention layer with per-head (1 + w) RMSNorm on q and k."""
        c, p = self.config, f"{layer}."
        q = self.dense(x, p + "q_proj").view(x.shape[0], -1, c.head_dim)
        k = self.dense(x, p + "k_proj").view(x.shape[0], -1, c.head_dim)
        v = self.dense(x, p + "v_proj").view(x.shape[0], -1, c.head_dim)
        return self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm"), v

    def attention_output(self, layer: int, x: Tensor, attn: Tensor) -> Tensor:
        """``o_proj(attn * sigmoid(gate))``: the output gate comes from ``q_proj``'s gate rows."""
        p = f"{layer}."
        return self.dense(attn * torch.sigmoid(self.dense(x, p + "q_gate")), p + "o_proj")

    def linear_attention(self, layer: int, x: Tensor, segments: Sequence[Segment]) -> Tensor:
        """Gated DeltaNet over each run, continuing (and advancing) its request's recurrent state."""
        la, w, p = self.config.linear_attention, self.weights, f"{layer}."
        assert la is not None
        mixed = self.dense(x, p + "in_proj_qkv")
        z = self.dense(x, p + "in_proj_z")
        beta = _rowwise(torch.sigmoid, self.dense(x, p + "in_proj_b")).float()
        a = self.dense(x, p + "in_proj_a").float()
        decay = -w[p + "A_log"].float().exp() * _rowwise(F.softplus, a + w[p + "dt_bias"])
        states = [state.recurrent(layer) for state, _, _ in segments]
        convolved, row = [], 0
        for state, (_, _, n) in zip(states, segments, strict=True):
            convolved.append(_causal_conv(mixed[row : row + n], state, w[p + "conv"]))
            row += n
        qkv = torch.cat(convolved) if len(convolved) > 1 else convolved[0]
        keys = la.key_heads * la.key_dim
        q, k, v = torch.split(qkv, [keys, keys, la.value_heads * la.value_dim], dim=-1)
        repeat = la.value_heads // la.key_heads
        q = q.reshape(-1, la.key_heads, la.key_dim).repeat_interleave(repeat, dim=1).float()
        k = k.reshape(-1, la.key_heads, la.key_dim).repeat_interleave(repeat, dim=1).float()
        v = v.reshape(-1, la.value_heads, la.value_dim).float()
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
            out = torch.cat(parts)
        for state, (_, _, n) in zip(states, segments, strict=True):
            state.length += n
        out = out.to(x.dtype).reshape(-1, la.value_dim)
        out = _gated_rms_norm(
            out, z.reshape(-1, la.value_dim), w[p + "linear_norm"], self.config.rms_norm_eps
        )
        return self.dense(out.reshape(x.shape[0], -1), p + "out_proj")


def _causal_conv(rows: Tensor, state: RecurrentLayer, weight: Tensor) -> Tensor:
    """SiLU of the causal depthwise convolution of ``rows [n, C]`` after the state's tail; keeps the tail."""
    n, tail = rows.shape[0], state.conv.shape[1]
    sequence = torch.cat([state.conv, rows.transpose(0, 1).to(state.conv.dtype)], dim=1)
    if tail:
        state.conv = sequence[:, -tail:].clone()
    out = F.conv1d(sequence.unsqueeze(0).to(weight.dtype), weight, groups=weight.shape[0])[0, :, -n:]
    return F.silu(out).transpose(0, 1).to(rows.dtype)


def _rowwise(op: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``op(x)`` for an elementwise ``op``, each row of ``x`` rounded alike however many rows there are.

    torch runs an elementwise op over the whole tensor in vector chunks and ends in a scalar tail
    whose last bit can differ; a row narrower than a chunk (a few heads, one norm) would land in one
    or the other depending on the rows before it. Padded to 32 values a row is whole chunks (AVX2,
    AVX-512, NEON alike), so a request's result does not depend on the requests in its group.
    """
    n = x.shape[-1]
    pad = -n % 32
    return op(F.pad(x, (0, pad)))[..., :n] if pad else op(x)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * _rowwise(torch.rsqrt, (x * x).sum(dim=-1, keepdim=True) + eps)


def _delta_rule(
    states: Sequence[RecurrentLayer], q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor
) -> Tensor:
    """The gated delta rule, token by token, for ``B`` requests' runs of equal length ``n``.

    ``q``/``k`` ``[B, n, heads, key_dim]``, ``v`` ``[B, n, heads, value_dim]``, ``decay``/``beta``
    ``[B, n, heads]`` (float32). Each request's state is decayed, corrected towards ``v`` along ``k``
    (the delta rule) and read with ``q``. Returns ``[B * n, heads, value_dim]``; the states advance.
    """
    s = torch.stack([state.recurrent for state in states]) if len(states) > 1 else states[0].recurrent[None]
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = s * _rowwise(torch.exp, decay[:, t])[..., None, None]
        remembered = (s * k[:, t, :, :, None]).sum(dim=-2)
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(dim=-2)
    for i, state in enumerate(states):
        state.recurrent = s[i].clone() if len(states) > 1 else s[0]
    return out.reshape(-1, *out.shape[2:])


def _gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each head's output (plain ``w``), times ``silu(gate)``, as Qwen3.5's linear layers do."""
    x32 = x.float()
    x32 = x32 * _rowwise(torch.rsqrt, x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return (out * _rowwise(F.silu, gate.float())).to(x.dtype)
