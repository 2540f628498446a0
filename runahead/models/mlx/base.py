"""The MoE decoder on MLX, split into the runtime's jobs; routed experts come from slot pools.

The same split as the torch models (:mod:`runahead.models.base`): job ``l -> l+1`` is
:meth:`MLXModel.moe_products` / :meth:`MLXModel.moe_finish` of layer ``l``, then
:meth:`MLXModel.attention` and :meth:`MLXModel.route` of layer ``l+1``; the entry job embeds; the
last ends in :meth:`MLXModel.logits`. The arithmetic is mlx-lm's (``mx.fast.rms_norm``,
``mx.fast.rope``, ``mx.fast.scaled_dot_product_attention``, ``mx.quantized_matmul`` for the
matrices mlx-lm quantized, and its ``SwitchGLU``: ``gather_mm`` / ``gather_qmm`` over expert
indices, rows sorted by index when there are many), so a folder decodes as mlx-lm decodes it. The
expert indices here are *slot* indices into the pools of :mod:`runahead.models.mlx.slots`.

Projections and the MoE are batched over every row of a group; attention runs per request over its
own state (:class:`RequestStateMLX`: keys and values, or an architecture's recurrent state). An
architecture's file overrides :meth:`MLXModel.route` (each reproduces its mlx-lm router) or the
hooks (:meth:`MLXModel.norm`, :meth:`MLXModel.mix`, :meth:`MLXModel.layer_state`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from runahead.models.description import MoEConfig
from runahead.models.mlx.checkpoint import Checkpoint, MatrixFormat, Quant


def moe_sum(products: mx.array, dtype: Any) -> mx.array:
    """The MoE's routed sum ``[T, H]`` of its weighted products ``[T, k, H]``
    (:meth:`MLXModel.moe_products`): ``sum_k`` in k's order, as mlx-lm's ``SwitchGLU`` block adds them."""
    return products.sum(axis=-2).astype(dtype)


class KVLayerMLX:
    """One layer's keys and values ``[1, kv_heads, stored, head_dim]``, grown in steps like mlx-lm's cache."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.length = 0

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[1, kv_heads, n, dim]`` keys / values; return every stored key and value."""
        prev, n = self.length, keys.shape[2]
        if self.keys is None or self.values is None or prev + n > self.keys.shape[2]:
            steps = (self.step + n - 1) // self.step
            new_k = mx.zeros((1, keys.shape[1], steps * self.step, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((1, values.shape[1], steps * self.step, values.shape[3]), values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.length = prev + n
        self.keys[..., prev : self.length, :] = keys
        self.values[..., prev : self.length, :] = values
        return self.keys[..., : self.length, :], self.values[..., : self.length, :]

    def arrays(self) -> list[mx.array]:
        """The arrays to evaluate after a group (so no lazy graph keeps old buffers alive)."""
        return [a for a in (self.keys, self.values) if a is not None]


class RequestStateMLX:
    """Every layer's state of one request (keys and values, or a recurrent state): allocated at
    admission, dropped at completion or cancellation."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.layers = list(layers)

    def arrays(self) -> list[mx.array]:
        """Arrays of every layer (to evaluate with a group's results)."""
        return [a for layer in self.layers for a in layer.arrays()]


Segment = tuple[RequestStateMLX, int, int]
"""One request's run of rows in a batch: ``(its state, position of its first token, token count)``."""


class MLXModel:
    """A MoE decoder on MLX over a :class:`~runahead.models.mlx.checkpoint.Checkpoint`'s resident weights."""

    post_norm_feeds_all = True
    """Whether the router and the shared expert read :meth:`expert_input` too (the post-attention
    norm of the residual), as the torch models' attribute of the same name says: a caller that has
    it passes it on (``normed``), so it is computed once a job. Gemma 4's router has its own norm."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.config: MoEConfig = checkpoint.config
        self.weights = dict(checkpoint.weights)
        self.quant: dict[str, Quant] = dict(checkpoint.quant)
        self.formats: dict[str, MatrixFormat] = dict(checkpoint.formats)
        c = self.config
        self.tied = c.tie_word_embeddings or "lm_head" not in self.weights
        self.scale = c.head_dim**-0.5
        self.rope_scale = 1.0 / c.rope_scaling_factor

    # -- resident matrices --------------------------------------------------------------------

    def linear(self, x: mx.array, name: str) -> mx.array:
        """``x @ W.T`` (+ bias) with resident matrix ``name``, quantized as mlx-lm stored it or not."""
        w, q = self.weights[name], self.quant.get(name)
        if q is None:
            out = x @ w.T
        else:
            out = mx.quantized_matmul(
                x,
                w,
                scales=self.weights[name + ".scales"],
                biases=self.weights[name + ".biases"],
                transpose=True,
                group_size=q.group_size,
                bits=q.bits,
            )
        bias = self.weights.get(name + ".bias")
        return out if bias is None else out + bias

    def norm(self, x: mx.array, name: str) -> mx.array:
        """RMSNorm with the resident weight ``name`` (mlx-lm's ``nn.RMSNorm``)."""
        return mx.fast.rms_norm(x, self.weights[name], self.config.rms_norm_eps)

    # -- the job pieces -----------------------------------------------------------------------

    def new_state(self) -> RequestStateMLX:
        """The state of one new request: each layer's, as :meth:`layer_state` chooses it."""
        return RequestStateMLX([self.layer_state(layer) for layer in range(self.config.num_layers)])

    def layer_state(self, layer: int) -> Any:
        """A new request's state for ``layer``: keys and values unless an architecture overrides it."""
        return KVLayerMLX()

    def embed(self, tokens: mx.array) -> mx.array:
        """Hidden rows ``[T, H]`` of token ids ``[T]``."""
        w, q = self.weights["embed"], self.quant.get("embed")
        if q is None:
            return w[tokens]
        return mx.dequantize(
            w[tokens],
            self.weights["embed.scales"][tokens],
            self.weights["embed.biases"][tokens],
            group_size=q.group_size,
            bits=q.bits,
        )

    def attention(self, layer: int, hidden: mx.array, segments: Sequence[Segment]) -> mx.array:
        """``hidden + mix(input_norm(hidden))``; each run reads and advances only its own request's state."""
        for state, start, _ in segments:
            if state.layers[layer].length != start:
                raise ValueError(
                    f"layer {layer}: segment starts at {start}, its state holds {state.layers[layer].length}"
                )
        x = self.norm(hidden, f"{layer}.input_norm")
        return hidden + self.mix(layer, x, segments)

    def mix(self, layer: int, x: mx.array, segments: Sequence[Segment]) -> mx.array:
        """The token mixer of ``layer`` on normed rows ``x``: softmax attention unless overridden."""
        return self.softmax_attention(layer, x, segments)

    def softmax_attention(self, layer: int, x: mx.array, segments: Sequence[Segment]) -> mx.array:
        """Causal (windowed where the layer slides) attention of each run over its own keys, then out."""
        c = self.config
        q, k, v = self.project_qkv(layer, x)
        kv_heads = self.kv_heads(layer)
        outputs, row = [], 0
        for state, start, n in segments:
            kv = state.layers[layer]
            qs = q[row : row + n].reshape(1, n, c.num_attention_heads, -1).transpose(0, 2, 1, 3)
            ks = k[row : row + n].reshape(1, n, kv_heads, -1).transpose(0, 2, 1, 3)
            vs = v[row : row + n].reshape(1, n, kv_heads, -1).transpose(0, 2, 1, 3)
            qs, ks = self.rope(qs, start, layer), self.rope(ks, start, layer)
            keys, values = kv.append(ks, vs)
            mask = self.mask(layer, start, n)
            out = self.attend(layer, qs, keys, values, mask)
            outputs.append(out.transpose(0, 2, 1, 3).reshape(n, -1))
            row += n
        attn = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
        return self.attention_output(layer, x, attn)

    def kv_heads(self, layer: int) -> int:
        """Key/value heads of ``layer``'s attention."""
        return self.config.num_kv_heads

    def attend(self, layer: int, q: mx.array, keys: mx.array, values: mx.array, mask: Any) -> mx.array:
        """Scaled dot-product attention of one run ``[1, heads, n, head_dim]`` over its keys."""
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)

    def attention_output(self, layer: int, x: mx.array, attn: mx.array) -> mx.array:
        """Output projection of the heads' outputs ``attn [T, heads * head_dim]`` (``x``: normed input)."""
        return self.linear(attn, f"{layer}.o_proj")

    def project_qkv(self, layer: int, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v ``[T, heads * head_dim]`` of the normed rows ``x`` (q/k norms as the config says)."""
        c, p = self.config, f"{layer}."
        q, k, v = self.linear(x, p + "q_proj"), self.linear(x, p + "k_proj"), self.linear(x, p + "v_proj")
        if c.qk_norm == "full":
            q, k = self.norm(q, p + "q_norm"), self.norm(k, p + "k_norm")
        elif c.qk_norm == "head":
            t = x.shape[0]
            q = self.norm(q.reshape(t, -1, c.head_dim), p + "q_norm").reshape(t, -1)
            k = self.norm(k.reshape(t, -1, c.head_dim), p + "k_norm").reshape(t, -1)
        if c.clip_qkv is not None:
            q, k, v = (mx.clip(a, -c.clip_qkv, c.clip_qkv) for a in (q, k, v))
        return q, k, v

    def rope(self, x: mx.array, offset: int, layer: int) -> mx.array:
        """RoPE of ``x [1, heads, n, head_dim]`` at positions ``offset..`` (``nn.RoPE``, not traditional)."""
        c = self.config
        dims = c.rotary_dim or c.head_dim
        return mx.fast.rope(
            x, dims, traditional=False, base=c.rope_theta, scale=self.rope_scale, offset=offset
        )

    def mask(self, layer: int, start: int, n: int) -> Any:
        """The attention mask of ``n`` queries at ``start..`` over keys ``0..start+n-1``: mlx-lm's
        ``"causal"`` (or none for one query), an explicit band where the layer's window bites."""
        window = self.config.window(layer)
        if window is None or start + n <= window:
            return "causal" if n > 1 else None
        q_pos = mx.arange(start, start + n)[:, None]
        k_pos = mx.arange(0, start + n)[None, :]
        return (k_pos <= q_pos) & (k_pos > q_pos - window)

    def post_normed(self, layer: int, hidden: mx.array, normed: mx.array | None) -> mx.array:
        """The post-attention norm of ``hidden`` (what the router and the shared expert of ``layer``
        read): ``normed`` where the caller has it, else computed here."""
        return self.norm(hidden, f"{layer}.post_norm") if normed is None else normed

    def route(
        self, layer: int, hidden: mx.array, normed: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """The gate of ``layer`` on ``hidden``: ``(expert ids [T, k], weights [T, k])``, as mlx-lm's
        Qwen2-MoE / OLMoE router computes them (softmax, top-k, renormalised if ``norm_topk_prob``).
        ``normed``: :meth:`expert_input` of ``hidden``, where the caller has it
        (:attr:`post_norm_feeds_all`)."""
        c = self.config
        gates = mx.softmax(
            self.linear(self.post_normed(layer, hidden, normed), f"{layer}.router"), axis=-1, precise=True
        )
        k = c.top_k
        ids = mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k]
        scores = mx.take_along_axis(gates, ids, axis=-1)
        if c.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return ids, scores

    def moe_products(
        self,
        layer: int,
        hidden: mx.array,
        slots: mx.array,
        weights: mx.array,
        pools: Mapping[str, mx.array],
        normed: mx.array | None = None,
    ) -> tuple[mx.array, Any]:
        """The routed experts' weighted products ``weights * y`` ``[T, k, H]`` for rows ``hidden``
        (mlx-lm's ``SwitchGLU`` over slot indices ``slots [T, k]``), and the dtype their sum takes
        (:func:`moe_sum`). Pairs outside the current wave carry weight 0 (and any resident slot).
        ``normed``: :meth:`expert_input` of ``hidden``, where the caller has it."""
        x = self.switch_input(layer, hidden, normed)
        do_sort = slots.size >= 64
        idx, inv_order = slots, None
        if do_sort:
            flat = slots.flatten()
            order = mx.argsort(flat)
            inv_order = mx.argsort(order)
            x, idx = x.flatten(0, -3)[order // slots.shape[-1]], flat[order]
        up = self.switch(x, "up", idx, pools, do_sort)
        gate = self.switch(x, "gate", idx, pools, do_sort)
        y = self.switch(self.activation(gate, up), "down", idx, pools, do_sort)
        if inv_order is not None:
            y = mx.unflatten(y[inv_order], 0, slots.shape)
        y = y.squeeze(-2)
        return y * weights[..., None], y.dtype

    def switch_input(self, layer: int, hidden: mx.array, normed: mx.array | None) -> mx.array:
        """The routed experts' input ``[T, 1, 1, H]`` for the gathered products: ``normed`` where the
        caller has it, else :meth:`expert_input` of ``hidden``."""
        return mx.expand_dims(self.expert_input(layer, hidden) if normed is None else normed, (-2, -3))

    def expert_input(self, layer: int, hidden: mx.array) -> mx.array:
        """What the routed experts of ``layer`` read: the post-attention norm of ``hidden``."""
        return self.norm(hidden, f"{layer}.post_norm")

    def activation(self, gate: mx.array, up: mx.array) -> mx.array:
        """The experts' gated activation: SwiGLU (``silu(gate) * up``)."""
        return gate * mx.sigmoid(gate) * up

    def switch(
        self, x: mx.array, matrix: str, idx: mx.array, pools: Mapping[str, mx.array], sort: bool
    ) -> mx.array:
        """One expert matrix over slot indices ``idx``: ``gather_qmm`` if quantized, else ``gather_mm``."""
        fmt = self.formats[matrix]
        w = pools[f"{matrix}.weight"]
        if fmt.quant is None:
            return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sort)
        return mx.gather_qmm(
            x,
            w,
            pools[f"{matrix}.scales"],
            pools[f"{matrix}.biases"],
            rhs_indices=idx,
            transpose=True,
            group_size=fmt.quant.group_size,
            bits=fmt.quant.bits,
            sorted_indices=sort,
        )

    def moe_finish(
        self, layer: int, hidden: mx.array, routed: mx.array, normed: mx.array | None = None
    ) -> mx.array:
        """Close the MoE block: add the shared expert (if any) and the residual to the routed sum.
        ``normed``: :meth:`expert_input` of ``hidden``, where the caller has it."""
        c, p = self.config, f"{layer}."
        if c.shared_expert_size:
            x = self.post_normed(layer, hidden, normed if self.post_norm_feeds_all else None)
            gate, up = self.linear(x, p + "shared_gate"), self.linear(x, p + "shared_up")
            shared = self.linear(self.activation(gate, up), p + "shared_down")
            if c.shared_expert_gate:
                shared = mx.sigmoid(self.linear(x, p + "shared_expert_gate")) * shared
            routed = routed + shared
        return hidden + routed

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm and LM head (the embedding as a linear map when tied): ``[T, vocab]``."""
        x = self.norm(hidden, "norm")
        return self.linear(x, "embed" if self.tied else "lm_head")
