"""gpt-oss (gpt-oss-20b, gpt-oss-120b): expert biases, clamped SwiGLU, attention sinks, YaRN RoPE.

Layers alternate ``sliding_attention`` (``sliding_window``) and ``full_attention`` (``layer_types``).
Attention has biases on q, k, v and o, and a learnt per-head *sink*: a logit appended to every
query's scores before the softmax and dropped after it, so a head may attend to nothing. RoPE is
YaRN-scaled (``rope_scaling`` / ``rope_parameters`` with ``rope_type: yarn``): interpolated
frequencies and cos/sin scaled by the attention factor.

The router has a bias; it takes the top-k *logits* and softmaxes over just those. Each expert is
``down(clamped_swiglu(x @ gate_up + b) ) + b``: gate and up are interleaved columns of
``gate_up [H, 2I]``; the gate is clamped above at ``swiglu_limit``, up to ``[-limit, limit]``, and
``(up + 1) * gate * sigmoid(alpha * gate)`` feeds ``down [I, H]``. Cache slots hold these tensors as
stored (``gate_up_t``, ``down_t`` and both biases; see :mod:`runahead.models.layout`).

Checkpoints: the hub publishes experts in MXFP4 (``*_blocks`` / ``*_scales``); those are refused
with an error naming the tensor (a GGUF of them runs, experts kept in MXFP4: :mod:`.gguf`).
Dequantized (bf16 / f32) stacked ``mlp.experts.gate_up_proj`` etc., as transformers saves them, load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from runahead.models.base import ModelDescription, ModelLoadError, MoEConfig, MoEModel, require


@dataclass(frozen=True, slots=True)
class GptOssConfig(MoEConfig):
    """:class:`MoEConfig` plus the clamped SwiGLU's constants and YaRN's parameters."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    yarn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_original_max_positions: int = 4096
    yarn_truncate: bool = True


class GptOssDescription(ModelDescription):
    """gpt-oss's description: config parsing, checkpoint names and shapes (no tensors)."""

    model_type: ClassVar[str] = "gpt_oss"

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse a gpt-oss ``config.json`` (``rope_scaling`` or ``rope_parameters``; either top-k key)."""
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("yarn", "default"):
            raise ModelLoadError(f"gpt_oss RoPE type {kind!r} is not supported (only 'yarn' and 'default')")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 150_000.0)))
        layers = int(require(raw, "num_hidden_layers"))
        types = raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
        base = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
        base["rope_theta"] = theta
        base["num_experts_per_tok"] = raw.get("num_experts_per_tok", raw.get("experts_per_token"))
        bias = bool(raw.get("attention_bias", True))
        yarn = kind == "yarn"
        return GptOssConfig.from_dict(
            base,
            intermediate_size=int(require(raw, "intermediate_size")),
            norm_topk_prob=True,
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=int(require(raw, "sliding_window")),
            layer_types=tuple(str(t) for t in types),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            yarn_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
            yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
            yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
            yarn_original_max_positions=int(rope.get("original_max_position_embeddings", 4096)),
            yarn_truncate=bool(rope.get("truncate", True)),
        )

    @classmethod
    def weight_names(cls, config: MoEConfig) -> dict[str, tuple[str, ...]]:
        """The common names, with the router's bias and each layer's attention sinks."""
        names = super().weight_names(config)
        for layer in range(config.num_layers):
            p = f"model.layers.{layer}."
            names[f"{layer}.router"] = (p + "mlp.router.weight",)
            names[f"{layer}.router.bias"] = (p + "mlp.router.bias",)
            names[f"{layer}.sinks"] = (p + "self_attn.sinks",)
        return names

    @classmethod
    def weight_shapes(cls, config: MoEConfig) -> dict[str, tuple[int, ...]]:
        """Shapes of :meth:`weight_names`' tensors."""
        shapes = super().weight_shapes(config)
        for layer in range(config.num_layers):
            shapes[f"{layer}.router.bias"] = (config.num_experts,)
            shapes[f"{layer}.sinks"] = (config.num_attention_heads,)
        return shapes

    @classmethod
    def stacked_expert_tensors(cls, layer: int) -> tuple[tuple[str, str], ...]:
        """``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` and their biases (transformers' names)."""
        p = f"model.layers.{layer}.mlp.experts."
        return (
            (p + "gate_up_proj", "gate_up_t"),
            (p + "down_proj", "down_t"),
            (p + "gate_up_proj_bias", "gate_up_bias"),
            (p + "down_proj_bias", "down_bias"),
        )


class GptOssModel(GptOssDescription, MoEModel):
    """gpt-oss, split into the runtime's jobs (see :class:`runahead.models.base.MoEModel`)."""

    config: GptOssConfig

    def __init__(self, config: MoEConfig, weights: Mapping[str, Tensor]) -> None:
        assert isinstance(config, GptOssConfig)
        super().__init__(config, weights)
        if config.yarn_factor != 1.0:
            self.inv_freq, self.rope_attention_factor = _yarn(config, self.device)

    # --- compute -----------------------------------------------------------------------------

    def attend(self, layer: int, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """Softmax attention with the layer's sinks: one extra logit per head, dropped after the softmax."""
        repeat = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(query, keys.transpose(2, 3)) * query.shape[-1] ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        sinks = self.weights[f"{layer}.sinks"].view(1, -1, 1, 1).expand(1, -1, query.shape[2], 1)
        logits = torch.cat([scores, sinks.to(scores.dtype)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs.to(values.dtype), values)

    @torch.no_grad()
    def route(self, layer: int, hidden: Tensor, normed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Top-k of the router's logits (with its bias), softmaxed over just those k."""
        x = self.post_normed(layer, hidden, normed)
        logits = self.dense(x, f"{layer}.router", self.weights[f"{layer}.router.bias"])
        top, ids = torch.topk(logits, self.config.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def run_expert(self, slot: Tensor, x: Tensor) -> Tensor:
        """The clamped-SwiGLU expert as stored: ``x @ gate_up + b``, gate and up interleaved, then down.

        From a GGUF (``slot_formats`` set) the slot holds llama.cpp's split form instead: ``gate [I, H]``,
        ``up [I, H]``, ``down [H, I]``, then the gate, up and down biases.
        """
        c = self.config
        h, i = c.hidden_size, c.intermediate_size
        block = h * i
        if self.slot_formats is not None:
            biases = slot[3 * block :]
            gate = x @ slot[:block].view(i, h).T + biases[:i]
            up = x @ slot[block : 2 * block].view(i, h).T + biases[i : 2 * i]
            down, down_bias = slot[2 * block : 3 * block].view(h, i).T, biases[2 * i :]
        else:
            gate_up = x @ slot[: 2 * block].view(h, 2 * i) + slot[3 * block : 3 * block + 2 * i]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            down, down_bias = slot[2 * block : 3 * block].view(i, h), slot[3 * block + 2 * i :]
        gate = gate.clamp(max=c.swiglu_limit)
        up = up.clamp(-c.swiglu_limit, c.swiglu_limit)
        glu = (up + 1) * (gate * torch.sigmoid(gate * c.swiglu_alpha))
        return glu @ down + down_bias


def _yarn(c: GptOssConfig, device: torch.device) -> tuple[Tensor, float]:
    """YaRN's inverse frequencies (interpolated below, extrapolated above a ramp) and attention factor."""
    dim, base = c.head_dim, c.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(c.yarn_original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(c.yarn_beta_fast), correction_dim(c.yarn_beta_slow)
    if c.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (c.yarn_factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    factor = 0.1 * math.log(c.yarn_factor) + 1.0 if c.yarn_factor > 1 else 1.0
    return inv_freq.to(device), factor
