"""What a model *is*, without torch: its config, its checkpoint's weight names and shapes, where experts lie.

Shared by every backend and loader: the torch models (:mod:`runahead.models.base`) inherit
:class:`ModelDescription`, and a backend or a file format without torch can parse the same configs
and find the same tensors through it. An architecture's description says

- :meth:`ModelDescription.parse_config`: ``config.json`` (either spelling) -> :class:`MoEConfig`;
- :meth:`ModelDescription.weight_names` / :meth:`ModelDescription.weight_shapes`: each resident weight's
  canonical name -> its checkpoint name(s) and shape;
- :meth:`ModelDescription.stacked_expert_tensors` / :meth:`ModelDescription.expert_names`: where each
  routed expert lies, with the slot roles of :mod:`runahead.models.layout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar


class ModelLoadError(ValueError):
    """A model folder cannot be loaded: the message names the file, tensor or config key at fault."""


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """Shapes of Gated DeltaNet linear-attention layers (Qwen3.5 / Qwen3.6, Qwen3-Next).

    ``key_heads`` q/k heads of ``key_dim`` and ``value_heads`` v heads of ``value_dim`` (a multiple
    of ``key_heads``: each q/k head serves consecutive v heads); a causal depthwise convolution of
    width ``conv_kernel`` over the concatenated q, k, v channels.
    """

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.value_heads % self.key_heads:
            raise ModelLoadError(
                f"linear_num_value_heads ({self.value_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.key_heads})"
            )
        if self.conv_kernel < 1:
            raise ModelLoadError(f"linear_conv_kernel_dim must be at least 1, got {self.conv_kernel}")

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: q, k and v concatenated."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The architecture parameters the runtime needs, parsed from a ``config.json``.

    ``qk_norm`` is ``"head"`` (RMSNorm over each head's ``head_dim``, Qwen3), ``"full"`` (RMSNorm over
    the whole q / k projection, OLMoE) or ``None``. ``qkv_bias`` / ``o_bias`` say which attention
    projections carry a bias. ``shared_expert_size`` is the width of an always-on shared expert
    (Qwen2-MoE; 0 when absent), gated by a sigmoid when ``shared_expert_gate``.
    """

    model_type: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    norm_topk_prob: bool
    rope_scaling_factor: float = 1.0
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rotary_dim: int | None = None
    linear_attention: LinearAttentionConfig | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok {self.top_k} not in 1..{self.num_experts}")
        if self.qk_norm not in (None, "head", "full"):
            raise ModelLoadError(f"unknown q/k norm kind {self.qk_norm!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"unknown layer type {unknown[0]!r}; known: {', '.join(LAYER_TYPES)}")
        if "linear_attention" in self.layer_types and self.linear_attention is None:
            raise ModelLoadError(f"{self.model_type}: linear_attention layers need linear attention shapes")

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention, or ``None`` when it sees every earlier token.

        Without ``layer_types`` the window (if any) applies to every layer, as in Mixtral.
        """
        if not self.layer_types or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], **values: Any) -> MoEConfig:
        """Build a config from ``config.json`` content; unknown keys are ignored.

        Reads the keys every supported architecture spells alike; ``values`` (already parsed by the
        architecture, e.g. ``intermediate_size``) take precedence. Raises :class:`ModelLoadError` for
        a missing key, a dense (non-MoE) layer, or an activation or RoPE kind not implemented here.
        """
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            common: dict[str, Any] = {
                "model_type": str(raw["model_type"]),
                "num_layers": int(raw["num_hidden_layers"]),
                "num_experts": int(_first(raw, "num_experts", "num_local_experts")),
                "top_k": int(raw["num_experts_per_tok"]),
                "hidden_size": hidden,
                "vocab_size": int(raw["vocab_size"]),
                "num_attention_heads": heads,
                "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
                "head_dim": int(raw.get("head_dim") or hidden // heads),
                "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
                "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
                "bos_token_id": raw.get("bos_token_id"),
                "eos_token_ids": _token_ids(raw.get("eos_token_id")),
                "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
            }
        except KeyError as err:
            raise ModelLoadError(f"config.json lacks {err.args[0]!r}") from None
        common["rope_theta"], common["rope_scaling_factor"] = _rope(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        if raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step", 1)) != 1:
            raise ModelLoadError("dense (mlp_only_layers / decoder_sparse_step) layers are not supported")
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise TypeError(f"unknown MoEConfig fields {sorted(unknown)}")
        return cls(**{**common, **values})


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
"""The token mixers a layer may have (``layer_types`` in transformers' spelling)."""


def require(raw: Mapping[str, Any], key: str) -> Any:
    """``raw[key]``, or a :class:`ModelLoadError` naming the key that ``config.json`` lacks."""
    if raw.get(key) is None:
        raise ModelLoadError(f"config.json lacks {key!r}")
    return raw[key]


def _first(raw: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    raise KeyError(keys[0])


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _rope(raw: Mapping[str, Any]) -> tuple[float, float]:
    """``(rope_theta, linear scaling factor)`` from transformers 5's ``rope_parameters`` or the hub's keys."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(params["factor"])
    raise ModelLoadError(f"RoPE type {kind!r} is not supported (only 'default' and 'linear')")


class ModelDescription:
    """An architecture's config parsing and checkpoint names (the common decoder's by default)."""

    model_type: ClassVar[str] = ""
    moe_prefixes: ClassVar[tuple[str, ...]] = ("mlp",)
    """Module names of the MoE block in checkpoints; the first is the per-expert form's."""
    expert_matrices: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    """Per-expert checkpoint names of the (gate, up, down) matrices."""

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any]) -> MoEConfig:
        """Parse this architecture's ``config.json`` content (unknown keys ignored)."""
        raise NotImplementedError

    @classmethod
    def weight_names(cls, config: MoEConfig) -> dict[str, tuple[str, ...]]:
        """Canonical resident weight name -> its checkpoint name(s), the first one present wins."""
        names: dict[str, tuple[str, ...]] = {
            "embed": ("model.embed_tokens.weight",),
            "norm": ("model.norm.weight",),
            "lm_head": ("lm_head.weight",),
        }
        for layer in range(config.num_layers):
            p = f"model.layers.{layer}."
            names[f"{layer}.input_norm"] = (p + "input_layernorm.weight",)
            names[f"{layer}.post_norm"] = (p + "post_attention_layernorm.weight",)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names[f"{layer}.{proj}"] = (f"{p}self_attn.{proj}.weight",)
                if config.o_bias if proj == "o_proj" else config.qkv_bias:
                    names[f"{layer}.{proj}.bias"] = (f"{p}self_attn.{proj}.bias",)
            if config.qk_norm:
                names[f"{layer}.q_norm"] = (p + "self_attn.q_norm.weight",)
                names[f"{layer}.k_norm"] = (p + "self_attn.k_norm.weight",)
            names[f"{layer}.router"] = tuple(f"{p}{moe}.gate.weight" for moe in cls.moe_prefixes)
            if config.shared_expert_size:
                for part in ("gate", "up", "down"):
                    names[f"{layer}.shared_{part}"] = (f"{p}mlp.shared_expert.{part}_proj.weight",)
                if config.shared_expert_gate:
                    names[f"{layer}.shared_expert_gate"] = (p + "mlp.shared_expert_gate.weight",)
        return names

    @classmethod
    def expert_names(cls, layer: int, expert: int) -> tuple[str, str, str]:
        """Checkpoint names of one expert's ``(gate, up, down)`` matrices in the per-expert form."""
        p = f"model.layers.{layer}.{cls.moe_prefixes[0]}.experts.{expert}."
        gate, up, down = cls.expert_matrices
        return (f"{p}{gate}.weight", f"{p}{up}.weight", f"{p}{down}.weight")

    @classmethod
    def stacked_expert_names(cls, layer: int) -> tuple[str, str]:
        """Checkpoint names of a layer's stacked ``(gate_up [E, 2I, H], down [E, H, I])`` tensors."""
        p = f"model.layers.{layer}.mlp.experts."
        return (p + "gate_up_proj", p + "down_proj")

    @classmethod
    def stacked_expert_tensors(cls, layer: int) -> tuple[tuple[str, str], ...]:
        """A layer's stacked expert tensors as ``(checkpoint name, slot role)``, ``E`` experts first.

        Role shapes are :func:`runahead.models.layout.role_shape`'s; expert ``e`` is the ``e``-th
        contiguous slice of each tensor.
        """
        gate_up, down = cls.stacked_expert_names(layer)
        return ((gate_up, "gate_up"), (down, "down"))

    @classmethod
    def weight_shapes(cls, config: MoEConfig) -> dict[str, tuple[int, ...]]:
        """Canonical resident weight name -> the shape it must have."""
        c, h = config, config.hidden_size
        q, kv = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, h), "norm": (h,)}
        if not c.tie_word_embeddings:
            shapes["lm_head"] = (c.vocab_size, h)
        for layer in range(c.num_layers):
            per: dict[str, tuple[int, ...]] = {
                "input_norm": (h,), "post_norm": (h,), "router": (c.num_experts, h),
                "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            }  # fmt: skip
            if c.qkv_bias:
                per.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
            if c.o_bias:
                per["o_proj.bias"] = (h,)
            if c.qk_norm == "head":
                per.update({"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)})
            elif c.qk_norm == "full":
                per.update({"q_norm": (q,), "k_norm": (kv,)})
            if c.shared_expert_size:
                s = c.shared_expert_size
                per.update({"shared_gate": (s, h), "shared_up": (s, h), "shared_down": (h, s)})
                if c.shared_expert_gate:
                    per["shared_expert_gate"] = (1, h)
            shapes.update({f"{layer}.{name}": shape for name, shape in per.items()})
        return shapes
