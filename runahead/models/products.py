"""Where a model's matrix products run: the CPU kernel on weights as stored (or float32), or torch.

:class:`ExpertProducts` is the part of :class:`runahead.models.base.MoEModel` that multiplies: the
resident matrices (:meth:`~ExpertProducts.dense`: projections, routers, shared experts, LM head) and a
group's routed experts from their cache slots (:meth:`~ExpertProducts.stored_experts`, else
:meth:`~ExpertProducts.expert_weights` and :meth:`~ExpertProducts.run_expert` per expert). On a CPU
with the kernel (:mod:`runahead.models.qkernel`) float32 rows are multiplied by the weights as the
file stores them (Q4_0, Q8_0, BF16, F16) or as float32, a decode row at a time from prefetched memory,
and each row's sums never depend on the rows beside it; elsewhere torch multiplies. An architecture
overrides :meth:`~ExpertProducts.run_expert` (gpt-oss: biases and clamps) or
:meth:`~ExpertProducts.glu` (its activation) here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from runahead.models import qkernel
from runahead.models.description import MoEConfig
from runahead.models.layout import ExpertLayout, SlotFormat
from runahead.models.pooled import PooledExperts, aligned, grouped_mm, pooled_by_default

log = structlog.get_logger("runahead.models")

WIDEN_MAX_WEIGHTS = 16 << 20
"""A stored resident matrix with more weights than this (64 MiB in float32: an LM head) is never
widened for a prefill chunk; :meth:`ExpertProducts.dense` runs its rows through the kernel instead."""


class ExpertProducts:
    """The matrix products of a :class:`~runahead.models.base.MoEModel` (a mixin: it reads the model's
    ``config`` and ``weights``)."""

    config: MoEConfig
    weights: dict[str, Tensor]
    slot_formats: Mapping[int, SlotFormat] | None
    """Per layer, how a stored slot holds its experts (:meth:`keep_stored`), or None when slots
    hold experts in the compute dtype. See :meth:`expert_weights`."""

    def init_products(self) -> None:
        """Slots in the compute dtype, nothing cached yet (called by the model's ``__init__``)."""
        self.slot_formats = None
        self.derived: dict[str, Tensor] = {}
        """Matrices made from ``weights`` (no checkpoint holds them: a layer's q, k and v as one),
        multiplied by :meth:`dense` by key like the weights."""
        self._scratch: dict[torch.device, Tensor] = {}
        self._pooled: PooledExperts | None = None
        self._stored_kinds: dict[int, str | None] = {}
        self._dense_kinds: dict[str, str] = {}

    def dense(self, x: Tensor, key: str, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x, weights[key], bias)`` for a resident matrix: the projections and the LM head.

        On CPU, for float32 rows, the kernel multiplies (:meth:`_dense_kind`) a matrix kept as stored
        (half-width: :func:`~runahead.models.loader.kept_half`; or a GGUF's Q4_0 / Q8_0 blocks, ``uint8
        [rows, blocks, block bytes]``: :func:`runahead.models.gguf.read_gguf`) or a float32 one, at
        most :func:`~runahead.models.qkernel.max_rows` rows at once: one decode row at a time from
        prefetched memory (faster than torch's product at decode's few rows), and each row's sums
        never depend on the rows beside it, so a float32 checkpoint's logits too are the same however
        a schedule batches its requests. More rows (a prefill chunk's) go to torch, a stored matrix
        widened for the call: the same products, summed in another order. A stored matrix whose
        widened copy would be large (an LM head) is never widened: its rows go through the kernel a
        few at a time. In a bfloat16 or float16 compute a matrix of that dtype takes the kernel's
        half-width pass at decode's rows (:func:`half_product`: torch's rounding, the same per row
        whatever the rows beside it); more rows go to torch's half-width product.
        """
        w = self.weights.get(key)
        if w is None:
            w = self.derived[key]
        kind = self._dense_kind(key, w)
        if kind and x.device.type == "cpu" and x.dim() == 2:
            limit = qkernel.max_rows()
            if x.dtype == w.dtype != torch.float32:  # a half-width compute: see half_product
                if x.shape[0] <= limit:
                    return half_product(x, w.data_ptr(), kind, w.shape[0], bias)
            elif x.dtype == torch.float32:
                if x.shape[0] <= limit:  # decode's rows: one call
                    y = qkernel.product(x, w.data_ptr(), kind, w.shape[0])
                    return y if bias is None else y + bias
                if kind != qkernel.FLOAT32 and w.shape[0] * x.shape[1] > WIDEN_MAX_WEIGHTS:
                    parts = [
                        qkernel.product(x[i : i + limit], w.data_ptr(), kind, w.shape[0])
                        for i in range(0, x.shape[0], limit)
                    ]
                    y = torch.cat(parts)
                    return y if bias is None else y + bias
        if w.dtype == x.dtype:  # the compute dtype's own: no widening
            return F.linear(x, w, bias)
        from runahead.models.quant import widened

        return F.linear(x, widened(w, x.dtype), bias)

    def _dense_kind(self, key: str, w: Tensor) -> str:
        """How :meth:`dense` multiplies ``key``'s matrix ``w`` on the CPU (:func:`matrix_kind`): the kernel
        type (:data:`~runahead.models.qkernel.CODES`) of a stored matrix, or of a float32 or half-width
        one the kernel takes, else ``""`` (torch). Found once per key."""
        kind = self._dense_kinds.get(key)
        if kind is None:
            kind = self._dense_kinds[key] = matrix_kind(w)
        return kind

    def keep_stored(self, layout: ExpertLayout) -> None:
        """Read experts from slots of the ``stored`` ``layout`` (each expert as its file stores it:
        GGUF's types, or a half-width safetensors checkpoint's:
        :func:`~runahead.models.layout.kept_as_stored`)."""
        self.slot_formats = {layer: layout.slot_format(layer) for layer in range(layout.num_layers)}
        self._stored_kinds.clear()
        self._pooled = None  # the grouped products read compute-dtype slots only

    def use_slot_pool(self, pool: Tensor, grouped: bool | None = None) -> None:
        """Run a group's experts as two grouped products over the cache's slot ``pool`` (the
        ``[num_slots, slot_numel]`` tensor of :class:`runahead.store.SlotPool`; :mod:`.pooled`) where
        ``grouped`` says so: None for :func:`~runahead.models.pooled.pooled_by_default`. Only for
        slots in the compute dtype of a model whose experts are :meth:`run_expert`'s, laid out on 16
        bytes; elsewhere, and where torch has no grouped product, the call changes nothing."""
        product = grouped_mm()
        plain = type(self).run_expert is ExpertProducts.run_expert
        wanted = pooled_by_default(pool.device, pool.dtype) if grouped is None else grouped
        c = self.config
        inter, hidden = c.intermediate_size, c.hidden_size
        self._pooled = None
        usable = plain and self.slot_formats is None and pool.is_floating_point()
        if wanted and product is not None and usable and aligned(pool, inter, hidden):
            self._pooled = PooledExperts(pool, inter, hidden, product)

    def pooled_experts(
        self, rows: Tensor, spans: Sequence[tuple[int, int, int]], experts: Mapping[int, Tensor]
    ) -> Tensor | None:
        """A group's experts as grouped products over the slot pool (:meth:`use_slot_pool`), or None
        where that does not apply (then the caller loops over experts). Should torch refuse the
        product (a device or layout it does not take), the loop takes over for good, with a warning."""
        pooled = self._pooled
        if pooled is None or not spans or rows.dtype != pooled.pool.dtype:
            return None
        try:
            return pooled.products(rows, spans, experts, self.glu)
        except RuntimeError as err:  # torch checks shapes, strides and devices before it launches
            log.warning("grouped expert products refused; looping over experts", error=str(err))
            self._pooled = None
            return None

    def stored_experts(
        self, layer: int, rows: Tensor, spans: Sequence[tuple[int, int, int]], experts: Mapping[int, Tensor]
    ) -> Tensor | None:
        """Every expert of a group straight from its stored slot (Q4_0, Q8_0, BF16, F16) or its float32
        compute-dtype slot, or None where this does not apply (then
        :meth:`~runahead.models.base.MoEModel.moe_partial` dequantizes each expert and calls
        :meth:`run_expert`).

        ``rows``: the group's rows in expert order, ``spans``: ``(expert, start, stop)`` runs of them.
        On CPU, for float32 rows and a layer whose ``gate``, ``up``, ``down`` share one such type, the
        products run on the stored bytes (:func:`runahead.models.qkernel.grouped_product`: gate and
        up as one ``[2I, H]`` product, as :meth:`run_expert` runs them), two calls for the whole group
        and no float32 copy of the experts. An expert with more than :func:`~runahead.models.qkernel.max_rows`
        rows (a prefill chunk's) is dequantized and multiplied by torch instead, which is faster there.
        """
        if rows.device.type != "cpu" or not spans:
            return None
        layout = self._kernel_layout(layer, experts[spans[0][0]].dtype, rows.dtype)
        if layout is None:
            return None
        kind, gate_at, down_at = layout
        limit = qkernel.max_rows()
        inter, width = self.config.intermediate_size, self.config.hidden_size
        few = [(experts[e].data_ptr(), a, b) for e, a, b in spans if b - a <= limit]
        if few:
            runs = [(start, stop) for _, start, stop in few]
            gate_up = _grouped(rows, [slot + gate_at for slot, _, _ in few], runs, kind, 2 * inter)
            hidden = self.glu(gate_up[:, :inter], gate_up[:, inter:])  # rows of no run: zeros
            out = _grouped(hidden, [slot + down_at for slot, _, _ in few], runs, kind, width)
        else:
            out = torch.empty(rows.shape[0], width, dtype=rows.dtype)
        for expert, start, stop in spans:
            if stop - start > limit:
                weights = self.expert_weights(layer, experts[expert], rows.dtype)
                out[start:stop] = self.run_expert(weights, rows[start:stop])
        return out

    def _kernel_layout(
        self, layer: int, slot_dtype: torch.dtype, row_dtype: torch.dtype
    ) -> tuple[str, int, int] | None:
        """``(kind, gate | up byte offset, down byte offset)`` of ``layer``'s slots for the CPU kernel, or
        None where it does not apply: for float32 rows a stored slot of one kernel type
        (:meth:`_stored_kind`, a file's F32 included); for rows of the slots' own dtype, a compute-dtype
        slot (``gate | up | down`` back to back) in float32, bfloat16 or float16 of a model whose
        experts are :meth:`run_expert`'s (not gpt-oss's, with biases and clamps)."""
        kind = self._stored_kind(layer)
        if kind is not None:
            assert self.slot_formats is not None
            gate, _, down = self.slot_formats[layer].parts
            return (kind, gate.start, down.start) if row_dtype == torch.float32 else None
        c = self.config
        plain = type(self).run_expert is ExpertProducts.run_expert
        if self.slot_formats is not None or slot_dtype != row_dtype or not plain:
            return None
        kind = qkernel.FLOAT32 if slot_dtype == torch.float32 else qkernel.HALF_KINDS.get(slot_dtype)
        if kind is None or not qkernel.multiplies(kind, (c.hidden_size, c.intermediate_size)):
            return None
        return kind, 0, 2 * c.intermediate_size * c.hidden_size * slot_dtype.itemsize

    def _stored_kind(self, layer: int) -> str | None:
        """The one kernel type (:data:`~runahead.models.qkernel.CODES`) of ``layer``'s ``gate | up | down``
        slots, or None where the kernel does not multiply them."""
        if self.slot_formats is None:
            return None
        if layer not in self._stored_kinds:
            parts = self.slot_formats[layer].parts
            kinds = {p.kind for p in parts}
            usable = tuple(p.role for p in parts) == ("gate", "up", "down") and len(kinds) == 1
            kind = kinds.pop() if usable else None
            fits = kind is not None and qkernel.multiplies(kind, [p.shape[-1] for p in parts])
            self._stored_kinds[layer] = kind if fits else None
        return self._stored_kinds[layer]

    def expert_weights(self, layer: int, slot: Tensor, dtype: torch.dtype) -> Tensor:
        """Cache slot ``slot`` of ``layer`` as :meth:`run_expert` reads it: the flat slot in ``dtype``.

        A compute-dtype slot is only cast; a stored slot (``slot_formats``: Q4_0, Q8_0, ...) is
        dequantized on its device into the model's one scratch buffer (in float32), valid until the
        next call: use each expert's weights before asking for the next one's, as ``moe_partial`` does.
        """
        if self.slot_formats is None:
            return slot if slot.dtype == dtype else slot.to(dtype)
        from runahead.models.quant import dequantize_slot

        # One float32 scratch buffer, reused expert after expert: the compute is one thread (and on
        # CUDA one stream, so a reuse waits for the kernels that read the previous expert). Saves a
        # fresh 3 * I * H allocation per expert (here ~1.3 ms of a Q4_0 expert's ~2.2 ms).
        fmt = self.slot_formats[layer]
        need = sum(math.prod(part.shape) for part in fmt.parts)  # the matrices (and gpt-oss's biases)
        scratch = self._scratch.get(slot.device)
        if scratch is None or scratch.numel() < need:
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                scratch = torch.empty(need, dtype=torch.float32, device=slot.device)
            self._scratch[slot.device] = scratch
        return dequantize_slot(slot, fmt, dtype, scratch)

    def run_expert(self, slot: Tensor, x: Tensor) -> Tensor:
        """One routed expert held in cache slot ``slot`` (the format of :mod:`.layout`) on rows ``x``.

        Gate and up lie back to back in the slot, so they run as one ``[2I, H]`` product (as
        transformers runs its fused ``gate_up_proj``).
        """
        c = self.config
        inter, block = c.intermediate_size, c.intermediate_size * c.hidden_size
        gate_up = F.linear(x, slot[: 2 * block].view(2 * inter, c.hidden_size))
        down = slot[2 * block : 3 * block].view(c.hidden_size, inter)
        return F.linear(self.glu(gate_up[:, :inter], gate_up[:, inter:]), down)

    def expert(self, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
        """One expert (or dense MLP) on rows ``x``: ``down(glu(gate(x), up(x)))``."""
        return F.linear(self.glu(F.linear(x, gate), F.linear(x, up)), down)

    def dense_mlp(self, x: Tensor, gate: str, up: str, down: str) -> Tensor:
        """A resident MLP (a shared expert, a dense layer) on rows ``x``, its matrices named by key:
        :meth:`expert`'s arithmetic through :meth:`dense`."""
        return self.dense(self.glu(self.dense(x, gate), self.dense(x, up)), down)

    def glu(self, gate: Tensor, up: Tensor) -> Tensor:
        """The gated unit of an expert: ``act(gate) * up``, SiLU unless overridden."""
        return F.silu(gate) * up


def half_product(x: Tensor, matrix: int, kind: str, n: int, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` on the CPU kernel for half-width rows ``x`` (bfloat16, float16: decode's,
    at most :func:`~runahead.models.qkernel.max_rows`) and a matrix ``w [n, K]`` of their dtype
    (``kind``, at address ``matrix``).

    The rows are widened to float32 (exactly), summed in float32, the bias added, and the result
    rounded once to the rows' dtype: torch's half-width product's arithmetic, its sums in another
    order. So each row's result never depends on the rows beside it (torch's half-width products
    pick their blocking by the row count), and at decode's few rows it is 2-3x faster here
    (``bench/dense_kernel.py --dtype bfloat16``). Where the build has bf16 dot products
    (:func:`~runahead.models.qkernel.bf16_dot`) bfloat16 rows go in as they are
    (:data:`~runahead.models.qkernel.BF16_DOT`: the same products, added in another order)."""
    rows, as_kind = _kernel_rows(x, kind)
    y = qkernel.product(rows, matrix, as_kind, n)
    if bias is not None:
        y += bias
    return y.to(x.dtype)


def _grouped(rows: Tensor, matrices: list[int], runs: list[tuple[int, int]], kind: str, n: int) -> Tensor:
    """:func:`~runahead.models.qkernel.grouped_product` for float32 rows, or for half-width rows of the
    matrices' own dtype (:func:`_kernel_rows`), the result rounded once to that dtype, as torch's
    half-width product rounds it."""
    if rows.dtype == torch.float32:
        return qkernel.grouped_product(rows, matrices, runs, kind, n)
    x, as_kind = _kernel_rows(rows, kind)
    return qkernel.grouped_product(x, matrices, runs, as_kind, n).to(rows.dtype)


def _kernel_rows(x: Tensor, kind: str) -> tuple[Tensor, str]:
    """Half-width rows ``x`` as the kernel takes them for a ``kind`` matrix of their dtype: bfloat16 rows
    as they are with the bf16 dot products where the build has them, else widened to float32."""
    if kind == "BF16" and qkernel.bf16_dot():
        return x, qkernel.BF16_DOT
    return x.float(), kind


def matrix_kind(w: Tensor) -> str:
    """How :meth:`ExpertProducts.dense` multiplies resident matrix ``w``: a Q4_0 / Q8_0 one's kernel type
    (:func:`~runahead.models.quant.stored_kind`); for a float32, bfloat16 or float16 one the kernel
    takes (CPU, contiguous, columns whole blocks) :data:`~runahead.models.qkernel.FLOAT32` or its
    half-width type (a matrix kept as stored, or the compute dtype's own); else ``""`` (torch)."""
    if w.dtype == torch.uint8:
        from runahead.models.quant import stored_kind

        return stored_kind(w)
    kind = qkernel.FLOAT32 if w.dtype == torch.float32 else qkernel.HALF_KINDS.get(w.dtype, "")
    plain = kind and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()
    return kind if plain and qkernel.multiplies(kind, (w.shape[1],)) else ""
