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
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("gate", "up", "down", "gate_up", "gate_up_t", "down_t", "gate_up_bias", "down_bias")

ROLE_SETS = (
    ("down", "gate", "up"),
    ("down", "gate_up"),
    ("down_bias", "down_t", "gate_up_bias", "gate_up_t"),
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
    }[role]


@dataclass(frozen=True, slots=True)
class TensorRange:
    """A contiguous run of bytes in a safetensors file holding one matrix (or the fused gate_up)."""

    path: str
    offset: int  # absolute byte offset in the file (header included)
    nbytes: int
    dtype: str  # safetensors dtype name: "F32", "F16", "BF16"
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

    @property
    def slot_numel(self) -> int:
        """Elements in one slot: gate + up + down (+ the biases)."""
        extra = 2 * self.intermediate_size + self.hidden_size if self.biases else 0
        return 3 * self.hidden_size * self.intermediate_size + extra

    def offsets(self) -> dict[str, tuple[int, int]]:
        """Element offsets ``(start, stop)`` of each role inside a slot."""
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
