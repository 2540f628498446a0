"""Load a GGUF model (llama.cpp's format): resident weights dequantized once, experts kept as stored.

Reads the file(s) with the ``gguf`` package's ``GGUFReader``: the metadata (``general.architecture``
and the ``<arch>.*`` keys) becomes the architecture's config, and every tensor comes with its
absolute ``data_offset``. Names and metadata are those of llama.cpp's ``convert_hf_to_gguf.py``:
``token_embd``, ``output_norm``, ``output`` (absent when tied), and per layer ``blk.N.attn_norm``,
``attn_q/k/v/output`` (``.bias``), ``attn_q_norm`` / ``attn_k_norm``, ``ffn_norm`` (the
post-attention norm), the router ``ffn_gate_inp``, a shared expert ``ffn_{gate,up,down}_shexp``
with its gate ``ffn_gate_inp_shexp``, and the routed experts stacked as
``ffn_{gate,up,down}_exps [E, I, H] / [E, H, I]`` (numpy order), each expert a contiguous slice,
or with gate and up fused as ``ffn_gate_up_exps [E, 2I, H]`` (gate rows first: each expert's
slice is its gate's bytes, then its up's, since quantized blocks run along rows).

Routed experts are not read here: the returned :class:`ExpertLayout` is ``stored`` and gives each
expert's bytes per stacked tensor at their absolute offsets, in the file's type (Q4_0, Q8_0, F16,
BF16, F32), for the expert store to read into byte slots. Experts of any other type (Q4_K, ...)
are refused by name. Resident tensors are dequantized once with ``gguf.quants`` (any type it
knows, else refused by name) and cast to the compute dtype.

Architectures: ``qwen3moe``, ``qwen2moe``, ``olmoe`` and llama-style Mixtral (``llama`` with
``expert_count``; its q/k rows are un-permuted back from llama.cpp's interleaved RoPE order), and
in their own modules ``qwen35moe`` (:mod:`~runahead.models.gguf_qwen35`), ``gpt-oss``
(:mod:`~runahead.models.gguf_gpt_oss`) and ``gemma4`` (:mod:`~runahead.models.gguf_gemma4`).
Split files (``name-00001-of-00003.gguf``) load from any one of their parts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runahead.models import get_architecture, gguf_gemma4, gguf_gpt_oss, gguf_qwen35
from runahead.models.base import ModelLoadError, MoEConfig, MoEModel
from runahead.models.gguf_convert import gguf_name, q_k_permutation
from runahead.models.layout import STORED_TYPES, ExpertLayout, TensorRange, role_shape, unfused

MODEL_TYPES = {
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
    "olmoe": "olmoe",
    "llama": "mixtral",
    "qwen35moe": "qwen3_5_moe",
    "gpt-oss": "gpt_oss",
    "gemma4": "gemma4",
}
"""GGUF ``general.architecture`` -> the runtime's ``model_type``."""

NORM_TOPK = {
    "qwen3moe": True,
    "qwen2moe": False,
    "olmoe": False,
    "llama": True,
    "qwen35moe": True,
    "gpt-oss": True,
    "gemma4": True,
}
"""Whether llama.cpp renormalises the top-k routing weights of each architecture (it fixes this per
architecture; the GGUF carries no such key for these)."""

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (what :func:`runahead.models.loader.load_model` dispatches on)."""
    return str(path).endswith(".gguf") and Path(path).is_file()


def gguf_files(path: str | Path) -> list[Path]:
    """The file itself, or every part of a split GGUF (``-0000K-of-0000N.gguf``) in order."""
    file = Path(path)
    match = SPLIT.match(file.name)
    if match is None:
        return [file]
    count = int(match["count"])
    files = [file.with_name(f"{match['stem']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    for part in files:
        if not part.is_file():
            raise ModelLoadError(f"{file}: missing part {part.name} of a {count}-part GGUF")
    return files


class GGUFModel:
    """The metadata and tensors of a (possibly split) GGUF, by name, with the file each lies in."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, tuple[Path, Any]] = {}
        for file in gguf_files(path):
            try:
                reader = _open(file)
            except ModelLoadError:
                raise
            except Exception as err:  # the reader raises ValueError/IndexError/struct errors
                raise ModelLoadError(
                    f"{file}: not a readable GGUF file ({type(err).__name__}: {err})"
                ) from None
            if not self.fields:
                self.fields = {name: field.contents() for name, field in reader.fields.items()}
            self.tensors.update({t.name: (file, t) for t in reader.tensors})

    def meta(self, key: str, default: Any = ModelLoadError) -> Any:
        """Metadata value ``key``; a :class:`ModelLoadError` naming it when absent and no default."""
        if key in self.fields:
            return self.fields[key]
        if default is ModelLoadError:
            raise ModelLoadError(f"{self.path}: metadata lacks {key!r}")
        return default

    def kind(self, name: str) -> str:
        """The ggml type name of tensor ``name`` (``Q4_0``, ``F32``, ...)."""
        return str(self.tensors[name][1].tensor_type.name)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape in numpy (row-major) order: ggml's dims reversed."""
        return tuple(int(d) for d in reversed(self.tensors[name][1].shape))

    def dequantized(self, name: str) -> np.ndarray[Any, Any]:
        """Tensor ``name`` as float32, with its numpy shape; refuses a type ``gguf`` cannot dequantize."""
        from gguf import quants

        if name not in self.tensors:
            raise ModelLoadError(f"{self.path}: missing tensor {name}")
        file, tensor = self.tensors[name]
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{file}: tensor {name} has type {self.kind(name)}, which is not supported"
            ) from None
        return np.asarray(values, dtype=np.float32).reshape(self.shape(name))


def _open(file: Path) -> Any:
    """A ``GGUFReader`` of ``file`` that first checks every tensor's extent (see :func:`_check_extents`)."""
    from gguf import GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            _check_extents(file, len(self.data), start_offs, fields)
            super()._build_tensors(start_offs, fields)

    return CheckedReader(file)


def _check_extents(file: Path, size: int, start: int, fields: list[Any]) -> None:
    """Refuse, by name, a tensor of unknown type, whose rows are not whole blocks of its type, or whose
    bytes (from its type and shape) overrun the next tensor or the file's end (a truncated file).

    ``fields`` are the reader's tensor-info fields: parts ``(name length, name, n_dims, dims, type,
    offset)``; runs before the reader maps the data, which would fail without naming the tensor.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    extents = []
    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            kind = GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise ModelLoadError(f"{file}: tensor {name} has unknown ggml type {int(raw_type[0])}") from None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        shape = [int(d) for d in reversed(dims.tolist())]
        if not shape or shape[-1] % block:
            raise ModelLoadError(
                f"{file}: tensor {name} ({kind.name} {shape}): rows are not whole {block}-weight blocks"
            )
        begin = start + int(offset[0])
        end = begin + math.prod(shape) // block * block_bytes
        extents.append((begin, end, name, str(kind.name), shape))
    extents.sort()
    for (begin, end, name, kind_name, shape), after in zip(extents, [*extents[1:], None], strict=True):
        limit = size if after is None else after[0]
        if end > limit:
            what = "the file's end" if after is None else f"tensor {after[2]} at byte {limit}"
            raise ModelLoadError(
                f"{file}: tensor {name} ({kind_name} {shape}) needs bytes {begin}..{end}, past {what} "
                f"(truncated file, or a byte count that does not match its type and shape)"
            )


def read_config(model: GGUFModel) -> tuple[str, dict[str, Any]]:
    """``(GGUF architecture, config.json-style dict)`` from the metadata."""
    arch = str(model.meta("general.architecture"))
    if arch not in MODEL_TYPES:
        raise ModelLoadError(
            f"{model.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(MODEL_TYPES)}"
        )

    def key(name: str, default: Any = ModelLoadError) -> Any:
        return model.meta(f"{arch}.{name}", default)

    experts = int(key("expert_count", 0))
    if experts < 1:
        raise ModelLoadError(f"{model.path}: {arch} without {arch}.expert_count is a dense model, not MoE")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = model.shape("token_embd.weight")[0] if "token_embd.weight" in model.tensors else 0
    blocks = int(key("block_count")) - int(key("nextn_predict_layers", 0))  # MTP layers: not run
    raw: dict[str, Any] = {
        "model_type": MODEL_TYPES[arch],
        "num_hidden_layers": blocks,
        "num_experts": experts,
        "num_experts_per_tok": int(key("expert_used_count")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),  # gemma4: per layer
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "vocab_size": int(key("vocab_size", vocab)),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "bos_token_id": model.meta("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": model.meta("tokenizer.ggml.eos_token_id", None),
        "norm_topk_prob": NORM_TOPK[arch],
    }
    scaling = key("rope.scaling.type", "none")
    if arch == gguf_gpt_oss.ARCH:
        raw.update(gguf_gpt_oss.raw_config(key))  # YaRN included
    elif scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise ModelLoadError(f"{model.path}: RoPE scaling {scaling!r} is not supported (only linear)")
    width = int(key("expert_feed_forward_length", 0)) or int(key("feed_forward_length"))
    raw["moe_intermediate_size"] = raw["intermediate_size"] = width
    if arch == "qwen2moe":
        raw["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
        raw["qkv_bias"] = "blk.0.attn_q.bias" in model.tensors
    if arch in ("qwen3moe", "olmoe"):
        raw["attention_bias"] = "blk.0.attn_q.bias" in model.tensors
    if arch == gguf_qwen35.ARCH:
        raw.update(gguf_qwen35.raw_config(key, blocks))
    if arch == gguf_gemma4.ARCH:
        raw.update(gguf_gemma4.raw_config(key, model))
    else:
        raw["num_key_value_heads"] = int(raw["num_key_value_heads"])
    experts_0 = [model.tensors.get(f"blk.0.{short}.weight") for short in _expert_tensors(model, 0)]
    if all(found is not None for found in experts_0):
        tensors = [found[1] for found in experts_0 if found is not None]
        bits = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
        raw["expert_bits_per_weight"] = bits  # what a fetch moves per weight (Q4_0: 4.5)
    return arch, raw


def gguf_names(arch: type[MoEModel], config: MoEConfig, model_type: str) -> dict[str, tuple[str, str]]:
    """Canonical resident weight name -> ``(HF name, GGUF name)``: the description's checkpoint name,
    named as ``runahead convert`` and llama.cpp's converter name it (``gguf``'s ``TensorNameMap``)."""
    naming = {"model_type": model_type, "num_hidden_layers": config.num_layers}
    return {key: (hf[0], gguf_name(hf[0], naming)) for key, hf in arch.weight_names(config).items()}


EXPERT_TENSORS = (("ffn_gate_exps", "gate"), ("ffn_up_exps", "up"), ("ffn_down_exps", "down"))
"""A layer's stacked expert tensors (``blk.N.<name>.weight``) and the slot role of each."""
FUSED = "ffn_gate_up_exps"
"""Gate and up fused (Gemma 4; llama.cpp's ``--fuse-gate-up-exps``): each expert's gate rows, then up."""


def _expert_tensors(model: GGUFModel, layer: int) -> dict[str, str]:
    """``layer``'s stacked expert tensors (short name -> role): fused gate/up where the file has it."""
    if f"blk.{layer}.{FUSED}.weight" in model.tensors:
        return {FUSED: "gate_up", "ffn_down_exps": "down"}
    return dict(EXPERT_TENSORS)


def expert_layout(model: GGUFModel, config: MoEConfig, biases: bool = False) -> ExpertLayout:
    """Each expert's bytes in each stacked tensor at their absolute offsets, as stored (a stored layout).

    ``biases`` (gpt-oss): the stacked ``ffn_{gate,up,down}_exps.bias`` too, as the slot's last parts.
    """
    h, i, n = config.hidden_size, config.intermediate_size, config.num_experts
    ranges: dict[tuple[int, int], tuple[TensorRange, ...]] = {}
    for layer in range(config.num_layers):
        tensors = [(f"{short}.weight", role) for short, role in _expert_tensors(model, layer).items()]
        if biases:
            tensors += [(f"{short}.bias", f"{role}_bias") for short, role in EXPERT_TENSORS]
        found = []
        for short, role in tensors:
            name = f"blk.{layer}.{short}"
            if name not in model.tensors:
                raise ModelLoadError(f"{model.path}: missing tensor {name}")
            file, tensor = model.tensors[name]
            kind = model.kind(name)
            if kind not in STORED_TYPES:
                raise ModelLoadError(
                    f"{file}: tensor {name} has type {kind}; experts must be one of "
                    f"{', '.join(STORED_TYPES)} (requantize the file, e.g. llama-quantize ... Q4_0)"
                )
            shape = role_shape(role, h, i)
            if model.shape(name) != (n, *shape):
                raise ModelLoadError(
                    f"{file}: tensor {name}: expected shape {[n, *shape]}, found {list(model.shape(name))}"
                )
            found.append((str(file), int(tensor.data_offset), int(tensor.n_bytes) // n, kind, role))
        for e in range(n):
            ranges[layer, e] = tuple(
                TensorRange(path, start, size, kind, role_shape(part, h, i), part)
                for path, offset, per, kind, role in found
                for part, start, size in unfused(role, offset + e * per, per)
            )
    return ExpertLayout(config.num_layers, n, h, i, ranges, stored=True)


def read_gguf(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    dense_as_stored: bool = False,
) -> tuple[type[MoEModel], MoEConfig, dict[str, torch.Tensor], ExpertLayout]:
    """``(architecture, config, resident weights, stored expert layout)`` of a GGUF: the weights as a
    Hugging Face checkpoint holds them (the converter's changes undone), dequantized into ``dtype`` on
    ``device``, before any backend's model class rearranges them. Raises :class:`ModelLoadError`
    naming the file and tensor or key at fault.

    ``dense_as_stored`` (float32 compute on the CPU with the kernel): the matrices
    :meth:`MoEModel.dense` multiplies stay as the file stores them where the kernel takes them and
    the converter did not reorder them (:func:`_stored_matrix`), never widened: a Q4_0 file's
    projections and LM head take 4.5 bits a weight in memory instead of 32."""
    model = GGUFModel(path)
    arch_name, raw = read_config(model)
    arch: type[MoEModel] = get_architecture(raw["model_type"])
    config = arch.parse_config(raw)
    names = gguf_names(arch, config, raw["model_type"])
    weights: dict[str, torch.Tensor] = {}
    for key, shape in arch.weight_shapes(config).items():
        hf, name = names[key]
        if name in model.tensors and int(np.prod(model.shape(name))) != int(np.prod(shape)):
            raise ModelLoadError(
                f"{model.path}: tensor {name}: expected shape {list(shape)}, found {list(model.shape(name))}"
            )
        undo = partial(_unconverted, hf=hf, name=name, shape=shape, raw=raw, arch=arch_name)
        moved = bool(q_k_permutation(name, raw)) or (
            arch_name == gguf_qwen35.ARCH and gguf_qwen35.moves(hf, raw)
        )
        if dense_as_stored and (stored := _stored_matrix(model, key, name, shape, undo, moved)) is not None:
            weights[key] = stored.to(device)
            continue
        values = undo(model.dequantized(name))
        weights[key] = torch.from_numpy(np.array(values, dtype=np.float32)).to(
            device=device, dtype=dtype, copy=True
        )
    return arch, config, weights, expert_layout(model, config, biases=arch_name == gguf_gpt_oss.ARCH)


def _unconverted(
    values: np.ndarray[Any, Any],
    *,
    hf: str,
    name: str,
    shape: tuple[int, ...],
    raw: dict[str, Any],
    arch: str,
) -> np.ndarray[Any, Any]:
    """GGUF tensor ``name``'s ``values`` (or their indices) with the converter's changes undone, as
    HF tensor ``hf`` of ``shape`` holds them."""
    if arch == gguf_qwen35.ARCH:
        values = gguf_qwen35.from_gguf(hf, values, raw, shape)
    values = values.reshape(shape)
    if heads := q_k_permutation(name, raw):  # undo the converter's llama q/k permutation
        values = values.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2)
    return values.reshape(shape)


def _stored_matrix(
    model: GGUFModel,
    key: str,
    name: str,
    shape: tuple[int, ...],
    undo: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]],
    moved: bool,
) -> torch.Tensor | None:
    """Resident matrix ``key`` as the file stores it, or None where it cannot stay so: a
    :data:`~runahead.models.base.DENSE_ROLES` matrix of a type the kernel multiplies (Q4_0 and Q8_0
    as ``uint8 [rows, blocks, block bytes]``, F16 and BF16 as such tensors) with rows of whole blocks,
    or the embedding in blocks (its rows widened as they are looked up: ``MoEModel.embedding_rows``).

    Where the converter may have reordered it (llama's q/k rows, Qwen3.6's value heads), ``undo``
    undoes that on values; applied to the weights' *indices* it says where each weight of the HF
    matrix lies in the file, and the blocks are reordered as whole blocks where every block of 32
    stays together (every such change is by whole rows, or by 128-column head blocks), else None.
    Not ``moved`` (and stored in the HF matrix's shape): the file's order is the HF matrix's, and no
    index array is made (an LM head's would take 8 bytes a weight at start-up).
    """
    from runahead.models.quant import stays_as_stored

    if name not in model.tensors or not stays_as_stored(key, kind := model.kind(name), shape):
        return None
    data = np.ascontiguousarray(model.tensors[name][1].data).view(np.uint8)
    in_order = not moved and model.shape(name) == shape
    if kind in ("F16", "BF16"):
        values = data.view(np.uint16).reshape(shape)
        if not in_order:
            values = values.reshape(-1)[_file_order(undo, model.shape(name))]
        return torch.from_numpy(values.copy()).view(torch.float16 if kind == "F16" else torch.bfloat16)
    blocks = data.reshape(-1, STORED_TYPES[kind][1])
    if in_order:
        return torch.from_numpy(blocks.reshape(shape[0], -1, blocks.shape[1]).copy())
    order = _file_order(undo, model.shape(name))
    firsts = order.reshape(shape[0], -1, 32)[..., 0]
    if (firsts % 32).any() or not np.array_equal(
        order.reshape((*firsts.shape, 32)), firsts[..., None] + np.arange(32)
    ):
        return None  # a change that splits blocks: widened
    return torch.from_numpy(blocks[firsts // 32])


def _file_order(
    undo: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]], stored_shape: tuple[int, ...]
) -> np.ndarray[Any, Any]:
    """Where each weight of the HF matrix lies in the file (flat indices, in the HF matrix's shape)."""
    return undo(np.arange(math.prod(stored_shape), dtype=np.int64).reshape(stored_shape))


def load_gguf(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    dense_as_stored: bool = False,
) -> tuple[MoEModel, ExpertLayout]:
    """Load a GGUF MoE: resident weights dequantized into ``dtype`` on ``device`` (or, with
    ``dense_as_stored``, the dense matrices as stored: :func:`read_gguf`), experts as a stored layout.

    The returned model's ``slot_formats`` say how each layer's slots hold its experts. Raises
    :class:`ModelLoadError` naming the file and tensor or key at fault.
    """
    arch, config, weights, layout = read_gguf(path, device, dtype, dense_as_stored=dense_as_stored)
    built = arch(config, weights)
    built.keep_stored(layout)
    return built, layout


def gguf_config(path: str | Path) -> Mapping[str, Any]:
    """The config.json-style dict of a GGUF's metadata (for tools that want the architecture's numbers)."""
    return read_config(GGUFModel(path))[1]
