"""What every MoE decoder shares: its config, the per-request KV cache, and the job-granular model.

A model is split where the runtime schedules it. Job ``l -> l+1`` is ``moe(l)``, then
``attention(l+1)`` and ``route(l+1)``; the entry job is ``embed``, ``attention(0)``, ``route(0)``;
the last job ends in ``logits``. Non-expert weights are resident in the model; routed experts are
not: :meth:`MoEModel.moe` receives each one as a cache slot (the flat buffer of
:mod:`runahead.models.layout`), which is the single seam where the expert cache plugs in.

An architecture subclasses :class:`MoEModel` in its own file and supplies its description (config
parsing and the names of its weights in the checkpoint, :mod:`runahead.models.description`: no
torch there); the arithmetic lives here, with hooks (:meth:`MoEModel.norm`, :meth:`MoEModel.mix`,
:meth:`MoEModel.project_qkv`, :meth:`MoEModel.attend`, ...) for what differs, and
:meth:`MoEModel.layer_state` choosing each layer's per-request state. Where the matrix products run
(the CPU kernel or torch; :meth:`~runahead.models.products.ExpertProducts.run_expert` and ``glu``,
an architecture's expert hooks) is :mod:`runahead.models.products`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from runahead.models import qkernel
from runahead.models.description import (
    LAYER_TYPES,
    LinearAttentionConfig,
    ModelDescription,
    ModelLoadError,
    MoEConfig,
    require,
)
from runahead.models.hostcopy import int_tensor
from runahead.models.ops import apply_rope, attention_mask, rms_norm, rope_tables
from runahead.models.products import ExpertProducts, matrix_kind
from runahead.models.routing import ExpertRows
from runahead.models.state import KVLayer, LayerState, RequestState

__all__ = [
    "LAYER_TYPES",
    "KVCache",
    "LinearAttentionConfig",
    "MoEConfig",
    "MoEModel",
    "ModelDescription",
    "ModelLoadError",
    "Segment",
    "require",
]

Segment = tuple[RequestState, int, int]
"""One request's run of rows in a batch: ``(its state, position of its first token, token count)``."""


KVCache = RequestState
"""The per-request state under its older name (every layer softmax attention in most models)."""


DENSE_ROLES = frozenset(
    {
        *("q_proj", "k_proj", "v_proj", "o_proj", "q_gate", "lm_head"),
        *("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"),  # linear attention
        *("router", "shared_gate", "shared_up", "shared_down", "shared_expert_gate"),
        *("mlp_gate", "mlp_up", "mlp_down"),  # Gemma 4's dense MLP
    }
)
"""Resident matrices read only through :meth:`MoEModel.dense` (so they may be kept half-width, and
are then multiplied by the CPU kernel, whose rows never depend on the rows beside them)."""


class MoEModel(ExpertProducts, ModelDescription):
    """A MoE decoder split into the runtime's jobs; routed experts come from cache slots.

    Its description (config parsing, weight names and shapes, where experts lie) comes from
    :class:`runahead.models.description.ModelDescription`; this class adds the torch compute.

    Weights are kept under canonical names: ``embed``, ``norm``, ``lm_head`` and per layer ``l``
    ``l.input_norm``, ``l.q_proj`` ... ``l.o_proj`` (``.bias`` variants), ``l.q_norm``, ``l.k_norm``,
    ``l.post_norm``, ``l.router`` and for a shared expert ``l.shared_gate``, ``l.shared_up``,
    ``l.shared_down``, ``l.shared_expert_gate``. Built by :func:`runahead.models.loader.load_model`.
    """

    post_norm_feeds_all = True
    """The router, the routed experts and the shared expert all read :meth:`expert_input` (``l.post_norm``
    of the residual): a caller that has it passes it on (``normed``), and it is computed once a job."""

    def __init__(self, config: MoEConfig, weights: Mapping[str, Tensor]) -> None:
        self.config = config
        self.weights = dict(weights)
        if config.tie_word_embeddings or "lm_head" not in self.weights:
            self.weights["lm_head"] = self.weights["embed"]
        any_weight = self.weights["embed"]  # kept as stored (a GGUF's blocks): float32 compute
        self.dtype = torch.float32 if any_weight.dtype == torch.uint8 else any_weight.dtype
        self.device = any_weight.device
        rotary = config.rotary_dim or config.head_dim
        dims = torch.arange(0, rotary, 2, dtype=torch.float32, device=self.device)
        inv_freq = 1.0 / (config.rope_theta ** (dims / rotary))
        self.inv_freq = inv_freq / config.rope_scaling_factor
        self.rope_attention_factor = 1.0
        self.init_products()
        self._rope: dict[tuple[int, float, torch.dtype], tuple[Tensor, Tensor, Tensor]] = {}
        self._qkv: dict[int, tuple[int, int]] = {}
        if type(self).project_qkv is MoEModel.project_qkv:  # an override reads q, k and v itself
            for layer in range(config.num_layers):
                self._fuse_qkv(layer)

    def project_qkv(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[T, heads, head_dim]`` of the normed rows ``x``, before RoPE (q/k norm, clipping).

        One product for all three where their matrices share a type (:meth:`_fuse_qkv`); then q and
        k are adjacent views of its output, per-head normed in one call (with each half's own
        weight) and rotated in one call by :meth:`softmax_attention`: every element's arithmetic as
        in three products and two norms, each row's sums in the same order.
        """
        c, w, p = self.config, self.weights, f"{layer}."
        rows, dim = x.shape[0], c.head_dim
        fused = self._qkv.get(layer)
        if fused is None or rows > qkernel.max_rows():  # a prompt chunk's rows: torch's three products
            q = self.dense(x, p + "q_proj", w.get(p + "q_proj.bias"))
            k = self.dense(x, p + "k_proj", w.get(p + "k_proj.bias"))
            v = self.dense(x, p + "v_proj", w.get(p + "v_proj.bias"))
        else:
            nq, nk = fused
            y = self.dense(x, p + "qkv", self.derived.get(p + "qkv.bias"))
            q, k, v = y[:, :nq], y[:, nq : nq + nk], y[:, nq + nk :]
            both = self.derived.get(p + "qk_norm")
            if both is not None:
                heads = nq // dim
                qk = rms_norm(y[:, : nq + nk].view(rows, -1, dim), both, c.rms_norm_eps)
                return qk[:, :heads], qk[:, heads:], v.view(rows, -1, dim)
        if c.qk_norm == "full":
            q, k = self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm")
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q = q.view(rows, -1, dim)
        k = k.view(rows, -1, dim)
        v = v.view(rows, -1, dim)
        if c.qk_norm == "head":
            q, k = self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm")
        return q, k, v

    def _fuse_qkv(self, layer: int) -> None:
        """Put ``layer``'s q, k and v matrices back to back as one ``derived["<layer>.qkv"]`` matrix
        (biases too) where they share a type and block layout and the CPU kernel multiplies them
        (float32 compute, or a half-width compute of their dtype: each output's sum is then the same
        in one product as in three; torch's GEMM may sum otherwise, so there, and for more rows than
        the kernel takes, they stay three products). ``q_proj``, ``k_proj`` and
        ``v_proj`` become views of it (no second copy); for per-head q/k norms without clipping (and
        :meth:`norm` not overridden), both norms' weights become one ``qk_norm [q heads + k heads,
        head_dim]`` (each head's row its half's weight)."""
        c, w, p = self.config, self.weights, f"{layer}."
        names = [p + role for role in ("q_proj", "k_proj", "v_proj")]
        if not all(name in w for name in names):
            return
        parts = [w[name] for name in names]
        biases = [w.get(name + ".bias") for name in names]
        same = (parts[0].dtype, parts[0].shape[1:], parts[0].device)
        alike = all((t.dtype, t.shape[1:], t.device) == same and t.is_contiguous() for t in parts)
        if not alike or len({b is None for b in biases}) > 1:
            return
        on_kernel = self.dtype in (torch.float32, parts[0].dtype) and parts[0].device.type == "cpu"
        if not on_kernel or not matrix_kind(parts[0]):
            return  # torch's products: one fused product may round otherwise than the three
        sizes = [t.shape[0] for t in parts]
        fused = self.derived[p + "qkv"] = torch.cat(parts)
        for name, view in zip(names, torch.split(fused, sizes), strict=True):
            w[name] = view
        if biases[0] is not None:
            self.derived[p + "qkv.bias"] = torch.cat([b for b in biases if b is not None])
        self._qkv[layer] = sizes[0], sizes[1]
        if c.qk_norm == "head" and c.clip_qkv is None and type(self).norm is MoEModel.norm:
            heads = [size // c.head_dim for size in sizes[:2]]
            norms = [w[p + "q_norm"].expand(heads[0], -1), w[p + "k_norm"].expand(heads[1], -1)]
            self.derived[p + "qk_norm"] = torch.cat(norms)

    def shared_expert(self, layer: int, x: Tensor) -> Tensor | None:
        """The always-on shared expert's output for normed rows ``x``, or ``None`` when there is none."""
        c, p = self.config, f"{layer}."
        if not c.shared_expert_size:
            return None
        out = self.dense_mlp(x, p + "shared_gate", p + "shared_up", p + "shared_down")
        if c.shared_expert_gate:
            out = torch.sigmoid(self.dense(x, p + "shared_expert_gate")) * out
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
        return self.embedding_rows(token_ids)

    def embedding_rows(self, token_ids: Tensor) -> Tensor:
        """The embedding's rows of ``token_ids`` in the compute dtype (an embedding kept as stored,
        a GGUF's blocks, widened row by row: never the whole table)."""
        from runahead.models.quant import widened

        w, ids = self.weights["embed"], token_ids.to(self.device)
        return F.embedding(ids, w) if w.dtype == self.dtype else widened(w[ids], self.dtype)

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
        cos, sin = self.rope_rows(layer, segments, q.dtype)  # once for q and k
        joint = _adjacent(q, k)
        if joint is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # q and k side by side in one tensor: one call, the same elementwise arithmetic
            qk = apply_rope(joint, cos, sin)
            q, k = qk[:, : q.shape[1]], qk[:, q.shape[1] :]
        window = self.config.window(layer)
        # Each run's rows as views ``[1, heads, n, head_dim]``, the layout attention reads, made by
        # one call per tensor for the whole group (a torch call is host time, a launch on a GPU);
        # the arithmetic is the per-run loop's.
        sizes = [n for _, _, n in segments]
        runs = zip(*(t.transpose(0, 1)[None].split_with_sizes(sizes, dim=2) for t in (q, k, v)), strict=True)
        outputs = []
        for (state, start, n), (query, key, value) in zip(segments, runs, strict=True):
            keys, values, first = state.kv(layer).append(key, value)
            mask = attention_mask(start, n, first, keys.shape[2], window, self.device)
            outputs.append(self.attend(layer, query, keys, values, mask))
        heads = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [1, heads, T, head_dim]
        return self.attention_output(layer, x, heads[0].transpose(0, 1).reshape(x.shape[0], -1))

    def attend(self, layer: int, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """Scaled dot-product attention ``[1, heads, n, head_dim]`` of one run's queries over its keys
        (``[1, kv_heads, stored, head_dim]``; ``mask``: ``[n, stored]``, True = attend)."""
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)

    def attention_output(self, layer: int, x: Tensor, attn: Tensor) -> Tensor:
        """Output projection of the heads' outputs ``attn [T, heads * head_dim]`` (``x``: normed input)."""
        w = self.weights
        return self.dense(attn, f"{layer}.o_proj", w.get(f"{layer}.o_proj.bias"))

    def post_normed(self, layer: int, hidden: Tensor, normed: Tensor | None) -> Tensor:
        """The post-attention norm of ``hidden`` (what the router and the shared expert of ``layer``
        read): ``normed`` where the caller has it, else computed here."""
        return self.norm(hidden, f"{layer}.post_norm") if normed is None else normed

    @torch.no_grad()
    def route(self, layer: int, hidden: Tensor, normed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The gate of ``layer``: post-attention norm (``normed``, if the caller has it), then router
        softmax and top-k.

        Returns ``(expert ids [T, k] long, weights [T, k])`` as transformers computes them: softmax
        in float32 over all experts, top-k, then renormalised over the k when ``norm_topk_prob``.
        """
        c = self.config
        x = self.post_normed(layer, hidden, normed)
        probs = torch.softmax(self.dense(x, f"{layer}.router").float(), dim=-1)
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
        ids: Tensor | None,
        weights: Tensor,
        experts: Mapping[int, Tensor],
        out: Tensor | None = None,
        routing: ExpertRows | None = None,
        normed: Tensor | None = None,
    ) -> Tensor:
        """Add the routed-expert contributions of just the ``experts`` given to ``out`` (zeros if None).

        The expert-compute seam. A job whose experts do not all fit in the cache at once (a prefill
        chunk) runs its MoE in waves: one call per wave, then :meth:`moe_finish`. ``routing`` is the
        group's (row, k) pairs sorted by expert (:class:`ExpertRows`); a backend that holds the
        routing on the host passes it, so the MoE needs no device-to-host read (``ids`` is then not
        read and may be None). Without it the pairs are found from ``ids``. ``normed``:
        :meth:`expert_input` of ``hidden``, where the caller has it (:attr:`post_norm_feeds_all`).

        The grouped product (:meth:`moe_products`), added back with one scatter. Per row the sum
        runs in ascending expert order, as a loop over experts would add them, so the result is the
        same to the bit.
        """
        if routing is None:
            if ids is None:
                raise ValueError("moe_partial needs the routing or the expert ids")
            routing = ExpertRows.from_ids(ids, experts)
        y = self.moe_products(layer, hidden, weights, experts, routing, normed)
        if out is None:
            out = torch.zeros_like(hidden)
        return out if y is None else out.index_add_(0, routing.rows, y)

    def moe_products(
        self,
        layer: int,
        hidden: Tensor,
        weights: Tensor,
        experts: Mapping[int, Tensor],
        routing: ExpertRows,
        normed: Tensor | None = None,
    ) -> Tensor | None:
        """Every routed pair's expert output times its routing weight, ``[pairs, H]`` in ``routing``'s
        order (None when nothing routes to ``experts``): what :meth:`moe_partial` adds up.

        The rows are gathered once in expert order and each expert runs over its contiguous run of
        them (gate and up as one product).
        """
        if not routing.spans:
            return None
        x = self.expert_input(layer, hidden) if normed is None else normed
        gathered = x.index_select(0, routing.rows)
        y = self.stored_experts(layer, gathered, routing.spans, experts)
        if y is None:
            y = self.pooled_experts(gathered, routing.spans, experts)
        if y is None:
            parts = []
            for expert, start, stop in routing.spans:
                slot = self.expert_weights(layer, experts[expert], x.dtype)
                parts.append(self.run_expert(slot, gathered[start:stop]))
            y = torch.cat(parts) if len(parts) > 1 else parts[0]
        k = weights.shape[-1]
        return y * weights.reshape(-1).index_select(0, routing.rows * k + routing.kpos).unsqueeze(1)

    def expert_input(self, layer: int, hidden: Tensor) -> Tensor:
        """What the routed experts of ``layer`` read: the post-attention norm of ``hidden``."""
        return self.norm(hidden, f"{layer}.post_norm")

    def moe_finish(self, layer: int, hidden: Tensor, out: Tensor, normed: Tensor | None = None) -> Tensor:
        """Close the MoE block: add the shared expert (if any) and the residual to the routed sum."""
        if self.config.shared_expert_size:  # the norm only where a shared expert reads it
            x = self.post_normed(layer, hidden, normed if self.post_norm_feeds_all else None)
            shared = self.shared_expert(layer, x)
            if shared is not None:
                out = out + shared
        return hidden + out

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head: logits ``[T, vocab]`` (the end of a token's last job)."""
        x = self.norm(hidden, "norm")
        return self.dense(x, "lm_head")

    def rope_frequencies(self, layer: int) -> Tensor:
        """RoPE inverse frequencies of ``layer`` (one per rotated pair of dims; zeros leave a pair as is)."""
        return self.inv_freq

    def rope_rows(self, layer: int, segments: Sequence[Segment], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin ``[T, 1, rotary]`` (:func:`rope_tables`) for the rows of ``segments`` at
        ``layer``.

        Read from a table of every position up to the longest seen so far (per set of frequencies,
        grown by doubling), made by :func:`rope_tables` itself: each value is computed as it would
        be alone, so no row's rotation depends on the rows beside it.
        """
        inv_freq, factor = self.rope_frequencies(layer), self.rope_attention_factor
        end = max(start + n for _, start, n in segments)
        key = (id(inv_freq), factor, dtype)
        entry = self._rope.get(key)
        if entry is None or entry[0] is not inv_freq or entry[1].shape[0] < end:
            size = max(256, 1 << (end - 1).bit_length())
            positions = torch.arange(size, device=self.device)
            entry = self._rope[key] = (inv_freq, *rope_tables(positions, inv_freq, factor, dtype))
        _, cos, sin = entry
        if len(segments) == 1:
            _, start, n = segments[0]
            return cos[start : start + n], sin[start : start + n]
        rows = [p for _, start, n in segments for p in range(start, start + n)]
        at = int_tensor(rows, self.device)
        return cos[at], sin[at]


def _adjacent(q: Tensor, k: Tensor) -> Tensor | None:
    """``[T, q heads + k heads, D]``: one view of ``q`` and ``k`` where ``k``'s heads follow ``q``'s in
    memory with the same strides (:meth:`MoEModel.project_qkv`'s fused product), else None."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.device != k.device:
        return None
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.stride() != k.stride():
        return None
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
