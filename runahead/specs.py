"""Model shapes and hardware profiles: the numbers the cost model and the simulator run on.

Both are frozen dataclasses checked on construction. Their data lives in TOML files shipped as
package data (``runahead/data/models/*.toml`` and ``runahead/data/profiles/*.toml``); every file
lists its ``sources`` and says which numbers are estimates. Load one by name (``qwen3.6-35b-a3b``,
``thor``) or by the path of a TOML file of the same layout.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import MISSING, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

_DATA_PACKAGE = "runahead"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of an MoE model, as far as memory traffic and flops are concerned.

    Experts are SwiGLU/GeGLU blocks of three ``hidden_size x expert_width`` matrices. Layer ``l`` is a
    full-attention layer when ``(l + 1) % full_attention_interval == 0``; the other ("local") layers
    are sliding-window attention (``sliding_window`` tokens of KV) or linear attention (a fixed
    recurrent state of ``linear_state_bytes`` per request). ``other_params_per_layer`` adds the
    non-expert parameters per layer that the attention head shape does not account for (for
    example the projections of linear-attention layers), averaged over layers.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    expert_width: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    bits_per_weight: float
    kv_bytes_per_element: float = 2.0
    num_shared_experts: int = 0
    shared_expert_width: int = 0
    dense_mlp_width: int = 0
    other_params_per_layer: int = 0
    full_attention_interval: int = 1
    sliding_window: int = 0
    linear_state_bytes: int = 0
    sources: tuple[str, ...] = ()
    notes: str = ""

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "num_experts",
            "top_k",
            "hidden_size",
            "expert_width",
            "vocab_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "full_attention_interval",
        )
        for name in positive:
            _require(self, getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        non_negative = (
            "num_shared_experts",
            "shared_expert_width",
            "dense_mlp_width",
            "other_params_per_layer",
            "sliding_window",
            "linear_state_bytes",
        )
        for name in non_negative:
            _require(self, getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _require(self, self.top_k <= self.num_experts, f"top_k {self.top_k} > num_experts {self.num_experts}")
        _require(
            self,
            0 < self.bits_per_weight <= 32,
            f"bits_per_weight must be in (0, 32], got {self.bits_per_weight}",
        )
        _require(self, 0 < self.kv_bytes_per_element <= 8, "kv_bytes_per_element must be in (0, 8]")
        _require(
            self,
            (self.num_shared_experts == 0) == (self.shared_expert_width == 0),
            "num_shared_experts and shared_expert_width must both be zero or both be positive",
        )
        _require(
            self, self.num_attention_heads % self.num_kv_heads == 0, "num_attention_heads % num_kv_heads != 0"
        )
        if self.full_attention_interval > 1:
            _require(
                self,
                (self.sliding_window > 0) != (self.linear_state_bytes > 0),
                "with full_attention_interval > 1 the local layers need exactly one of sliding_window "
                "(sliding-window attention) or linear_state_bytes (linear attention)",
            )

    # --- parameters -------------------------------------------------------------------------

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_width

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert at ``bits_per_weight``: the unit the link moves."""
        return _bytes(self.expert_params, self.bits_per_weight)

    @property
    def ffn_shared_params_per_layer(self) -> int:
        """Parameters every token of a layer uses besides routed experts: shared experts + dense MLP."""
        shared = self.num_shared_experts * 3 * self.hidden_size * self.shared_expert_width
        return shared + 3 * self.hidden_size * self.dense_mlp_width

    @property
    def attention_params_per_layer(self) -> int:
        """Non-FFN parameters of one layer: attention projections, router, and ``other_params_per_layer``."""
        qkv = self.hidden_size * self.head_dim * (self.num_attention_heads + 2 * self.num_kv_heads)
        out = self.num_attention_heads * self.head_dim * self.hidden_size
        router = self.hidden_size * self.num_experts
        return qkv + out + router + self.other_params_per_layer

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection (read once per group at the last layer)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters, counting the embedding and the LM head separately (untied)."""
        per_layer = (
            self.num_experts * self.expert_params
            + self.ffn_shared_params_per_layer
            + self.attention_params_per_layer
        )
        return self.num_layers * per_layer + 2 * self.lm_head_params

    @property
    def active_params(self) -> int:
        """Parameters one decode token goes through (top-k experts, shared weights, LM head)."""
        per_layer = (
            self.top_k * self.expert_params
            + self.ffn_shared_params_per_layer
            + self.attention_params_per_layer
        )
        return self.num_layers * per_layer + self.lm_head_params

    # --- attention state --------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token adds to one attention layer (K and V)."""
        return math.ceil(2 * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element)

    def is_full_attention(self, layer: int) -> bool:
        """Whether ``layer`` attends over the whole context (else it is a local layer)."""
        return (layer + 1) % self.full_attention_interval == 0

    def attention_state_bytes(self, layer: int, context_length: int) -> int:
        """Per-request attention-state bytes a token of ``layer`` reads (linear attention: and writes)."""
        if self.is_full_attention(layer):
            return context_length * self.kv_bytes_per_token
        if self.sliding_window > 0:
            return min(context_length, self.sliding_window) * self.kv_bytes_per_token
        return 2 * self.linear_state_bytes  # the recurrent state is read and written back


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A machine for the ``sim`` backend and the cost model: memory, compute and the expert link.

    ``memory_bandwidth`` is the cited peak; ``bandwidth_efficiency`` the fraction a decode kernel
    achieves. ``group_overhead_s`` is the fixed cost of one backend call (one group at one layer);
    ``job_overhead_s`` the fixed cost each job adds to its group (per-request kernels and
    bookkeeping that batching does not amortize).
    The link moves experts from their store into the cache: ``link_bandwidth`` is the effective
    rate for expert-sized reads, ``link_latency_s`` the per-read latency, and up to
    ``link_queue_depth`` reads are in flight by default.
    """

    name: str
    memory_bandwidth: float
    bandwidth_efficiency: float
    peak_flops: float
    group_overhead_s: float
    link_bandwidth: float
    link_latency_s: float
    link_queue_depth: int = 4
    job_overhead_s: float = 0.0
    description: str = ""
    sources: tuple[str, ...] = ()
    estimates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(
            self, self.memory_bandwidth > 0, f"memory_bandwidth must be > 0, got {self.memory_bandwidth}"
        )
        _require(self, 0 < self.bandwidth_efficiency <= 1, "bandwidth_efficiency must be in (0, 1]")
        _require(self, self.peak_flops > 0, f"peak_flops must be > 0, got {self.peak_flops}")
        _require(
            self, self.group_overhead_s >= 0, f"group_overhead_s must be >= 0, got {self.group_overhead_s}"
        )
        _require(self, self.job_overhead_s >= 0, f"job_overhead_s must be >= 0, got {self.job_overhead_s}")
        _require(self, self.link_bandwidth > 0, f"link_bandwidth must be > 0, got {self.link_bandwidth}")
        _require(self, self.link_latency_s >= 0, f"link_latency_s must be >= 0, got {self.link_latency_s}")
        _require(
            self, self.link_queue_depth >= 2, f"link_queue_depth must be >= 2, got {self.link_queue_depth}"
        )

    @property
    def effective_memory_bandwidth(self) -> float:
        """Bytes per second a decode kernel actually streams: ``memory_bandwidth * bandwidth_efficiency``."""
        return self.memory_bandwidth * self.bandwidth_efficiency


def _require(obj: object, condition: bool, message: str) -> None:
    if not condition:
        name = getattr(obj, "name", "?")
        raise ValueError(f"{type(obj).__name__} {name!r}: {message}")


def _bytes(params: int, bits_per_weight: float) -> int:
    return math.ceil(params * bits_per_weight / 8)


# --- loading ----------------------------------------------------------------------------------

_T = TypeVar("_T", ModelSpec, HardwareProfile)


def model_names() -> list[str]:
    """Names of the model specs shipped with the package (``runahead/data/models``), sorted."""
    return _names("models")


def profile_names() -> list[str]:
    """Names of the hardware profiles shipped with the package (``runahead/data/profiles``), sorted."""
    return _names("profiles")


def load_model_spec(name_or_path: str | Path) -> ModelSpec:
    """Load a model spec by package name (see :func:`model_names`), from a TOML file path, or from a
    Hugging Face folder's ``config.json`` or a GGUF file's metadata
    (:func:`runahead.models.simspec.spec_from_folder`)."""
    folder = Path(name_or_path)
    if (folder.is_dir() and (folder / "config.json").is_file()) or (
        folder.suffix == ".gguf" and folder.is_file()
    ):
        from runahead.models.simspec import spec_from_folder

        return spec_from_folder(folder)
    return _load(ModelSpec, "models", name_or_path)


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a hardware profile by package name (see :func:`profile_names`) or from a TOML file path."""
    return _load(HardwareProfile, "profiles", name_or_path)


def _names(kind: str) -> list[str]:
    folder = resources.files(_DATA_PACKAGE).joinpath("data", kind)
    return sorted(
        entry.name.removesuffix(".toml") for entry in folder.iterdir() if entry.name.endswith(".toml")
    )


def _load(cls: type[_T], kind: str, name_or_path: str | Path) -> _T:
    text, origin = _read(kind, name_or_path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{origin}: not valid TOML: {exc}") from None
    return _build(cls, raw, origin)


def _read(kind: str, name_or_path: str | Path) -> tuple[str, str]:
    text_name = str(name_or_path)
    if isinstance(name_or_path, Path) or text_name.endswith(".toml") or "/" in text_name:
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"{kind[:-1]} file {path} does not exist")
        return path.read_text(encoding="utf-8"), str(path)
    entry = resources.files(_DATA_PACKAGE).joinpath("data", kind, f"{text_name}.toml")
    if not entry.is_file():
        names = _names(kind)
        raise ValueError(f"unknown {kind[:-1]} {text_name!r}; choose one of {names} or give a .toml path")
    return entry.read_text(encoding="utf-8"), f"{kind}/{text_name}.toml"


def _build(cls: type[_T], raw: dict[str, Any], origin: str) -> _T:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{origin}: unknown keys {unknown}; known keys are {sorted(known)}")
    values: dict[str, Any] = {"name": Path(origin).stem}
    for key, value in raw.items():
        values[key] = _convert(origin, key, str(known[key].type), value)
    missing = [k for k, f in known.items() if k not in values and f.default is MISSING]
    if missing:
        raise ValueError(f"{origin}: missing required keys {missing}")
    return cls(**values)


def _convert(origin: str, key: str, annotation: str, value: Any) -> Any:
    if annotation == "tuple[str, ...]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{origin}: {key} must be a list of strings")
        return tuple(value)
    if annotation == "str":
        if not isinstance(value, str):
            raise ValueError(f"{origin}: {key} must be a string, got {value!r}")
        return value
    if annotation == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{origin}: {key} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{origin}: {key} must be a number, got {value!r}")
    return float(value)
