"""``bench/read_gil.py``: real reads through the disk store beside a compute-like thread, counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchhelpers import load_bench_script
from modelhelpers import build_tiny_model


def test_each_mode_reads_what_it_says_and_counts_the_compute_threads_blocks(tmp_path: Path) -> None:
    script = load_bench_script("read_gil")
    if not hasattr(script.resource, "RUSAGE_THREAD"):
        pytest.skip("no per-thread rusage here")
    path = str(build_tiny_model("qwen3_moe", tmp_path / "model"))
    idle = script.measure(path, "none", 20, idle_s=0.05)
    assert idle["reads"] == 0 and idle["blocks_per_read"] is None and idle["groups"] > 0
    for mode in ("full", "preadv-only", "native"):
        row = script.measure(path, mode, 20)
        assert row["reads"] == 20 and row["wall_s"] > 0 and row["groups"] > 0
        assert row["blocks"] >= 0 and row["blocks_per_read"] == row["blocks"] / 20
        assert row["cpu_us_per_group"] > 0
    with pytest.raises(ValueError, match="expected one of none, full, preadv-only, native"):
        script.measure(path, "copies", 1)
