"""A group's routed experts as two grouped products over the whole expert cache (accelerators).

A loop over experts costs a handful of torch calls per expert, and on a GPU each call is host time
(tens of microseconds of Python and launch) while the kernels themselves take microseconds: a decode
group of 16 requests routes to ~100 experts. The cache's slots are one ``[num_slots, slot_numel]``
tensor (:class:`runahead.store.SlotPool`) whose rows hold ``gate | up | down`` back to back in the
compute dtype, so every slot's ``gate | up`` is one strided ``[num_slots, H, 2I]`` view and every
slot's ``down`` one ``[num_slots, I, H]`` view, with no copy. torch's grouped matrix product
(``torch.nn.functional.grouped_mm``) multiplies each run of rows by its own slot's matrices in one
call, given the rows sorted by slot and each slot's run end (``offs``); slots with no rows cost
nothing. A group's experts then take two grouped products, one activation and at most two index
calls, however many experts it routes to. This is how transformers runs its fused experts on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from runahead.models.hostcopy import int_tensor

GroupedMM = Callable[..., Tensor]


def grouped_mm() -> GroupedMM | None:
    """torch's grouped matrix product (``F.grouped_mm``, torch >= 2.10; ``torch._grouped_mm`` before),
    or None where this torch has neither."""
    found = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return found if callable(found) else None


def pooled_by_default(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a group's experts run as grouped products on ``device`` unless told otherwise.

    Where torch's grouped product has its fused kernel: bfloat16 on CUDA devices of compute
    capability 9.x (Hopper: H100, H200) with torch's public ``grouped_mm`` (torch >= 2.10). Elsewhere
    on CUDA torch falls back to a loop of products that first reads the run ends to the host (a
    device synchronisation per call), so until that is measured the loop over experts stays; on CPU
    the kernel of :mod:`runahead.models.qkernel` (or the loop) is the faster path.
    ``use_slot_pool(..., grouped=True)`` turns it on anywhere torch has the product.
    """
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(F, "grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def aligned(pool: Tensor, intermediate: int, hidden: int) -> bool:
    """Whether every matrix view of ``pool`` starts and strides on 16 bytes, as the grouped product's
    fused kernel requires."""
    size = pool.element_size()
    strides = (pool.stride(0) * size, intermediate * size, hidden * size, 2 * intermediate * hidden * size)
    return pool.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in strides)


class PooledExperts:
    """Every cache slot's expert matrices as views of the slot pool, and a group's products on them.

    ``pool``: the ``[num_slots, slot_numel]`` slot tensor; each slot holds ``gate [I, H]``, ``up [I, H]``
    and ``down [H, I]`` back to back (:meth:`runahead.models.products.ExpertProducts.run_expert`'s
    layout) in the compute dtype.
    """

    def __init__(self, pool: Tensor, intermediate: int, hidden: int, product: GroupedMM) -> None:
        block = intermediate * hidden
        if pool.dim() != 2 or pool.shape[1] < 3 * block or pool.stride(1) != 1:
            shape = tuple(pool.shape)
            raise ValueError(f"a slot pool of shape {shape} cannot hold experts of {3 * block} weights")
        self.pool, self.intermediate, self.product = pool, intermediate, product
        slots = pool.shape[0]
        self.gate_up = pool[:, : 2 * block].view(slots, 2 * intermediate, hidden).transpose(1, 2)
        self.down = pool[:, 2 * block : 3 * block].view(slots, hidden, intermediate).transpose(1, 2)
        self._base = pool.data_ptr()
        self._slot_bytes = pool.stride(0) * pool.element_size()
        self._end = slots * self._slot_bytes

    def slot_of(self, tensor: Tensor) -> int | None:
        """The pool slot ``tensor`` (a slot's view) starts, or None where it is not one of them."""
        at = tensor.data_ptr() - self._base
        if at < 0 or at >= self._end or at % self._slot_bytes:
            return None
        return at // self._slot_bytes

    def products(
        self,
        rows: Tensor,
        spans: Sequence[tuple[int, int, int]],
        experts: Mapping[int, Tensor],
        glu: Callable[[Tensor, Tensor], Tensor],
    ) -> Tensor | None:
        """``down(glu(gate(x), up(x)))`` for each run ``(expert, start, stop)`` of ``rows`` (sorted by
        expert), by the expert in ``experts[expert]``'s slot; None where an expert's tensor is not a
        slot of the pool (the caller then runs its loop)."""
        slots = []
        for expert, _, _ in spans:
            slot = self.slot_of(experts[expert])
            if slot is None:
                return None
            slots.append(slot)
        order = sorted(range(len(spans)), key=slots.__getitem__)  # the grouped product's runs: by slot
        first, last = slots[order[0]], slots[order[-1]]
        counts = [0] * (last - first + 1)
        for slot, (_, start, stop) in zip(slots, spans, strict=True):
            counts[slot - first] = stop - start
        offs = int_tensor(list(accumulate(counts)), rows.device, torch.int32)
        # The rows by slot where the slots are not in expert order: row i of the products is then
        # row where[i] of the group's.
        where = None
        if order != list(range(len(order))):
            where = int_tensor([r for i in order for r in range(spans[i][1], spans[i][2])], rows.device)
            rows = rows.index_select(0, where)
        inter, window = self.intermediate, slice(first, last + 1)
        gate_up = self.product(rows, self.gate_up[window], offs=offs)
        out = self.product(glu(gate_up[:, :inter], gate_up[:, inter:]), self.down[window], offs=offs)
        if where is None:
            return out
        return torch.empty_like(out).index_copy_(0, where, out)
