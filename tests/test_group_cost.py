"""``bench/group_cost.py``: every group of a real run is timed on the compute thread, the backend is
left as it was, and the fixed / per-job split is the least-squares line of the medians."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchhelpers import load_bench_script
from modelhelpers import build_tiny_model


def test_a_thread_that_sleeps_blocks_and_is_counted() -> None:
    """The switch counts are this thread's: a sleep is one voluntary switch at least."""
    import time

    script = load_bench_script("group_cost")
    before = script._switches()
    if before == (0, 0):
        pytest.skip("no per-thread rusage here")
    time.sleep(0.001)
    assert script._switches()[0] > before[0]


def test_the_line_through_the_medians() -> None:
    script = load_bench_script("group_cost")
    assert script.fixed_and_per_job({1: 1.5, 2: 2.0, 4: 3.0}) == pytest.approx((1.0, 0.5))
    assert script.fixed_and_per_job({3: 2.0}) is None  # one size: no line


def test_every_group_of_a_run_is_timed_and_the_backend_is_left_as_it_was(tmp_path: Path) -> None:
    from runahead.backends.torch import TorchBackend
    from runahead.torchbench import TorchPoint

    script = load_bench_script("group_cost")
    compute = TorchBackend._compute
    path = build_tiny_model("qwen3_moe", tmp_path / "model")
    point = TorchPoint(str(path), "runahead", 3, 0.5, 3, warmup_steps=1, dtype="float32")
    row, groups = script.timed_groups(point)
    assert TorchBackend._compute is compute
    timed: dict[int, int] = {}
    for (_, jobs), times in groups.items():
        timed[jobs] = timed.get(jobs, 0) + len(times)
        for wall, cpu, queued, blocked, preempted in times:
            assert 0 < cpu <= wall + 0.005 and 0 <= queued <= wall + 0.005  # two clocks: a tick apart
            assert blocked >= 0 and preempted >= 0
    assert any(entry for entry, _ in groups) and any(not entry for entry, _ in groups)
    # every group the run computed (the row counts them by size, the entry layer's too) was timed once
    assert timed == {int(jobs): count for jobs, count in row["group_sizes"].items()}
