"""Load a Hugging Face model folder: resident weights into a model, routed experts into a layout.

The folder holds ``config.json`` and ``model.safetensors``, or shards listed by
``model.safetensors.index.json``. Safetensors headers are parsed here (8-byte little-endian
length, then JSON with each tensor's dtype, shape and data offsets relative to the data start), so
every expert's absolute byte range is known without reading it: the expert store reads those
ranges into cache slots. Resident (non-expert) weights load through ``safetensors.safe_open`` and
are widened to the compute dtype.

Experts may be stored per expert (the hub's names) or stacked (transformers'
``save_original_format=False``: ``gate_up_proj [E, 2I, H]``, gate rows first, and
``down_proj [E, H, I]``); expert ``e`` of a stacked tensor is its ``e``-th contiguous slice. Both
orientations already match the slot format, so no range needs transposing.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runahead.models import get_architecture
from runahead.models.base import ModelLoadError, MoEConfig, MoEModel
from runahead.models.layout import ExpertLayout, TensorRange, role_shape

__all__ = ["ModelLoadError", "load_model", "load_reference_slot", "load_tokenizer", "read_config"]

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
}
"""Safetensors dtypes the loader reads, with their torch dtype and size in bytes."""

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies: its file, absolute byte offset, size, dtype name and shape."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    name: str = ""  # the tensor's name in the file (a wrapper's prefix included)


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model folder; :class:`ModelLoadError` if absent or invalid.

    For a ``.gguf`` file, the same keys built from its metadata (:func:`runahead.models.gguf.gguf_config`).
    """
    from runahead.models.gguf import gguf_config, is_gguf

    if is_gguf(path):
        return dict(gguf_config(path))
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{file}: invalid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file}: expected a JSON object")
    return raw


def text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: a multimodal wrapper's ``text_config`` (its own keys first), else ``raw``.

    Hub checkpoints of Qwen3.5/3.6 and Gemma 4 wrap the MoE text model in a vision-language config;
    only the text part runs here. Keys the wrapper holds for the text model (``tie_word_embeddings``,
    token ids) fill in what ``text_config`` leaves out.
    """
    inner = raw.get("text_config")
    if not isinstance(inner, Mapping):
        return dict(raw)
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config", "audio_config")}
    merged.update(inner)
    merged.setdefault("model_type", raw.get("model_type"))
    return merged


TEXT_PREFIXES = ("model.language_model.",)
"""Where multimodal checkpoints keep the text model's tensors; read as if they were under ``model.``."""


def _text_name(name: str) -> str:
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    return name


def weight_files(path: str | Path) -> list[Path]:
    """The folder's safetensors files: the shards of the index, else ``model.safetensors``."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{folder}: missing shard {file.name} (listed in {INDEX_FILE})")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise ModelLoadError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}")


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file with its absolute byte range, checked against the file size."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{file.name}: truncated (no safetensors header)")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise ModelLoadError(f"{file.name}: truncated header ({length} bytes declared, file is {size})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{file.name}: invalid safetensors header ({err})") from None
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shape = tuple(int(d) for d in entry["shape"])
        if 8 + length + end > size:
            raise ModelLoadError(
                f"{file.name}: truncated: tensor {name} ends at byte {8 + length + end}, file has {size}"
            )
        if entry["dtype"] in DTYPES and end - begin != math.prod(shape) * DTYPES[entry["dtype"]][1]:
            raise ModelLoadError(
                f"{file.name}: tensor {name} has {end - begin} bytes for shape {list(shape)}"
            )
        infos[name] = TensorInfo(str(file), 8 + length + begin, end - begin, entry["dtype"], shape, name)
    return infos


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """The tensors of all files of a checkpoint, by name."""
    infos: dict[str, TensorInfo] = {}
    for file in files:
        infos.update({_text_name(name): info for name, info in read_header(file).items()})
    return infos


def _find(
    infos: Mapping[str, TensorInfo], names: tuple[str, ...], shape: tuple[int, ...]
) -> tuple[str, TensorInfo]:
    """The first of ``names`` present, checked for ``shape`` and a readable dtype."""
    name = next((n for n in names if n in infos), None)
    if name is None:
        raise ModelLoadError(f"missing tensor {names[0]}")
    info = infos[name]
    if info.shape != shape:
        raise ModelLoadError(f"tensor {name}: expected shape {list(shape)}, found {list(info.shape)}")
    if info.dtype not in DTYPES:
        raise ModelLoadError(
            f"tensor {name}: unsupported dtype {info.dtype} (expected one of {list(DTYPES)})"
        )
    return name, info


def expert_layout(arch: type[MoEModel], config: MoEConfig, infos: Mapping[str, TensorInfo]) -> ExpertLayout:
    """Byte ranges of every routed expert, from per-expert or stacked tensors (detected per layer)."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_experts
    ranges: dict[tuple[int, int], tuple[TensorRange, ...]] = {}
    biases = False
    for layer in range(config.num_layers):
        stacked = arch.stacked_expert_tensors(layer)
        first = stacked[0][0]
        if first + "_blocks" in infos:
            raise ModelLoadError(
                f"tensor {first}_blocks: MXFP4-quantized experts are not supported yet (quantized "
                "experts are future work); dequantize them to bf16 first (transformers: "
                "Mxfp4Config(dequantize=True), then save_pretrained)"
            )
        if first in infos:
            found = [(_find(infos, (name,), (n, *role_shape(role, h, i)))[1], role) for name, role in stacked]
            for e in range(n):
                ranges[layer, e] = tuple(_slice(info, e, role) for info, role in found)
            biases = any(role.endswith("_bias") for _, role in stacked)
            continue
        for e in range(n):
            names = arch.expert_names(layer, e)
            shapes = ((i, h), (i, h), (h, i))
            ranges[layer, e] = tuple(
                _range(_find(infos, (name,), shape)[1], role)
                for name, shape, role in zip(names, shapes, ("gate", "up", "down"), strict=True)
            )
    return ExpertLayout(config.num_layers, n, h, i, ranges, biases)


def _range(info: TensorInfo, role: str) -> TensorRange:
    return TensorRange(info.path, info.offset, info.nbytes, info.dtype, info.shape, role)


def _slice(info: TensorInfo, expert: int, role: str) -> TensorRange:
    per = info.nbytes // info.shape[0]
    return TensorRange(info.path, info.offset + expert * per, per, info.dtype, info.shape[1:], role)


def model_config(path: str | Path) -> MoEConfig:
    """The parsed config of the Hugging Face folder (or ``.gguf`` file) ``path``; no weights are read."""
    from runahead.models.gguf import GGUFModel, is_gguf
    from runahead.models.gguf import read_config as read_gguf_config

    raw = read_gguf_config(GGUFModel(path))[1] if is_gguf(path) else text_config(read_config(path))
    return get_architecture(str(raw.get("model_type"))).parse_config(raw)


def checkpoint_layout(path: str | Path) -> ExpertLayout:
    """Where a Hugging Face folder's routed experts lie, from its config and tensor headers alone
    (no weight is read): the layout :func:`load_model` returns with the model."""
    arch, config, infos = _checkpoint(path)
    return expert_layout(arch, config, infos)


def _checkpoint(path: str | Path) -> tuple[type[MoEModel], MoEConfig, dict[str, TensorInfo]]:
    raw = text_config(read_config(path))
    arch = get_architecture(str(raw.get("model_type")))
    return arch, arch.parse_config(raw), read_headers(weight_files(path))


def kept_half(key: str, weight: torch.Tensor) -> bool:
    """Whether the loader keeps resident matrix ``key`` as its file stores ``weight`` (bfloat16 or
    float16) when asked to (``load_model(dense_as_stored=True)``): where the kernel runs, the rule
    every checkpoint shares (:func:`runahead.models.quant.stays_as_stored`). Such a matrix costs half
    of float32's bytes in memory and in every group that reads it, and never exists widened (the
    embedding, looked up rather than multiplied, and so a tied LM head, are widened as before)."""
    from runahead.models import qkernel
    from runahead.models.quant import stays_as_stored

    return qkernel.available() and stays_as_stored(key, qkernel.HALF_KINDS.get(weight.dtype), weight.shape)


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    dense_as_stored: bool = False,
) -> tuple[MoEModel, ExpertLayout]:
    """Load a Hugging Face MoE folder: its resident weights in ``dtype`` on ``device``, and its expert layout.

    Called once at start-up. Routed experts are not loaded; the returned :class:`ExpertLayout`
    says where each lies. Raises :class:`ModelLoadError` naming the file, tensor or key at fault.
    ``dense_as_stored`` (float32 compute on the CPU with the kernel): the half-width matrices
    :func:`kept_half` names stay as stored, never widened (a GGUF's Q4_0 /
    Q8_0 / F16 / BF16 ones too: :func:`runahead.models.gguf.read_gguf`).
    A ``.gguf`` file (or one part of a split one) loads through :func:`runahead.models.gguf.load_gguf`:
    its experts stay as stored (a ``stored`` layout).
    """
    from safetensors import safe_open

    from runahead.models.gguf import is_gguf, load_gguf

    if is_gguf(path):
        return load_gguf(path, device=device, dtype=dtype, dense_as_stored=dense_as_stored)

    arch, config, infos = _checkpoint(path)
    names = arch.weight_names(config)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for key, shape in arch.weight_shapes(config).items():
        _, info = _find(infos, names[key], shape)
        by_file.setdefault(info.path, []).append((key, info.name))
    weights: dict[str, torch.Tensor] = {}
    for file, wanted in by_file.items():
        with safe_open(file, framework="pt") as f:
            for key, name in wanted:
                # A fresh, aligned copy: never a view into the mapped file (whose alignment would
                # change matmul rounding from one file layout to another).
                tensor = f.get_tensor(name)
                kept = dense_as_stored and kept_half(key, tensor)
                weights[key] = tensor.to(device=device, dtype=tensor.dtype if kept else dtype, copy=True)
    return arch(config, weights), expert_layout(arch, config, infos)


def load_reference_slot(
    layout: ExpertLayout, layer: int, expert: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One expert's cache slot filled with plain buffered reads of its byte ranges.

    The correctness reference for the expert store, and the slot source of tests. Returns a flat
    ``[3 * I * H]`` CPU tensor (``gate | up | down``) in ``dtype``; for a ``stored`` layout the
    slot's bytes (``uint8``, the file's own) whatever ``dtype`` says.
    """
    if layout.stored:
        dtype = torch.uint8
    slot = torch.zeros(layout.slot_numel, dtype=dtype)
    offsets = layout.part_offsets(layer)
    for rng in layout.ranges[layer, expert]:
        with open(rng.path, "rb") as f:
            f.seek(rng.offset)
            data = bytearray(f.read(rng.nbytes))
        if len(data) != rng.nbytes:
            raise ModelLoadError(f"{Path(rng.path).name}: truncated: expert ({layer}, {expert}) {rng.role}")
        tensor = torch.frombuffer(data, dtype=torch.uint8 if layout.stored else DTYPES[rng.dtype][0])
        start, stop = offsets[rng.role]
        slot[start:stop] = tensor.to(dtype)
    return slot


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in the model folder, loaded offline with ``transformers.AutoTokenizer``.

    Raises ``FileNotFoundError`` when the folder has no tokenizer files (``transformers`` would
    otherwise load an empty vocabulary that encodes every text to no tokens). A ``.gguf`` file's
    tokenizer and chat template are built from its metadata (``tokenizer.ggml.*``) by transformers.
    """
    from transformers import AutoTokenizer

    from runahead.models.gguf import is_gguf
    from runahead.tokenizer import TOKENIZER_FILES, has_tokenizer

    if is_gguf(path):
        from transformers import PreTrainedTokenizerFast

        from runahead.models.gguf import GGUFModel

        if not has_tokenizer(path):
            raise FileNotFoundError(f"{path} has no tokenizer in its metadata (tokenizer.ggml.tokens)")
        file = Path(path)
        # AutoTokenizer also parses the file's config, which transformers cannot for Gemma 4 (per-layer
        # KV heads); the tokenizer alone needs only the tokenizer.ggml.* keys
        gemma4 = GGUFModel(path).meta("general.architecture") == "gemma4"
        loader = PreTrainedTokenizerFast if gemma4 else AutoTokenizer
        return loader.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)

    if not has_tokenizer(path):
        raise FileNotFoundError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
