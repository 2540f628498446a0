"""``bench/compute_fit.py --bound``: the small-case model (runahead.bound) on a torch run's own
routing and measured costs, and the order its schedules must keep."""

from __future__ import annotations

import json
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
    summed = json.loads((tmp_path / "rows" / "bound.json").read_text())
    shares = {key.removesuffix("_share_of_limit"): v for key, v in summed["model"].items() if key != "limit"}
    assert set(shares) == {"sync", "bound", "holds", "pilot", "floor", "paper", "bottleneck"}, summed
    # the exact bound is the best schedule of the model: no rule played through it, nor the best
    # holds or pilot schedules, is shorter, and the relaxation's floor is shorter still
    eps = 1e-9
    for name in ("holds", "pilot", "paper", "bottleneck"):
        assert shares[name] <= shares["bound"] + eps, summed
    assert shares["bound"] <= shares["floor"] + eps, summed
    assert shares["paper"] <= shares["holds"] + eps, summed  # the paper's never waits: a holds schedule
    assert shares["sync"] == 0.0 and summed["best"] == "bound"
    rounds = summed["model_round_ms"]
    assert rounds["bound"] <= rounds["bottleneck"] and rounds["floor"] <= rounds["bound"]
    (run,) = summed["runs"]
    assert run["policy"] == "runahead/grouping=bottleneck" and run["step_of_best"] > 0
    assert "measured runahead/grouping=bottleneck:" in out
