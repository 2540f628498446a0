"""The MLX backend's expert reader on the stores' C threads: the same host arrays as its Python
threads, for a float checkpoint and an mlx-lm 4-bit one (its pieces are bytes as stored)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from runahead.models.mlx.checkpoint import load_checkpoint
from runahead.models.mlx.slots import ExpertReader
from runahead.store import native

from mlxhelpers import build_mlx_model, convert

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native reader library does not build here"
)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "mlx-4bit"])
def test_c_threads_read_what_python_threads_read(tmp_path: Path, quantized: bool) -> None:
    folder = build_mlx_model("qwen3_moe", tmp_path / "model", quantized=quantized)
    if quantized:
        folder = convert(folder, tmp_path / "q4")
    experts = load_checkpoint(folder).experts
    keys = sorted(experts)

    async def read_all(reader: ExpertReader) -> list[dict[str, np.ndarray]]:
        return list(await asyncio.gather(*(reader.read(*key) for key in keys)))

    readers = ExpertReader(experts, native=True), ExpertReader(experts, native=False)
    try:
        assert readers[0]._native is not None and readers[1]._native is None
        on_c, on_python = (asyncio.run(read_all(reader)) for reader in readers)
    finally:
        for reader in readers:
            reader.close()
    kinds = {p.dtype for pieces in experts.values() for p in pieces}
    assert "U32" in kinds if quantized else "F32" in kinds
    for c_arrays, python_arrays in zip(on_c, on_python, strict=True):
        assert c_arrays.keys() == python_arrays.keys()
        for name, array in python_arrays.items():
            assert c_arrays[name].dtype == array.dtype and c_arrays[name].shape == array.shape
            assert np.array_equal(c_arrays[name].view(np.uint8), array.view(np.uint8))
    assert readers[0].bytes_read == readers[1].bytes_read
