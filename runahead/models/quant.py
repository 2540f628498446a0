"""Dequantize a stored cache slot (GGUF Q4_0 / Q8_0 / F16 / BF16 / F32 experts) on its device.

The torch side of the stored slot format of :mod:`runahead.models.layout`: the cache keeps each
expert as its file stores it, and the MoE turns a slot into the compute dtype only while a group
uses it (:meth:`runahead.models.base.MoEModel.expert_weights`); no full-width copy outlives the
group. The arithmetic is ggml's and the ``gguf`` package's reference dequantizer's: a float32
product of the fp16 scale and the integer weight, so the weights equal what transformers reads
from the same file.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runahead.models.layout import SlotFormat

FLOAT_KINDS: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize(data: Tensor, kind: str, shape: tuple[int, ...]) -> Tensor:
    """The float32 matrix ``shape`` stored as ``kind`` in the bytes ``data`` (``uint8``, any device)."""
    if kind in FLOAT_KINDS:
        return data.view(FLOAT_KINDS[kind]).float().view(shape)
    if kind == "Q8_0":
        blocks = data.view(-1, 34)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (scale * q).view(shape)
    if kind == "Q4_0":
        blocks = data.view(-1, 18)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        nibbles = blocks[:, 2:]
        q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=1).to(torch.int8) - 8
        return (scale * q.float()).view(shape)
    raise ValueError(f"cannot dequantize type {kind}")


def dequantize_slot(slot: Tensor, fmt: SlotFormat, dtype: torch.dtype) -> Tensor:
    """A stored slot as the compute-dtype slot format: flat ``gate | up | down`` in ``dtype``."""
    parts = [dequantize(slot[p.start : p.stop], p.kind, p.shape).view(-1) for p in fmt.parts]
    return torch.cat(parts).to(dtype)
