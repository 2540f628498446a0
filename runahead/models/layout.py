"""Where each routed expert's weights lie in a model's files, and how a cache slot holds them.

The loader fills an :class:`ExpertLayout` from the safetensors headers; the expert store reads the
byte ranges into cache slots; the model's expert compute reads the slots. No torch here: this is
plain data shared by the three.

Slot format: one flat buffer per slot, in the compute dtype, holding the expert's three matrices
back to back: ``gate [I, H]``, then ``up [I, H]``, then ``down [H, I]`` (row-major, the
``nn.Linear`` weight convention: ``y = x @ W.T``). A fused ``gate_up [2I, H]`` range fills the gate
and up parts (gate rows first).

gpt-oss stores its experts the other way round and with biases; its slots hold them as stored:
``gate_up_t [H, 2I]`` (``y = x @ W``, gate and up columns interleaved), ``down_t [I, H]``, then
``gate_up_bias [2I]`` and ``down_bias [H]``. The model reading a slot knows which form it holds.

Stored slots (GGUF, and half-width safetensors on a float32 CPU: :func:`kept_as_stored`): a layout
whose ``stored`` is set keeps each expert *as its file stores it* (Q4_0, Q8_0, MXFP4, F16, BF16,
F32): the slot is a byte buffer, and a :class:`SlotFormat` per layer says
where each of ``gate``, ``up``, ``down`` lies in it and in which type. The compute dequantizes a
stored slot when it uses it (:mod:`runahead.models.quant` on torch); the format is plain data, so
another backend (MLX: Q4_0 is affine 4-bit, group 32, scale ``d``, bias ``-8d``) reads the same
description.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

ROLES = (
    "gate", "up", "down", "gate_up", "gate_up_t", "down_t",
    "gate_up_bias", "down_bias", "gate_bias", "up_bias",
)  # fmt: skip

ROLE_SETS = (
    ("down", "gate", "up"),
    ("down", "gate_up"),
    ("down_bias", "down_t", "gate_up_bias", "gate_up_t"),
    ("down", "down_bias", "gate", "gate_bias", "up", "up_bias"),  # gpt-oss from GGUF
)
"""The sets of roles (sorted) one expert's ranges may have."""


def role_shape(role: str, hidden: int, inter: int) -> tuple[int, ...]:
    """The shape a range of ``role`` has for experts of width ``inter`` in a model of width ``hidden``."""
    return {
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
        "gate_up": (2 * inter, hidden),
        "gate_up_t": (hidden, 2 * inter),
        "down_t": (inter, hidden),
        "gate_up_bias": (2 * inter,),
        "down_bias": (hidden,),
        "gate_bias": (inter,),
        "up_bias": (inter,),
    }[role]


def unfused(role: str, offset: int, nbytes: int) -> list[tuple[str, int, int]]:
    """``(role, offset, nbytes)`` of one expert's byte range: a fused ``gate_up`` as its gate half,
    then its up half (gate rows come first, and quantized blocks run along rows); others as they are."""
    if role == "gate_up":
        return [("gate", offset, nbytes // 2), ("up", offset + nbytes // 2, nbytes // 2)]
    return [(role, offset, nbytes)]


STORED_TYPES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "MXFP4": (32, 17),
}
"""Types a stored slot may hold: name -> (weights per block, bytes per block), as ggml defines them.

Q8_0: an fp16 scale ``d`` then 32 int8 ``q``, weight ``d * q``. Q4_0: ``d`` then 16 bytes of nibbles,
weight ``j`` the low nibble of byte ``j`` and weight ``j + 16`` its high nibble, ``d * (q - 8)``.
MXFP4 (gpt-oss): an E8M0 exponent byte ``e`` then 16 bytes of FP4 (E2M1) nibbles in Q4_0's order,
weight ``2**(e - 128) * v`` for ``v`` the nibble's doubled E2M1 value (``0, 1, 2, 3, 4, 6, 8, 12``, sign
in the top bit). Blocks run along a matrix row (the ``H`` of ``gate [I, H]``, the ``I`` of ``down [H, I]``).
"""

SLOT_ORDER = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
"""The order of a stored slot's parts (the biases only for gpt-oss)."""


def stored_nbytes(kind: str, shape: tuple[int, ...]) -> int:
    """Bytes of a ``shape`` matrix stored as ``kind`` (:data:`STORED_TYPES`); ValueError if it cannot be.

    The row length (last dim) must be a whole number of blocks.
    """
    if kind not in STORED_TYPES:
        raise ValueError(f"type {kind} cannot be kept in a stored slot; supported: {', '.join(STORED_TYPES)}")
    per_block, block_bytes = STORED_TYPES[kind]
    if not shape or shape[-1] % per_block:
        raise ValueError(f"{kind} rows of {list(shape)[-1:]} weights are not whole {per_block}-weight blocks")
    return math.prod(shape) // per_block * block_bytes


@dataclass(frozen=True, slots=True)
class SlotPart:
    """One matrix of a stored slot: its ``role``, stored ``kind``, ``shape`` and byte range in the slot."""

    role: str
    kind: str
    shape: tuple[int, ...]
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class SlotFormat:
    """How a stored slot holds one expert: ``gate``, ``up``, ``down`` back to back, each as stored
    (gpt-oss: then its ``gate_bias``, ``up_bias``, ``down_bias``).

    Every expert of one layer has the same format; layers may differ. ``nbytes`` is the payload.
    """

    parts: tuple[SlotPart, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the expert takes in a slot (and on the link)."""
        return self.parts[-1].stop if self.parts else 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The stored types of the parts, in order."""
        return tuple(p.kind for p in self.parts)

    @classmethod
    def of(cls, ranges: tuple[TensorRange, ...], hidden: int, inter: int) -> SlotFormat:
        """The format of an expert with these ranges (roles of :data:`SLOT_ORDER`)."""
        by_role = {r.role: r for r in ranges}
        parts, at = [], 0
        for role in (r for r in SLOT_ORDER if r in by_role):
            kind = by_role[role].dtype
            shape = role_shape(role, hidden, inter)
            size = stored_nbytes(kind, shape)
            parts.append(SlotPart(role, kind, shape, at, at + size))
            at += size
        return cls(tuple(parts))


@dataclass(frozen=True, slots=True)
class TensorRange:
    """A contiguous run of bytes in a safetensors file holding one matrix (or the fused gate_up)."""

    path: str
    offset: int  # absolute byte offset in the file (header included)
    nbytes: int
    dtype: str  # "F32", "F16", "BF16" (safetensors or GGUF), or a GGUF block type: "Q8_0", "Q4_0"
    shape: tuple[int, ...]
    role: str  # one of ROLES

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown expert tensor role {self.role!r}; expected one of {ROLES}")


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Every routed expert's byte ranges, and the shape of one expert."""

    num_layers: int
    num_experts: int
    hidden_size: int
    intermediate_size: int  # the expert's width I
    ranges: dict[tuple[int, int], tuple[TensorRange, ...]]  # (layer, expert) -> its ranges
    biases: bool = False  # slots end with the gate_up and down biases (gpt-oss)
    stored: bool = False  # slots hold the experts' bytes as stored (uint8 slots, see SlotFormat)
    _slot_numel: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        # Counted once: the stores check every read's slot against it, and a stored layout's count
        # walks every layer's slot format (~0.3 ms for 16 layers, on the event loop at every read).
        object.__setattr__(self, "_slot_numel", self._count_slot_numel())

    def slot_format(self, layer: int) -> SlotFormat:
        """The stored slot format of ``layer``'s experts (a ``stored`` layout only)."""
        if not self.stored:
            raise ValueError("slot_format: this layout's slots hold experts in the compute dtype")
        return SlotFormat.of(self.ranges[layer, 0], self.hidden_size, self.intermediate_size)

    @property
    def slot_numel(self) -> int:
        """Elements in one slot: gate + up + down (+ the biases); bytes of the largest layer's when stored."""
        return self._slot_numel

    def _count_slot_numel(self) -> int:
        if self.stored:
            return max(self.slot_format(layer).nbytes for layer in range(self.num_layers))
        extra = 2 * self.intermediate_size + self.hidden_size if self.biases else 0
        return 3 * self.hidden_size * self.intermediate_size + extra

    def part_offsets(self, layer: int) -> dict[str, tuple[int, int]]:
        """Where each role of ``layer``'s experts lies in a slot: element offsets (byte offsets if stored)."""
        if self.stored:
            return {p.role: (p.start, p.stop) for p in self.slot_format(layer).parts}
        return self.offsets()

    def offsets(self) -> dict[str, tuple[int, int]]:
        """Element offsets ``(start, stop)`` of each role inside a (compute-dtype) slot."""
        block, inter = self.hidden_size * self.intermediate_size, self.intermediate_size
        return {
            "gate": (0, block),
            "up": (block, 2 * block),
            "down": (2 * block, 3 * block),
            "gate_up": (0, 2 * block),
            "gate_up_t": (0, 2 * block),
            "down_t": (2 * block, 3 * block),
            "gate_up_bias": (3 * block, 3 * block + 2 * inter),
            "down_bias": (3 * block + 2 * inter, 3 * block + 2 * inter + self.hidden_size),
        }


EXPERT_SLOTS = ("auto", "stored", "compute")
"""How the torch backend's cache may hold a safetensors checkpoint's experts (``TorchBackend.open``'s
``expert_slots``): as stored where that applies, as stored or refuse, or widened to the compute dtype."""

HALF_WIDTH = ("BF16", "F16")
"""File types a safetensors checkpoint's experts may keep in stored slots (:func:`kept_as_stored`)."""


def kept_as_stored(layout: ExpertLayout) -> ExpertLayout | None:
    """``layout`` with every expert kept as its file stores it (a ``stored`` layout), or None where
    that does not apply.

    For a safetensors checkpoint whose experts are all bfloat16 or all float16 (:data:`HALF_WIDTH`)
    ``gate``, ``up``, ``down`` (or a fused ``gate_up``, split into its halves as :func:`unfused` does),
    without biases: its slots then hold the file's bytes, half the size of float32 slots, and a
    float32 CPU compute multiplies them as stored (:mod:`runahead.models.qkernel`) instead of widening
    every expert on its way into the cache. Already-stored layouts (GGUF) are returned as they are.
    """
    if layout.stored:
        return layout
    if layout.biases:
        return None
    kinds = {r.dtype for ranges in layout.ranges.values() for r in ranges}
    if len(kinds) != 1 or not kinds <= set(HALF_WIDTH):
        return None
    hidden, inter = layout.hidden_size, layout.intermediate_size
    ranges: dict[tuple[int, int], tuple[TensorRange, ...]] = {}
    for key, expert in layout.ranges.items():
        parts = []
        for r in expert:
            if r.role not in ("gate", "up", "down", "gate_up"):
                return None
            for role, offset, nbytes in unfused(r.role, r.offset, r.nbytes):
                shape = r.shape if role == r.role else role_shape(role, hidden, inter)
                parts.append(TensorRange(r.path, offset, nbytes, r.dtype, shape, role))
        ranges[key] = tuple(parts)
    return replace(layout, ranges=ranges, stored=True)
