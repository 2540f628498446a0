"""What every MoE decoder shares: its config, the per-request KV cache, and the job-granular model.

A model is split where the runtime schedules it. Job ``l -> l+1`` is ``moe(l)``, then
``attention(l+1)`` and ``route(l+1)``; the entry job is ``embed``, ``attention(0)``, ``route(0)``;
the last job ends in ``logits``. Non-expert weights are resident in the model; routed experts are
not: :meth:`MoEModel.moe` receives each one as a cache slot (the flat buffer of
:mod:`runahead.models.layout`), which is the single seam where the expert cache plugs in.

An architecture subclasses :class:`MoEModel` in its own file and supplies its config parsing
(:meth:`MoEModel.parse_config`) and the names of its weights in the checkpoint
(:meth:`MoEModel.weight_names`, :meth:`MoEModel.expert_names`); the arithmetic lives here, with a
few hooks (:meth:`MoEModel.project_qkv`, :meth:`MoEModel.shared_expert`) for what differs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from runahead.models.layout import SlotFormat
from runahead.models.state import KVLayer, LayerState, RequestState

Segment = tuple[RequestState, int, int]
"""One request's run of rows in a batch: ``(its state, position of its first token, token count)``."""


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


KVCache = RequestState
"""The per-request state under its older name (every layer softmax attention in most models)."""


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as transformers computes it (in float32, scaled after casting back)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MoEModel:
    """A MoE decoder split into the runtime's jobs; routed experts come from cache slots.

    Weights are kept under canonical names: ``embed``, ``norm``, ``lm_head`` and per layer ``l``
    ``l.input_norm``, ``l.q_proj`` ... ``l.o_proj`` (``.bias`` variants), ``l.q_norm``, ``l.k_norm``,
    ``l.post_norm``, ``l.router`` and for a shared expert ``l.shared_gate``, ``l.shared_up``,
    ``l.shared_down``, ``l.shared_expert_gate``. Built by :func:`runahead.models.loader.load_model`.
    """

    model_type: ClassVar[str] = ""
    moe_prefixes: ClassVar[tuple[str, ...]] = ("mlp",)
    """Module names of the MoE block in checkpoints; the first is the per-expert form's."""
    expert_matrices: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    """Per-expert checkpoint names of the (gate, up, down) matrices."""

    def __init__(self, config: MoEConfig, weights: Mapping[str, Tensor]) -> None:
        self.config = config
        self.weights = dict(weights)
        if config.tie_word_embeddings or "lm_head" not in self.weights:
            self.weights["lm_head"] = self.weights["embed"]
        any_weight = self.weights["embed"]
        self.dtype, self.device = any_weight.dtype, any_weight.device
        rotary = config.rotary_dim or config.head_dim
        dims = torch.arange(0, rotary, 2, dtype=torch.float32, device=self.device)
        inv_freq = 1.0 / (config.rope_theta ** (dims / rotary))
        self.inv_freq = inv_freq / config.rope_scaling_factor
        self.rope_attention_factor = 1.0
        self.slot_formats: Mapping[int, SlotFormat] | None = None
        """Per layer, how a stored slot holds its experts (GGUF; set by the loader), or None when
        slots hold experts in the compute dtype. See :meth:`expert_weights`."""

    # --- what an architecture supplies -------------------------------------------------------

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

    def project_qkv(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[T, heads, head_dim]`` of the normed rows ``x``, before RoPE (q/k norm, clipping)."""
        c, w, p = self.config, self.weights, f"{layer}."
        q = F.linear(x, w[p + "q_proj"], w.get(p + "q_proj.bias"))
        k = F.linear(x, w[p + "k_proj"], w.get(p + "k_proj.bias"))
        v = F.linear(x, w[p + "v_proj"], w.get(p + "v_proj.bias"))
        if c.qk_norm == "full":
            q, k = self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm")
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q = q.view(x.shape[0], -1, c.head_dim)
        k = k.view(x.shape[0], -1, c.head_dim)
        v = v.view(x.shape[0], -1, c.head_dim)
        if c.qk_norm == "head":
            q, k = self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm")
        return q, k, v

    def shared_expert(self, layer: int, x: Tensor) -> Tensor | None:
        """The always-on shared expert's output for normed rows ``x``, or ``None`` when there is none."""
        c, w, p = self.config, self.weights, f"{layer}."
        if not c.shared_expert_size:
            return None
        out = _swiglu(x, w[p + "shared_gate"], w[p + "shared_up"], w[p + "shared_down"])
        if c.shared_expert_gate:
            out = torch.sigmoid(F.linear(x, w[p + "shared_expert_gate"])) * out
        return out

    # --- the job pieces ----------------------------------------------------------------------

    def norm(self, x: Tensor, key: str) -> Tensor:
        """RMSNorm of ``x`` with the resident weight ``key`` (an architecture may centre its weights)."""
        return rms_norm(x, self.weights[key], self.config.rms_norm_eps)

    def layer_state(self, layer: int, capacity: int) -> LayerState:
        """A new request's state for ``layer``: keys and values (sliding if the layer's attention slides)."""
        c = self.config
        return KVLayer(
            c.num_kv_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
            capacity=capacity,
            window=c.window(layer),
        )

    def new_cache(self, capacity: int = 64) -> RequestState:
        """The state of one new request, every layer's (see :mod:`runahead.models.state`).

        The per-request seam: the backend calls it at admission and drops the result at completion
        or cancellation; each layer's kind comes from :meth:`layer_state`.
        """
        return RequestState([self.layer_state(layer, capacity) for layer in range(self.config.num_layers)])

    @torch.no_grad()
    def embed(self, token_ids: Tensor) -> Tensor:
        """Hidden states ``[T, H]`` of token ids ``[T]``: the start of a token's entry job."""
        return F.embedding(token_ids.to(self.device), self.weights["embed"])

    @torch.no_grad()
    def attention(self, layer: int, hidden: Tensor, segments: Sequence[Segment]) -> Tensor:
        """Token-mixing block of ``layer`` (attention, or linear attention) with its residual.

        ``segments`` split the ``T`` rows into consecutive per-request runs ``(state, start, n)``;
        each run's positions are ``start .. start+n-1`` and ``start`` must equal the tokens that
        request already has in this layer. Projections are batched over all rows; each run reads and
        advances only its own request's state. Returns ``hidden + mix(input_norm(hidden))`` ``[T, H]``.
        """
        covered = sum(n for _, _, n in segments)
        if covered != hidden.shape[0]:
            raise ValueError(f"segments cover {covered} rows, hidden has {hidden.shape[0]}")
        for state, start, _ in segments:
            if state.layers[layer].length != start:
                raise ValueError(
                    f"layer {layer}: segment starts at position {start} but its cache holds "
                    f"{state.layers[layer].length} tokens"
                )
        x = self.norm(hidden, f"{layer}.input_norm")
        return hidden + self.mix(layer, x, segments)

    def mix(self, layer: int, x: Tensor, segments: Sequence[Segment]) -> Tensor:
        """The token mixer of ``layer`` on normed rows ``x``: softmax attention unless overridden."""
        return self.softmax_attention(layer, x, segments)

    def softmax_attention(self, layer: int, x: Tensor, segments: Sequence[Segment]) -> Tensor:
        """Causal (windowed, if the layer slides) attention of each run over its own KV, then the output."""
        q, k, v = self.project_qkv(layer, x)
        positions = torch.cat([torch.arange(s, s + n, device=self.device) for _, s, n in segments])
        inv_freq, factor = self.rope_frequencies(layer), self.rope_attention_factor
        q, k = apply_rope(q, positions, inv_freq, factor), apply_rope(k, positions, inv_freq, factor)
        window = self.config.window(layer)
        outputs, row = [], 0
        for state, start, n in segments:
            rows = slice(row, row + n)
            keys, values, first = state.kv(layer).append(k[rows].transpose(0, 1), v[rows].transpose(0, 1))
            query = q[rows].transpose(0, 1)
            mask = _mask(start, n, first, keys.shape[1], window, self.device)
            out = self.attend(layer, query, keys, values, mask)
            outputs.append(out.transpose(0, 1).reshape(n, -1))
            row += n
        attn = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return self.attention_output(layer, x, attn)

    def attend(self, layer: int, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """Scaled dot-product attention ``[heads, n, head_dim]`` of one run's queries over its keys."""
        out = F.scaled_dot_product_attention(
            query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=True
        )
        return out[0]

    def attention_output(self, layer: int, x: Tensor, attn: Tensor) -> Tensor:
        """Output projection of the heads' outputs ``attn [T, heads * head_dim]`` (``x``: normed input)."""
        w = self.weights
        return F.linear(attn, w[f"{layer}.o_proj"], w.get(f"{layer}.o_proj.bias"))

    @torch.no_grad()
    def route(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The gate of ``layer``: post-attention norm, then router softmax and top-k.

        Returns ``(expert ids [T, k] long, weights [T, k])`` as transformers computes them: softmax
        in float32 over all experts, top-k, then renormalised over the k when ``norm_topk_prob``.
        """
        c = self.config
        x = self.norm(hidden, f"{layer}.post_norm")
        probs = torch.softmax(F.linear(x, self.weights[f"{layer}.router"]).float(), dim=-1)
        weights, ids = torch.topk(probs, c.top_k, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(hidden.dtype)

    @torch.no_grad()
    def moe(
        self, layer: int, hidden: Tensor, ids: Tensor, weights: Tensor, experts: Mapping[int, Tensor]
    ) -> Tensor:
        """MoE block of ``layer`` with its residual: ``hidden + sum_k w_k * expert_k(norm(hidden))``.

        ``ids`` / ``weights`` ``[T, k]`` come from :meth:`route`; ``experts[e]`` is expert ``e``'s
        cache slot (flat ``gate [I, H] | up [I, H] | down [H, I]``). Each distinct expert runs once
        over the rows routed to it, in ascending expert order. Adds the shared expert, if any.
        """
        missing = sorted(set(torch.unique(ids).tolist()) - set(experts))
        if missing:
            raise KeyError(f"layer {layer}: expert {missing[0]} is routed to but has no slot")
        return self.moe_finish(layer, hidden, self.moe_partial(layer, hidden, ids, weights, experts))

    def moe_partial(
        self,
        layer: int,
        hidden: Tensor,
        ids: Tensor,
        weights: Tensor,
        experts: Mapping[int, Tensor],
        out: Tensor | None = None,
        routing: Mapping[int, tuple[Tensor, Tensor]] | None = None,
    ) -> Tensor:
        """Add the routed-expert contributions of just the ``experts`` given to ``out`` (zeros if None).

        The expert-compute seam. A job whose experts do not all fit in the cache at once (a prefill
        chunk) runs its MoE in waves: one call per wave, then :meth:`moe_finish`. ``routing`` maps
        each expert to compute to its ``(rows, k positions)`` in ``ids`` as index tensors on the
        model's device; a backend that holds the routing on the host passes it so the MoE needs no
        device-to-host read (``ids`` is then not read). Without it the rows are found from ``ids``.
        """
        x = self.expert_input(layer, hidden)
        if out is None:
            out = torch.zeros_like(x)
        if routing is None:
            routing = rows_per_expert(ids, experts)
        for expert in sorted(routing):
            rows, kpos = routing[expert]
            slot = self.expert_weights(layer, experts[expert], x.dtype)
            y = self.run_expert(slot, x[rows]) * weights[rows, kpos, None]
            out.index_add_(0, rows, y)
        return out

    def expert_weights(self, layer: int, slot: Tensor, dtype: torch.dtype) -> Tensor:
        """Cache slot ``slot`` of ``layer`` as :meth:`run_expert` reads it: the flat slot in ``dtype``.

        A compute-dtype slot is only cast; a stored slot (``slot_formats``: Q4_0, Q8_0, ...) is
        dequantized on its device into a temporary that lives only while the group uses it.
        """
        if self.slot_formats is None:
            return slot.to(dtype)
        from runahead.models.quant import dequantize_slot

        return dequantize_slot(slot, self.slot_formats[layer], dtype)

    def run_expert(self, slot: Tensor, x: Tensor) -> Tensor:
        """One routed expert held in cache slot ``slot`` (the format of :mod:`.layout`) on rows ``x``."""
        c = self.config
        block = c.intermediate_size * c.hidden_size
        gate = slot[:block].view(c.intermediate_size, c.hidden_size)
        up = slot[block : 2 * block].view(c.intermediate_size, c.hidden_size)
        down = slot[2 * block : 3 * block].view(c.hidden_size, c.intermediate_size)
        return self.expert(x, gate, up, down)

    def expert_input(self, layer: int, hidden: Tensor) -> Tensor:
        """What the routed experts of ``layer`` read: the post-attention norm of ``hidden``."""
        return self.norm(hidden, f"{layer}.post_norm")

    def expert(self, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
        """One expert (or dense MLP) on rows ``x``: ``down(act(gate(x)) * up(x))``, SiLU unless overridden."""
        return _swiglu(x, gate, up, down)

    def moe_finish(self, layer: int, hidden: Tensor, out: Tensor) -> Tensor:
        """Close the MoE block: add the shared expert (if any) and the residual to the routed sum."""
        x = self.norm(hidden, f"{layer}.post_norm")
        shared = self.shared_expert(layer, x)
        if shared is not None:
            out = out + shared
        return hidden + out

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head: logits ``[T, vocab]`` (the end of a token's last job)."""
        x = self.norm(hidden, "norm")
        return F.linear(x, self.weights["lm_head"])

    def rope_frequencies(self, layer: int) -> Tensor:
        """RoPE inverse frequencies of ``layer`` (one per rotated pair of dims; zeros leave a pair as is)."""
        return self.inv_freq


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, factor: float = 1.0) -> Tensor:
    """Rotary embedding of ``x [T, heads, head_dim]``; only the first ``2 * len(inv_freq)`` dims rotate.

    ``factor`` scales cos and sin (YaRN's attention factor; 1 otherwise).
    """
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * factor).to(x.dtype)[:, None, :], (emb.sin() * factor).to(x.dtype)[:, None, :]
    rotary = emb.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def _mask(
    start: int, n: int, first: int, stored: int, window: int | None, device: torch.device
) -> Tensor | None:
    """Boolean ``[n, stored]`` mask (True = attend) for queries at ``start..`` over keys at ``first..``."""
    if n == 1 and (window is None or start - first < window):
        return None
    q_pos = torch.arange(start, start + n, device=device)[:, None]
    k_pos = torch.arange(first, first + stored, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def rows_per_expert(ids: Tensor, experts: Collection[int]) -> dict[int, tuple[Tensor, Tensor]]:
    """For each of ``experts`` that ``ids`` ``[T, k]`` routes to: its ``(rows, k positions)`` in ``ids``.

    Reads ``ids`` on the host (a device sync on CUDA); entries of -1 route nowhere.
    """
    routed = set(torch.unique(ids).tolist())
    found = {}
    for e in sorted(set(experts) & routed):
        rows, kpos = torch.where(ids == e)
        found[int(e)] = (rows, kpos)
    return found


def _swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
