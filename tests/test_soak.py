"""The soak's short version: one minute of concurrent streams, with hang-ups, against a real
``runahead serve`` process. Every completed answer equals transformers' greedy text, nothing
fails, memory stays flat after warm-up, and no request or pin is left behind.

The full soak (``python bench/soak.py``: 64 clients for 10 minutes) is a bench script whose
figures are in docs/results-server.md.
"""

from __future__ import annotations

from pathlib import Path

from benchhelpers import load_bench_script
from modelhelpers import build_tiny_model


def test_one_minute_soak(tmp_path: Path) -> None:
    soak = load_bench_script("soak")
    model = build_tiny_model("qwen3_moe", tmp_path / "model", num_experts=16)
    result = soak.run(str(model), minutes=1.0, clients=16, drop=0.2, seed=0, cache_fraction=0.3)
    assert result.errors == 0, result.error_samples
    assert result.mismatches == result.near_ties, result.error_samples  # differ only at near ties
    assert result.completed >= 50 and result.dropped >= 5
    assert result.final_active == 0 and result.final_pinned == 0
    assert result.server_errors == 0  # no traceback in the server's log (a client leaving is no error)
    assert result.rss_growth_after_warmup < 0.05, result.rss_mib
