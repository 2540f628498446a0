"""GGUF's Q4_0 / Q8_0 blocks as MLX affine quantization, exactly (issue 10, the MLX side).

A Q4_0 block is 32 weights in 18 bytes: an fp16 scale ``d``, then 16 bytes whose low nibbles are
weights 0-15 and high nibbles weights 16-31, each worth ``d * (q - 8)``. MLX's affine 4-bit with
group 32 stores ``w = scale * q + bias`` with ``q`` packed eight to a ``uint32``, weight ``i`` of a
word in bits ``4i..4i+3``. So ``scale = d``, ``bias = -8 d`` and the nibbles are reordered: the same
``q``, the same ``d``, and in float32 ``d * q - 8 d`` equals ``d * (q - 8)`` exactly (both products
of an 11-bit ``d`` by a small integer are exact). Q8_0 (an fp16 ``d`` then 32 ``int8``, ``d * q``) is
8-bit group 32 with ``q + 128`` stored unsigned, ``scale = d``, ``bias = -128 d``.

The repacking runs on the store's worker threads (numpy), so the slot pools and ``mx.gather_qmm``
see mlx-lm's own layout; nothing full-width is ever made.
"""

from __future__ import annotations

import numpy as np

GGUF_QUANT = {"Q4_0": (4, 18), "Q8_0": (8, 34)}
"""GGUF block type -> (MLX bits at group 32, bytes per 32-weight block)."""


def repack(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(weight uint32 [out, in * bits / 32], scales float32 [out, in / 32], biases)`` of a ``shape``
    matrix stored as ``kind`` in the bytes ``raw`` (``uint8``)."""
    out, inner = shape
    bits, block = GGUF_QUANT[kind]
    blocks = raw.reshape(out * inner // 32, block)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(out, inner // 32)
    if kind == "Q4_0":
        nibbles = blocks[:, 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # weights 0-15, then 16-31
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        bias = -8.0 * d
    else:
        packed = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = -128.0 * d
    weight = np.ascontiguousarray(packed).view(np.uint32).reshape(out, inner * bits // 32)
    return weight, d, bias.astype(np.float32)
