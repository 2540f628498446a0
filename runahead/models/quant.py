"""Dequantize a stored cache slot (GGUF Q4_0 / Q8_0 / MXFP4 / F16 / BF16 / F32 experts) on its device.

The torch side of the stored slot format of :mod:`runahead.models.layout`: the cache keeps each
expert as its file stores it, and the MoE turns a slot into the compute dtype only while a group
uses it (:meth:`runahead.models.base.MoEModel.expert_weights`); no full-width copy outlives the
group. The arithmetic is ggml's and the ``gguf`` package's reference dequantizer's: a float32
product of the fp16 scale and the integer weight, so the weights equal what transformers reads
from the same file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from runahead.models.layout import STORED_TYPES, SlotFormat

FLOAT_KINDS: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)
"""E2M1 values, doubled (ggml's ``kvalues_mxfp4``; the scale is halved to match)."""


def dequantize(data: Tensor, kind: str, shape: tuple[int, ...], out: Tensor | None = None) -> Tensor:
    """The float32 matrix ``shape`` stored as ``kind`` in the bytes ``data`` (``uint8``, any device).

    Writes into ``out`` (a contiguous float32 tensor of ``shape``'s size) when given: a block's 32
    weights are consecutive in the matrix, so each block dequantizes in place, with no copy.
    """
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=data.device)
    if kind in FLOAT_KINDS:
        return out.view(shape).copy_(data.view(FLOAT_KINDS[kind]).view(shape))
    if kind == "Q8_0":
        blocks = data.view(-1, 34)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        weights = out.view(-1, 32)
        weights.copy_(blocks[:, 2:].contiguous().view(torch.int8))
        return weights.mul_(scale).view(shape)
    if kind == "Q4_0":
        blocks = data.view(-1, 18)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        # q - 8 is the nibble of q ^ 8 read as a signed 4-bit number: sign-extended by int8 shifts
        # on the small byte array, so the float32 weights are written once and scaled once
        signed = blocks[:, 2:].contiguous() ^ 0x88
        halves = out.view(-1, 2, 16)  # weights 0-15: low nibbles; 16-31: high nibbles
        halves[:, 0].copy_((signed << 4).view(torch.int8) >> 4)
        halves[:, 1].copy_(signed.view(torch.int8) >> 4)
        return out.view(-1, 32).mul_(scale).view(shape)
    if kind == "MXFP4":
        blocks = data.view(-1, 17)
        e = blocks[:, 0].to(torch.int32)
        # ggml's e8m0_to_fp32_half: 2**(e - 128) (subnormal below e = 2), as float32 bits
        bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
        scale = bits.view(torch.float32)
        nibbles = blocks[:, 1:]
        halves = out.view(-1, 2, 16)
        table = MXFP4_VALUES.to(data.device)
        halves[:, 0].copy_(table[(nibbles & 0x0F).long()])
        halves[:, 1].copy_(table[(nibbles >> 4).long()])
        return halves.mul_(scale.view(-1, 1, 1)).view(shape)
    raise ValueError(f"cannot dequantize type {kind}")


def dequantize_slot(slot: Tensor, fmt: SlotFormat, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """A stored slot as the compute-dtype slot format: flat ``gate | up | down`` in ``dtype`` (then
    gpt-oss's ``gate_bias | up_bias | down_bias``).

    ``out``: a float32 buffer (on the slot's device) of at least the expert's weights to dequantize
    into; a fresh one when None.
    """
    sizes = [math.prod(p.shape) for p in fmt.parts]
    if out is None:
        out = torch.empty(sum(sizes), dtype=torch.float32, device=slot.device)
    flat = out[: sum(sizes)]
    at = 0
    for part, size in zip(fmt.parts, sizes, strict=True):
        dequantize(slot[part.start : part.stop], part.kind, part.shape, flat[at : at + size])
        at += size
    return flat if dtype == torch.float32 else flat.to(dtype)


BLOCK_KINDS: dict[int, str] = {STORED_TYPES[kind][1]: kind for kind in ("Q4_0", "Q8_0")}
"""Bytes per block -> block type, for a resident matrix kept as stored: ``uint8 [rows, blocks, bytes]``."""


def stays_as_stored(key: str, kind: str | None, shape: Sequence[int]) -> bool:
    """Whether resident tensor ``key``, stored as ``kind`` in ``shape``, may stay as its file stores it
    on the CPU kernel path (``dense_as_stored``; the caller knows the kernel runs): a
    :data:`~runahead.models.base.DENSE_ROLES` matrix of a type the kernel multiplies with rows of
    whole 32-weight blocks, or the embedding in Q4_0 / Q8_0 blocks (looked up, its rows widened as
    they are; a half-width table would set the compute dtype)."""
    from runahead.models.base import DENSE_ROLES
    from runahead.models.qkernel import BLOCK, KINDS

    if kind not in KINDS or len(shape) != 2 or shape[1] % BLOCK:
        return False
    role = key.rpartition(".")[2]
    return role in DENSE_ROLES or (role == "embed" and kind in BLOCK_KINDS.values())


def stored_kind(matrix: Tensor) -> str:
    """The kernel type (:data:`runahead.models.qkernel.KINDS`) of a resident matrix kept as stored: a
    half-width tensor's (``BF16``, ``F16``), or a block-stored one's (``Q4_0``, ``Q8_0``, by its block
    size)."""
    from runahead.models.qkernel import HALF_KINDS

    if matrix.dtype == torch.uint8 and matrix.dim() == 3 and matrix.shape[2] in BLOCK_KINDS:
        return BLOCK_KINDS[matrix.shape[2]]
    if matrix.dtype in HALF_KINDS:
        return HALF_KINDS[matrix.dtype]
    raise ValueError(f"not a resident matrix kept as stored: {matrix.dtype} {tuple(matrix.shape)}")


def widened(matrix: Tensor, dtype: torch.dtype) -> Tensor:
    """A resident matrix kept as stored (:func:`stored_kind`), as a ``[rows, columns]`` copy in ``dtype``."""
    if matrix.dtype != torch.uint8:
        return matrix.to(dtype)
    rows, blocks, _ = matrix.shape
    return dequantize(matrix.reshape(-1), stored_kind(matrix), (rows, blocks * 32)).to(dtype)
