"""Helpers for the expert-store tests: tiny real safetensors files and their :class:`ExpertLayout`.

The layout parser here is deliberately small (it knows the two naming schemes these helpers write);
the model loader has its own.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from runahead.models.layout import ExpertLayout, TensorRange

PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj")
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def read_header(path: Path) -> tuple[dict[str, dict[str, object]], int]:
    """A safetensors file's tensor entries and the byte offset where its data starts."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def write_experts(
    directory: Path,
    *,
    layers: int = 2,
    experts: int = 4,
    hidden: int = 64,
    inter: int = 32,
    dtype: torch.dtype = torch.float32,
    stacked: bool = False,
    shards: int = 2,
    seed: int = 0,
) -> tuple[list[Path], dict[tuple[int, int], torch.Tensor]]:
    """Write random experts as safetensors (layers split over ``shards`` files) in ``directory``.

    Per-expert tensors use the hub names (``...experts.E.gate_proj.weight``); ``stacked`` writes
    ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``. A non-expert tensor is
    written first in each file so expert offsets are not block aligned. Returns the paths and each
    expert's expected slot (gate, up, down flattened, in ``dtype``).
    """
    gen = torch.Generator().manual_seed(seed)
    expected: dict[tuple[int, int], torch.Tensor] = {}
    shard_tensors: list[dict[str, torch.Tensor]] = [
        {"model.embed_tokens.weight": torch.randn(3, 5, generator=gen).to(dtype)} for _ in range(shards)
    ]
    for layer in range(layers):
        tensors = shard_tensors[layer * shards // layers]
        gate = torch.randn(experts, inter, hidden, generator=gen).to(dtype)
        up = torch.randn(experts, inter, hidden, generator=gen).to(dtype)
        down = torch.randn(experts, hidden, inter, generator=gen).to(dtype)
        prefix = f"model.layers.{layer}.mlp.experts"
        if stacked:
            tensors[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
            tensors[f"{prefix}.down_proj"] = down.contiguous()
        for e in range(experts):
            if not stacked:
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate[e].clone()
                tensors[f"{prefix}.{e}.up_proj.weight"] = up[e].clone()
                tensors[f"{prefix}.{e}.down_proj.weight"] = down[e].clone()
            expected[(layer, e)] = torch.cat([gate[e].flatten(), up[e].flatten(), down[e].flatten()])
    paths = []
    for i, tensors in enumerate(shard_tensors):
        path = directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path))
        paths.append(path)
    return paths, expected


def layout_from_safetensors(
    paths: list[Path], *, layers: int, experts: int, hidden: int, inter: int
) -> ExpertLayout:
    """Parse the headers of ``paths`` into an :class:`ExpertLayout` (both naming schemes)."""
    ranges: dict[tuple[int, int], list[TensorRange]] = {}
    for path in paths:
        header, data_start = read_header(path)
        for name, entry in header.items():
            dtype = str(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])  # type: ignore[attr-defined]
            begin, end = (int(x) for x in entry["data_offsets"])  # type: ignore[attr-defined]
            if m := PER_EXPERT.fullmatch(name):
                key = (int(m[1]), int(m[2]))
                ranges.setdefault(key, []).append(
                    TensorRange(str(path), data_start + begin, end - begin, dtype, shape, m[3])
                )
            elif m := STACKED.fullmatch(name):
                per = (end - begin) // shape[0]
                for e in range(shape[0]):
                    ranges.setdefault((int(m[1]), e), []).append(
                        TensorRange(str(path), data_start + begin + e * per, per, dtype, shape[1:], m[2])
                    )
    return ExpertLayout(layers, experts, hidden, inter, {k: tuple(v) for k, v in ranges.items()})


def supports_o_direct(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT`` (False on tmpfs, macOS)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    fd, name = tempfile.mkstemp(dir=directory)
    os.close(fd)
    try:
        fd = os.open(name, os.O_RDONLY | flag)
        os.close(fd)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.unlink(name)


def o_direct_dir(tmp_path: Path) -> Path | None:
    """A fresh directory on a filesystem that supports O_DIRECT: ``tmp_path`` when it does, else
    one under ``/var/tmp``, the home directory or the repository; None if none does."""
    if supports_o_direct(tmp_path):
        return tmp_path
    repo = Path(__file__).resolve().parent.parent
    for base in (Path("/var/tmp"), Path.home(), repo / ".pytest_cache"):
        try:
            base.mkdir(parents=True, exist_ok=True)
            candidate = Path(tempfile.mkdtemp(prefix="runahead-store-", dir=base))
        except OSError:
            continue
        if supports_o_direct(candidate):
            return candidate
        candidate.rmdir()
    return None
