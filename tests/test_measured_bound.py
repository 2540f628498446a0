"""``bench/compute_fit.py --bound``: the small-case model (runahead.bound) on a torch run's own
routing and measured costs, and the order its schedules must keep."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from benchhelpers import BENCH


def test_the_bound_at_measured_costs_lies_between_the_rules_and_the_floor(tmp_path: Path) -> None:
    env = {**os.environ, "RUNAHEAD_CACHE": str(tmp_path / "cache")}
    args = ["bench", "--backend", "torch", "--model", "small", "--store", "host", "--link-gbps", "1"]
    args += ["--cache-fraction", "0.7", "--steps", "6", "--warmup-steps", "2", "--concurrency", "2"]
    args += ["--policy", "sync,runahead/grouping=bottleneck", "--out", str(tmp_path / "rows")]
    done = subprocess.run(
        [sys.executable, str(BENCH / "compute_fit.py"), *args, "--bound", "1", "2", "200000"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    head = r"bound at measured costs: 2 cases of 1 round\(s\) x 8 layers, [\d.]+ ms a read"
    assert re.search(head, out), out
    summed = next(line for line in out.splitlines() if line.strip().startswith("summed:"))
    shares = {name: int(value) for name, value in re.findall(r"(\w+) (-?\d+)%", summed.split("share of")[1])}
    assert set(shares) == {"bound", "holds", "pilot", "floor", "paper", "bottleneck"}, summed
    # the exact bound is the best schedule of the model: no rule played through it, nor the best
    # holds or pilot schedules, is shorter, and the relaxation's floor is shorter still
    for name in ("holds", "pilot", "paper", "bottleneck"):
        assert shares[name] <= shares["bound"], summed
    assert shares["bound"] <= shares["floor"], summed
    assert shares["paper"] <= shares["holds"], summed  # the paper's grouping never waits: one holds schedule
    assert "measured runahead/grouping=bottleneck:" in out
