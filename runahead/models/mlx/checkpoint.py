"""Load a model folder for MLX: resident weights as MLX arrays, routed experts as byte ranges.

Two kinds of folder, told apart by their tensors:

- a Hugging Face folder (float32 / float16 / bfloat16; per-expert or stacked experts), parsed with
  the same headers and expert layout the torch loader reads (:mod:`runahead.models.loader`);
- a GGUF file (llama.cpp's; :mod:`runahead.models.gguf` parses it): resident tensors dequantized
  at load, Q4_0 / Q8_0 experts repacked on the link as MLX 4 / 8-bit affine, group 32, exactly
  (:mod:`runahead.models.mlx.ggufq`); F16 / BF16 / F32 experts as floats;
- mlx-lm's own format (``mlx_lm.convert`` output, the mlx-community checkpoints): experts stacked
  as ``<moe>.switch_mlp.{gate,up,down}_proj.weight [E, out, in']`` (Gemma 4:
  ``experts.switch_glu``), multimodal wrappers' text model under ``language_model.model.``
  (:data:`MLX_LM_PREFIXES`), convolutions ``[C, kernel, in]``, and every matrix mlx-lm
  quantized stored as ``weight`` (packed ``uint32``) + ``scales`` + ``biases`` with the
  ``quantization`` entry of ``config.json`` (global ``group_size`` / ``bits`` and per-module
  overrides) saying how. Each tensor is checked against that entry: a mismatch is refused with
  an error naming the tensor.

An expert is three matrices (``gate``, ``up``, ``down``), each held by its own slot pool
(:mod:`runahead.models.mlx.slots`): its :class:`MatrixFormat` says the pool's tensors (``weight``,
and ``scales`` / ``biases`` when quantized), and each expert's :class:`Piece` s say where their
bytes lie in the files. No expert byte is read here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from runahead.models import get_architecture
from runahead.models.description import ModelDescription, ModelLoadError, MoEConfig
from runahead.models.layout import role_shape, unfused

MATRICES = ("gate", "up", "down")
"""The three matrices of a routed expert, in the order of their slot pools."""

GGUF_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "qwen3_5_moe", "gemma4")
"""Architectures the mlx backend runs from GGUF files (Q4_0 / Q8_0 / float experts); gpt-oss's
expert biases are not in its slot pools yet."""

MLX_LM_REFUSED = ("gpt_oss",)
"""Architectures whose mlx-lm folders are refused: mlx-lm makes gpt-oss's only from the hub's
MXFP4 tensors (its ``sanitize`` renames ``*_blocks``), experts with biases, not read here yet."""

QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)

FILE_DTYPES: dict[str, Any] = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
}
"""Safetensors dtypes an expert tensor may have, and their MLX dtypes."""


@dataclass(frozen=True, slots=True)
class Quant:
    """MLX affine quantization of one matrix: ``bits`` per weight, one scale and bias per ``group_size``."""

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in QUANT_BITS or self.group_size not in GROUP_SIZES:
            raise ModelLoadError(
                f"quantization bits={self.bits}, group_size={self.group_size} is not MLX affine "
                f"quantization (bits {QUANT_BITS}, group sizes {GROUP_SIZES})"
            )


@dataclass(frozen=True, slots=True)
class MatrixFormat:
    """How one expert matrix (``[out, in]``; gpt-oss: its stored roles) is held, per expert.

    ``tensors`` maps ``weight`` (and ``scales``, ``biases`` when ``quant``) to ``(shape, file dtype)``.
    """

    name: str
    shape: tuple[int, ...]
    quant: Quant | None
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]

    @property
    def nbytes(self) -> int:
        """Bytes one expert's matrix takes on the link (in its file's dtypes)."""
        return sum(math.prod(shape) * FILE_DTYPES[d].size for _, shape, d in self.tensors)


@dataclass(frozen=True, slots=True)
class Piece:
    """One expert's part of one pool tensor ``pool`` (``gate.weight``, ``up.scales``...): a byte range."""

    pool: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(slots=True)
class Checkpoint:
    """What :func:`load_checkpoint` found: config, description, resident weights and the experts' bytes."""

    config: MoEConfig
    arch: type[ModelDescription]
    weights: dict[str, mx.array]
    """Canonical resident name -> array; a quantized matrix also has ``<name>.scales`` / ``.biases``."""
    quant: dict[str, Quant]
    """Canonical name -> quantization of the resident matrices mlx-lm quantized."""
    formats: dict[str, MatrixFormat]
    """``gate`` / ``up`` / ``down`` -> the format every layer's experts have."""
    experts: dict[tuple[int, int], tuple[Piece, ...]]
    mlx_format: bool
    sanitized: bool = False
    """The folder holds what mlx-lm's ``sanitize`` made of the hub's tensors: convolutions stored
    ``[C, kernel, in]`` (turned back to ``[C, in, kernel]`` here), and whatever else the
    architecture's mlx-lm code rewrote (Qwen3.5: its norm weights already ``1 + w``)."""

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert on the link."""
        return sum(f.nbytes for f in self.formats.values())


MLX_LM_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
"""Where mlx-lm's multimodal wrappers (Qwen3.5, Gemma 4) keep the text model's tensors, and the
names they are read under here."""


def _mlx_lm_name(name: str) -> str:
    for prefix, canonical in MLX_LM_PREFIXES:
        if name.startswith(prefix):
            return canonical + name[len(prefix) :]
    return name


def _quantization(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    entry = raw.get("quantization") or raw.get("quantization_config")
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ModelLoadError(f"config.json: 'quantization' must be an object, got {entry!r}")
    mode = entry.get("mode", "affine")
    if mode != "affine":
        raise ModelLoadError(f"config.json: quantization mode {mode!r} is not supported (only 'affine')")
    return {_mlx_lm_name(key): value for key, value in entry.items()}


def _quant_of(entry: Mapping[str, Any] | None, module: str, tensor: str) -> Quant:
    """The quantization config.json gives ``module`` (a per-module override, else the global one)."""
    if entry is None:
        raise ModelLoadError(
            f"tensor {tensor} is quantized (it has scales) but config.json has no quantization"
        )
    spec = entry.get(module, entry)
    if spec is False or not isinstance(spec, Mapping):
        raise ModelLoadError(f"tensor {tensor} is quantized but config.json's quantization excludes {module}")
    try:
        return Quant(int(spec["bits"]), int(spec["group_size"]))
    except KeyError as err:
        raise ModelLoadError(f"config.json: quantization of {module} lacks {err.args[0]!r}") from None


def _check_quantized(
    infos: Mapping[str, Any], module: str, shape: tuple[int, ...], quant: Quant, stacked: int | None = None
) -> None:
    """Check ``module``'s weight / scales / biases against ``shape`` ``[out, in]`` and ``quant``."""
    out, inner = shape
    lead = () if stacked is None else (stacked,)
    if inner % quant.group_size:
        raise ModelLoadError(
            f"tensor {module}.weight: input width {inner} is not a multiple of group size {quant.group_size}"
        )
    want = {
        "weight": ((*lead, out, inner * quant.bits // 32), ("U32",)),
        "scales": ((*lead, out, inner // quant.group_size), ("F32", "F16", "BF16")),
        "biases": ((*lead, out, inner // quant.group_size), ("F32", "F16", "BF16")),
    }
    for part, (want_shape, dtypes) in want.items():
        name = f"{module}.{part}"
        info = infos.get(name)
        if info is None:
            raise ModelLoadError(f"missing tensor {name} (quantized {module})")
        if info.shape != want_shape or info.dtype not in dtypes:
            raise ModelLoadError(
                f"tensor {name}: expected {list(want_shape)} {'/'.join(dtypes)} for {quant.bits}-bit "
                f"group-{quant.group_size} quantization of a {list(shape)} matrix (config.json's "
                f"quantization), found {list(info.shape)} {info.dtype}"
            )


def load_checkpoint(path: str | Path, dtype: Any = None) -> Checkpoint:
    """Parse the folder ``path`` and load its resident weights (floats in ``dtype``, or as stored if None).

    Raises :class:`ModelLoadError` naming the file, tensor or key at fault.
    """
    from runahead.models.gguf import is_gguf
    from runahead.models.loader import read_config, read_headers, text_config, weight_files

    if is_gguf(path):
        return _gguf_checkpoint(path, dtype)
    raw = text_config(read_config(path))
    arch = get_architecture(str(raw.get("model_type")))
    config = arch.parse_config(raw)
    entry = _quantization(raw)
    infos = {_mlx_lm_name(name): info for name, info in read_headers(weight_files(path)).items()}
    if config.model_type in MLX_LM_REFUSED and (
        entry is not None or "model.layers.0.mlp.experts.gate_proj.weight" in infos
    ):
        raise ModelLoadError(
            f"{path}: mlx-lm's {config.model_type} folders (quantized, or experts as "
            "mlp.experts.gate_proj) do not run on the mlx backend yet; use the Hugging Face folder"
        )
    names, shapes = arch.weight_names(config), arch.weight_shapes(config)
    weights: dict[str, mx.array] = {}
    quant: dict[str, Quant] = {}
    arrays: dict[str, dict[str, mx.array]] = {}
    sanitized = False

    def array(info: Any) -> mx.array:
        if info.path not in arrays:
            loaded = mx.load(info.path)  # lazy: only what is evaluated is read
            assert isinstance(loaded, dict)
            arrays[info.path] = loaded
        return arrays[info.path][info.name]

    for key, shape in shapes.items():
        name = next((n for n in names[key] if n in infos), None)
        if name is None:
            raise ModelLoadError(f"missing tensor {names[key][0]}")
        module = name.removesuffix(".weight")
        if module + ".scales" in infos:
            if len(shape) != 2:
                raise ModelLoadError(f"tensor {module}.scales: a {list(shape)} weight cannot be quantized")
            q = _quant_of(entry, module, name)
            _check_quantized(infos, module, shape, q)
            quant[key] = q
            weights[key] = array(infos[name])
            for part in ("scales", "biases"):
                weights[f"{key}.{part}"] = _cast(array(infos[f"{module}.{part}"]), dtype)
            continue
        info = infos[name]
        turned = len(shape) == 3 and shape[1] != shape[2] and info.shape == (shape[0], shape[2], shape[1])
        if info.shape != shape and not turned:
            raise ModelLoadError(f"tensor {name}: expected shape {list(shape)}, found {list(info.shape)}")
        if info.dtype not in ("F32", "F16", "BF16"):
            raise ModelLoadError(f"tensor {name}: unsupported dtype {info.dtype}")
        weights[key] = _cast(array(info), dtype)
        if turned:  # mlx-lm's Conv1d layout [out, kernel, in]
            weights[key] = weights[key].swapaxes(1, 2)
            sanitized = True
    mx.eval(list(weights.values()))
    arrays.clear()  # drop the lazily loaded expert tensors: experts come through the slots
    switch = _switch_prefix(arch, config, infos)
    if switch is not None:
        formats, experts = _mlx_experts(config, infos, entry, switch)
    else:
        formats, experts = _hf_experts(arch, config, infos)
    return Checkpoint(config, arch, weights, quant, formats, experts, switch is not None, sanitized)


def _cast(a: mx.array, dtype: Any) -> mx.array:
    return a if dtype is None or a.dtype == dtype else a.astype(dtype)


def _switch_prefix(arch: type[ModelDescription], config: MoEConfig, infos: Mapping[str, Any]) -> str | None:
    """mlx-lm's ``model.layers.{layer}.<moe>.switch_mlp`` (Gemma 4: ``experts.switch_glu``) spelling
    of this checkpoint, or None (HF)."""
    for switch in (*(f"{moe}.switch_mlp" for moe in arch.moe_prefixes), "experts.switch_glu"):
        pattern = f"model.layers.{{layer}}.{switch}"
        if pattern.format(layer=0) + ".gate_proj.weight" in infos:
            return pattern
    return None


def _mlx_experts(
    config: MoEConfig, infos: Mapping[str, Any], entry: Mapping[str, Any] | None, switch: str
) -> tuple[dict[str, MatrixFormat], dict[tuple[int, int], tuple[Piece, ...]]]:
    """Experts of mlx-lm's format: stacked ``switch_mlp`` tensors, float or quantized, expert-major."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_experts
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    formats: dict[str, MatrixFormat] = {}
    experts: dict[tuple[int, int], list[Piece]] = {}
    for layer in range(config.num_layers):
        for matrix in MATRICES:
            module = f"{switch.format(layer=layer)}.{matrix}_proj"
            shape = shapes[matrix]
            if module + ".scales" in infos:
                q: Quant | None = _quant_of(entry, module, module + ".weight")
                assert q is not None
                _check_quantized(infos, module, shape, q, stacked=n)
                parts: tuple[str, ...] = ("weight", "scales", "biases")
            else:
                q, parts = None, ("weight",)
                info = infos.get(module + ".weight")
                if info is None:
                    raise ModelLoadError(f"missing tensor {module}.weight")
                if info.shape != (n, *shape) or info.dtype not in ("F32", "F16", "BF16"):
                    raise ModelLoadError(
                        f"tensor {module}.weight: expected {[n, *shape]} float, found "
                        f"{list(info.shape)} {info.dtype}"
                    )
            tensors = tuple(
                (p, infos[f"{module}.{p}"].shape[1:], infos[f"{module}.{p}"].dtype) for p in parts
            )
            fmt = MatrixFormat(matrix, shape, q, tensors)
            if formats.setdefault(matrix, fmt) != fmt:
                raise ModelLoadError(
                    f"tensor {module}.weight: layer {layer}'s {matrix} experts are stored unlike layer 0's "
                    f"({fmt.quant} {fmt.tensors} vs {formats[matrix].quant} {formats[matrix].tensors}); "
                    "mixed expert formats are not supported"
                )
            for part in parts:
                info = infos[f"{module}.{part}"]
                per = info.nbytes // n
                for e in range(n):
                    experts.setdefault((layer, e), []).append(
                        Piece(
                            f"{matrix}.{part}",
                            info.path,
                            info.offset + e * per,
                            per,
                            info.dtype,
                            info.shape[1:],
                        )
                    )
    return formats, {key: tuple(pieces) for key, pieces in experts.items()}


def _hf_experts(
    arch: type[ModelDescription], config: MoEConfig, infos: Mapping[str, Any]
) -> tuple[dict[str, MatrixFormat], dict[tuple[int, int], tuple[Piece, ...]]]:
    """Experts of a Hugging Face folder, from the torch loader's layout (a fused gate_up splits in two)."""
    from runahead.models.loader import expert_layout

    layout = expert_layout(arch, config, infos)  # type: ignore[arg-type]
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    experts: dict[tuple[int, int], tuple[Piece, ...]] = {}
    dtypes: dict[str, str] = {}
    for key, ranges in layout.ranges.items():
        pieces: list[Piece] = []
        for r in ranges:
            for matrix, offset, nbytes in unfused(r.role, r.offset, r.nbytes):
                shape = shapes.setdefault(matrix, role_shape(matrix, h, i))  # gpt-oss: stored roles
                pieces.append(Piece(f"{matrix}.weight", r.path, offset, nbytes, r.dtype, shape))
                if dtypes.setdefault(matrix, r.dtype) != r.dtype:
                    raise ModelLoadError(
                        f"{r.path}: expert {key} {matrix} is {r.dtype}, others are {dtypes[matrix]}"
                    )
        experts[key] = tuple(pieces)
    formats = {m: MatrixFormat(m, shapes[m], None, (("weight", shapes[m], d),)) for m, d in dtypes.items()}
    return formats, experts


def _gguf_checkpoint(path: str | Path, dtype: Any) -> Checkpoint:
    """A GGUF file through the torch loader's parse: the resident matrices and the embedding the
    file stores in Q4_0 / Q8_0 blocks (whole blocks, as ``read_gguf(dense_as_stored=True)`` keeps
    them) repacked once as MLX affine 4 / 8-bit group 32 (exactly, :mod:`.ggufq`), multiplied by
    ``mx.quantized_matmul`` as mlx-lm's quantized matrices; the other resident weights dequantized;
    each expert matrix is one piece of the file's blocks, repacked when read."""
    from runahead.models.gguf import read_gguf
    from runahead.models.mlx.ggufq import GGUF_QUANT

    # the resident weights as the checkpoint holds them (matrices in blocks where the file has them so)
    arch, config, torch_weights, layout = read_gguf(path, dense_as_stored=True)
    if config.model_type not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF {config.model_type} models do not run on the mlx backend yet (its GGUF "
            f"architectures: {', '.join(GGUF_ARCHITECTURES)}); use --backend torch"
        )
    if config.tie_word_embeddings:
        torch_weights.pop("lm_head", None)
    weights, quant = _gguf_resident(torch_weights, dtype)
    mx.eval(list(weights.values()))
    formats: dict[str, MatrixFormat] = {}
    experts: dict[tuple[int, int], tuple[Piece, ...]] = {}
    for key, ranges in layout.ranges.items():
        pieces = []
        for r in ranges:
            out, inner = r.shape[-2], r.shape[-1]
            if r.dtype in GGUF_QUANT:
                bits = GGUF_QUANT[r.dtype][0]
                fmt = MatrixFormat(
                    r.role,
                    (out, inner),
                    Quant(bits, 32),
                    (("weight", (out, inner * bits // 32), "U32"), ("scales", (out, inner // 32), "F32"),
                     ("biases", (out, inner // 32), "F32")),
                )  # fmt: skip
            else:
                fmt = MatrixFormat(r.role, (out, inner), None, (("weight", (out, inner), r.dtype),))
            if formats.setdefault(r.role, fmt) != fmt:
                raise ModelLoadError(
                    f"{r.path}: expert {key} {r.role} is {r.dtype}, layer 0's is stored otherwise; "
                    "mixed expert types across layers are not supported on the mlx backend"
                )
            pieces.append(Piece(f"{r.role}.gguf", r.path, r.offset, r.nbytes, r.dtype, (out, inner)))
        experts[key] = tuple(pieces)
    return Checkpoint(config, arch, weights, quant, formats, experts, False)


def _gguf_resident(
    torch_weights: Mapping[str, Any], dtype: Any
) -> tuple[dict[str, mx.array], dict[str, Quant]]:
    """The resident weights as MLX arrays: a matrix kept in GGUF blocks (``uint8 [rows, blocks,
    bytes]``) as ``weight`` / ``scales`` / ``biases`` of its MLX affine form (float32 scales and
    biases, so ``d * q - 8 d`` stays exact), the rest (float32, or half-width as stored) in ``dtype``."""
    import numpy as np
    import torch

    from runahead.models.mlx.ggufq import GGUF_QUANT, repack
    from runahead.models.quant import stored_kind

    weights: dict[str, mx.array] = {}
    quant: dict[str, Quant] = {}
    for key, t in torch_weights.items():
        if t.dtype == torch.uint8:
            kind = stored_kind(t)
            rows, blocks, _ = t.shape
            packed, scales, biases = repack(kind, t.numpy(), (rows, blocks * 32))
            weights[key], weights[f"{key}.scales"], weights[f"{key}.biases"] = map(
                mx.array, (packed, scales, biases)
            )
            quant[key] = Quant(GGUF_QUANT[kind][0], 32)
        else:
            weights[key] = _cast(mx.array(np.asarray(t.float().numpy())), dtype)
    return weights, quant
