"""Gemma 4 MoE (Gemma4-26B-A4B, the paper's second model): a dense MLP beside the routed experts.

Every layer runs a resident dense GeGLU MLP (``intermediate_size`` wide) *and* routed experts
(``moe_intermediate_size`` wide, GeGLU too) on the same post-attention residual, each behind its
own pre- and post-norms; their sum is normed once more and added, then scaled by the layer's
stored ``layer_scalar``. The router reads the residual itself: a weightless RMSNorm, times a learnt
``scale`` and ``hidden_size ** -0.5``, softmax over the experts, top-k renormalised, then each
chosen weight times its ``per_expert_scale``. Only the routed experts go through the cache.

Attention: ``sliding_attention`` layers (``sliding_window``) use ``head_dim`` and
``num_key_value_heads`` with default RoPE; ``full_attention`` layers use ``global_head_dim`` and
(with ``attention_k_eq_v``) ``num_global_key_value_heads`` with K reused as V, and proportional
RoPE turning only ``partial_rotary_factor`` of each head. q and k get a per-head RMSNorm, v a
weightless one; scores are not scaled (scale 1); the output is normed before the residual. The
embedding is scaled by ``sqrt(hidden_size)``; logits are soft-capped (``final_logit_softcapping``).
All norms scale by ``w`` (not ``1 + w``). Checkpoints: ``Gemma4ForConditionalGeneration`` on the
hub (``text_config``, ``model.language_model.``) or transformers' ``gemma4_text``; experts are
stacked (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``).

Not supported (refused when a config asks for them): per-layer input embeddings and KV sharing
(the small E2B/E4B models), bidirectional attention, attention biases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from runahead.models.base import ModelDescription, ModelLoadError, MoEConfig, MoEModel, require
from runahead.models.state import KVLayer, LayerState


@dataclass(frozen=True, slots=True)
class Gemma4Config(MoEConfig):
    """:class:`MoEConfig` plus Gemma 4's dense MLP, global-attention heads, RoPE bases and soft-cap."""

    dense_mlp_size: int = 0
    global_head_dim: int = 0
    global_kv_heads: int = 0
    k_eq_v: bool = False
    final_logit_softcap: float | None = None
    sliding_rope_theta: float = 10_000.0
    full_rope_theta: float = 1_000_000.0
    full_rotary_fraction: float = 0.25


class Gemma4Description(ModelDescription):
    """Gemma 4 MoE's description: config parsing, checkpoint names and shapes (no tensors)."""

    model_type: ClassVar[str] = "gemma4"

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse a Gemma 4 text config (``per_layer_config`` or the hub's ``global_head_dim`` keys)."""
        for key, what in (
            ("hidden_size_per_layer_input", "per-layer input embeddings"),
            ("num_kv_shared_layers", "KV sharing between layers"),
            ("attention_bias", "attention biases"),
        ):
            if raw.get(key):
                raise ModelLoadError(f"gemma4 with {key}={raw[key]} ({what}) is not supported")
        if raw.get("use_bidirectional_attention") == "all":
            raise ModelLoadError("gemma4 with bidirectional attention is not supported")
        if not raw.get("enable_moe_block"):
            raise ModelLoadError("gemma4 without enable_moe_block is a dense model, not a MoE")
        if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ModelLoadError(f"hidden_activation {raw['hidden_activation']!r} is not supported")
        layers = int(require(raw, "num_hidden_layers"))
        types = list(
            raw.get("layer_types")
            or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
        )
        types[-1] = "full_attention"  # as transformers forces it
        head_dim, kv_heads = int(require(raw, "head_dim")), int(require(raw, "num_key_value_heads"))
        k_eq_v = bool(raw.get("attention_k_eq_v", False))
        global_dim = int(raw.get("global_head_dim") or 512)
        global_kv = int(raw.get("num_global_key_value_heads") or kv_heads) if k_eq_v else kv_heads
        overrides = raw.get("per_layer_config")
        if overrides:
            chosen = {
                (int(v.get("head_dim", head_dim)), int(v.get("num_key_value_heads", kv_heads)))
                for v in overrides.values()
            }
            if len(chosen) != 1 or {int(k) for k in overrides} != {
                i for i, t in enumerate(types) if t == "full_attention"
            }:
                raise ModelLoadError(
                    "gemma4 per_layer_config must give every full-attention layer the same heads"
                )
            global_dim, global_kv = chosen.pop()
        rope = raw.get("rope_parameters") or {}
        sliding_rope, full_rope = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
        for kind, params in (("sliding_attention", sliding_rope), ("full_attention", full_rope)):
            expected = "default" if kind == "sliding_attention" else "proportional"
            if params.get("rope_type", expected) != expected or params.get("factor", 1.0) != 1.0:
                raise ModelLoadError(f"gemma4 {kind} RoPE {params} is not supported")
        cap = raw.get("final_logit_softcapping")
        base = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "hidden_act")}
        base["num_experts_per_tok"] = raw.get("top_k_experts", raw.get("num_experts_per_tok"))
        config = Gemma4Config.from_dict(
            base,
            intermediate_size=int(require(raw, "moe_intermediate_size")),
            norm_topk_prob=True,
            qk_norm="head",
            sliding_window=int(require(raw, "sliding_window")),
            layer_types=tuple(types),
            dense_mlp_size=int(require(raw, "intermediate_size")),
            global_head_dim=global_dim,
            global_kv_heads=global_kv,
            k_eq_v=k_eq_v,
            final_logit_softcap=float(cap) if cap else None,
            sliding_rope_theta=float(
                sliding_rope.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
            ),
            full_rope_theta=float(full_rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
            full_rotary_fraction=float(full_rope.get("partial_rotary_factor", 0.25)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )
        return config

    @classmethod
    def heads(cls, config: MoEConfig, layer: int) -> tuple[int, int]:
        """``(kv_heads, head_dim)`` of ``layer``'s attention."""
        assert isinstance(config, Gemma4Config)
        if config.layer_types[layer] == "full_attention":
            return config.global_kv_heads, config.global_head_dim
        return config.num_kv_heads, config.head_dim

    @classmethod
    def has_v_proj(cls, config: MoEConfig, layer: int) -> bool:
        """Whether ``layer`` has its own values (global layers with ``attention_k_eq_v`` reuse K)."""
        assert isinstance(config, Gemma4Config)
        return not (config.k_eq_v and config.layer_types[layer] == "full_attention")

    @classmethod
    def weight_names(cls, config: MoEConfig) -> dict[str, tuple[str, ...]]:
        """Canonical resident weight name -> its checkpoint name (Gemma 4's own module names)."""
        names: dict[str, tuple[str, ...]] = {
            "embed": ("model.embed_tokens.weight",),
            "norm": ("model.norm.weight",),
            "lm_head": ("lm_head.weight",),
        }
        for layer in range(config.num_layers):
            p = f"model.layers.{layer}."
            per = {
                "input_norm": "input_layernorm.weight",
                "post_attn_norm": "post_attention_layernorm.weight",
                "pre_ff_norm": "pre_feedforward_layernorm.weight",
                "post_ff_norm": "post_feedforward_layernorm.weight",
                "post_ff_norm_1": "post_feedforward_layernorm_1.weight",
                "pre_ff_norm_2": "pre_feedforward_layernorm_2.weight",
                "post_ff_norm_2": "post_feedforward_layernorm_2.weight",
                "q_proj": "self_attn.q_proj.weight",
                "k_proj": "self_attn.k_proj.weight",
                "o_proj": "self_attn.o_proj.weight",
                "q_norm": "self_attn.q_norm.weight",
                "k_norm": "self_attn.k_norm.weight",
                "mlp_gate": "mlp.gate_proj.weight",
                "mlp_up": "mlp.up_proj.weight",
                "mlp_down": "mlp.down_proj.weight",
                "router": "router.proj.weight",
                "router_scale": "router.scale",
                "per_expert_scale": "router.per_expert_scale",
                "layer_scalar": "layer_scalar",
            }
            if cls.has_v_proj(config, layer):
                per["v_proj"] = "self_attn.v_proj.weight"
            names.update({f"{layer}.{key}": (p + stored,) for key, stored in per.items()})
        return names

    @classmethod
    def weight_shapes(cls, config: MoEConfig) -> dict[str, tuple[int, ...]]:
        """Shapes of :meth:`weight_names`' tensors (head shapes differ between sliding and global layers)."""
        assert isinstance(config, Gemma4Config)
        c, h, d = config, config.hidden_size, config.dense_mlp_size
        shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, h), "norm": (h,)}
        if not c.tie_word_embeddings:
            shapes["lm_head"] = (c.vocab_size, h)
        for layer in range(c.num_layers):
            kv_heads, hd = cls.heads(config, layer)
            q, kv = c.num_attention_heads * hd, kv_heads * hd
            per: dict[str, tuple[int, ...]] = {
                "q_proj": (q, h), "k_proj": (kv, h), "o_proj": (h, q), "q_norm": (hd,), "k_norm": (hd,),
                "mlp_gate": (d, h), "mlp_up": (d, h), "mlp_down": (h, d),
                "router": (c.num_experts, h), "router_scale": (h,), "per_expert_scale": (c.num_experts,),
                "layer_scalar": (1,),
            }  # fmt: skip
            for norm in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm"):
                per[norm] = (h,)
            for norm in ("post_ff_norm_1", "pre_ff_norm_2", "post_ff_norm_2"):
                per[norm] = (h,)
            if cls.has_v_proj(config, layer):
                per["v_proj"] = (kv, h)
            shapes.update({f"{layer}.{name}": shape for name, shape in per.items()})
        return shapes

    @classmethod
    def expert_names(cls, layer: int, expert: int) -> tuple[str, str, str]:
        """Per-expert names (Gemma 4 checkpoints are stacked; these are the unstacked spelling)."""
        p = f"model.layers.{layer}.experts.{expert}."
        return (p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")

    @classmethod
    def stacked_expert_names(cls, layer: int) -> tuple[str, str]:
        """A layer's stacked expert tensors (``experts`` sits beside ``mlp``, not inside it)."""
        p = f"model.layers.{layer}.experts."
        return (p + "gate_up_proj", p + "down_proj")


class Gemma4Model(Gemma4Description, MoEModel):
    """Gemma 4 MoE, split into the runtime's jobs (see :class:`runahead.models.base.MoEModel`)."""

    config: Gemma4Config
    post_norm_feeds_all = False  # the router reads its own scaled norm, the experts pre_ff_norm_2

    def __init__(self, config: MoEConfig, weights: Mapping[str, Tensor]) -> None:
        assert isinstance(config, Gemma4Config)
        super().__init__(config, weights)
        c = config
        sliding = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=self.device) / c.head_dim
        angles = int(c.full_rotary_fraction * c.global_head_dim // 2)
        turned = torch.arange(0, 2 * angles, 2, dtype=torch.float32, device=self.device) / c.global_head_dim
        still = torch.zeros(c.global_head_dim // 2 - angles, dtype=torch.float32, device=self.device)
        self.inv_freqs = {
            "sliding_attention": 1.0 / (c.sliding_rope_theta**sliding),
            "full_attention": torch.cat([1.0 / (c.full_rope_theta**turned), still]),
        }
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=self.dtype, device=self.device)

    # --- the model description ---------------------------------------------------------------

    # --- compute -----------------------------------------------------------------------------

    def norm(self, x: Tensor, key: str) -> Tensor:
        """Gemma's RMSNorm: in float32, ``pow(mean + eps, -0.5)``, times ``w``."""
        return (_normed(x, self.config.rms_norm_eps) * self.weights[key].float()).type_as(x)

    def layer_state(self, layer: int, capacity: int) -> LayerState:
        """Keys and values in this layer's own head shape (sliding layers keep a bounded tail)."""
        kv_heads, hd = self.heads(self.config, layer)
        window = self.config.window(layer)
        return KVLayer(kv_heads, hd, dtype=self.dtype, device=self.device, capacity=capacity, window=window)

    @torch.no_grad()
    def embed(self, token_ids: Tensor) -> Tensor:
        """Embeddings scaled by ``sqrt(hidden_size)`` (in the weights' dtype, as transformers rounds it)."""
        return self.embedding_rows(token_ids) * self.embed_scale

    def rope_frequencies(self, layer: int) -> Tensor:
        """Default RoPE on sliding layers, proportional (part of each head) on global ones."""
        return self.inv_freqs[self.config.layer_types[layer]]

    def project_qkv(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v heads: normed q and k, weightless-normed v (taken from k's projection if K = V)."""
        w, p, eps = self.weights, f"{layer}.", self.config.rms_norm_eps
        _, hd = self.heads(self.config, layer)
        q = self.dense(x, p + "q_proj").view(x.shape[0], -1, hd)
        k = self.dense(x, p + "k_proj").view(x.shape[0], -1, hd)
        v = self.dense(x, p + "v_proj").view(x.shape[0], -1, hd) if p + "v_proj" in w else k
        return self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm"), _normed(v, eps).type_as(v)

    def attend(self, layer: int, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """Attention with unscaled scores (the q/k norms set their size)."""
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True, scale=1.0)

    def attention_output(self, layer: int, x: Tensor, attn: Tensor) -> Tensor:
        """``post_attention_norm(o_proj(attn))``."""
        return self.norm(self.dense(attn, f"{layer}.o_proj"), f"{layer}.post_attn_norm")

    @torch.no_grad()
    def route(self, layer: int, hidden: Tensor, normed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Gemma 4's router on the residual (its own scaled norm: ``normed`` is not what it reads):
        softmax top-k, renormalised, times ``per_expert_scale``."""
        w, p, c = self.weights, f"{layer}.", self.config
        x = _normed(hidden, c.rms_norm_eps).type_as(hidden) * w[p + "router_scale"] * c.hidden_size**-0.5
        probs = torch.softmax(self.dense(x, p + "router"), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, c.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, (weights * w[p + "per_expert_scale"][ids]).to(hidden.dtype)

    def expert_input(self, layer: int, hidden: Tensor) -> Tensor:
        """The experts read ``pre_feedforward_layernorm_2`` of the residual."""
        return self.norm(hidden, f"{layer}.pre_ff_norm_2")

    def glu(self, gate: Tensor, up: Tensor) -> Tensor:
        """GeGLU with the tanh approximation of GELU."""
        return F.gelu(gate, approximate="tanh") * up

    def moe_finish(self, layer: int, hidden: Tensor, out: Tensor, normed: Tensor | None = None) -> Tensor:
        """Normed experts' sum plus the normed dense MLP, normed, added, scaled by ``layer_scalar``."""
        w, p = self.weights, f"{layer}."
        dense = self.dense_mlp(
            self.norm(hidden, p + "pre_ff_norm"), p + "mlp_gate", p + "mlp_up", p + "mlp_down"
        )
        both = self.norm(dense, p + "post_ff_norm_1") + self.norm(out, p + "post_ff_norm_2")
        return (hidden + self.norm(both, p + "post_ff_norm")) * w[p + "layer_scalar"]

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm, LM head, then ``cap * tanh(logits / cap)``."""
        logits = self.dense(self.norm(hidden, "norm"), "lm_head")
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _normed(x: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
