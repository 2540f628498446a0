"""``bench/read_gil.py``: real reads through the disk store beside a compute-like thread, counted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from modelhelpers import build_tiny_model

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "read_gil.py"


def load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("read_gil", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["read_gil"] = module
    spec.loader.exec_module(module)
    return module


def test_each_mode_reads_what_it_says_and_counts_the_compute_threads_blocks(tmp_path: Path) -> None:
    script = load_script()
    if not hasattr(script.resource, "RUSAGE_THREAD"):
        pytest.skip("no per-thread rusage here")
    path = str(build_tiny_model("qwen3_moe", tmp_path / "model"))
    idle = script.measure(path, "none", 20, idle_s=0.05)
    assert idle["reads"] == 0 and idle["blocks_per_read"] is None and idle["groups"] > 0
    for mode in ("full", "preadv-only"):
        row = script.measure(path, mode, 20)
        assert row["reads"] == 20 and row["wall_s"] > 0 and row["groups"] > 0
        assert row["blocks"] >= 0 and row["blocks_per_read"] == row["blocks"] / 20
        assert row["cpu_us_per_group"] > 0
    with pytest.raises(ValueError, match="expected one of none, full, preadv-only"):
        script.measure(path, "copies", 1)
