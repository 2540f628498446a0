"""``bench/idle_gaps.py``: the compute unit's gaps in a run's timeline, by what landed in them."""

from __future__ import annotations

from pathlib import Path

import pytest

from runahead.cli import main as cli

from benchhelpers import load_bench_script


def test_each_gap_is_classified_by_the_reads_that_landed_in_it() -> None:
    script = load_bench_script("idle_gaps")
    Span, Landing = script.Span, script.Landing
    spans = [Span(0, 10, 0), Span(14, 20, 1), Span(21, 30, 2), Span(35, 40, 3), Span(40, 45, 3)]
    landings = [
        Landing(12, 1),  # in the first gap, the next group's layer: waited 2, then 2 to its start
        Landing(33, 0),  # in the third gap, another layer's read
        Landing(50, 3),  # after the last group: in no gap
    ]
    gaps = script.classify(spans, landings, skip=0.0)
    assert gaps.window_us == 45 and gaps.busy_us == 10 + 6 + 9 + 5 + 5
    assert gaps.waited == [4] and gaps.waiting == [2] and gaps.after_landing == [2]
    assert gaps.no_read == [1]  # 20 -> 21: nothing landed
    assert gaps.other_reads == [5]  # 30 -> 35: a layer-0 read only
    # back-to-back groups (40 -> 40) are no gap; the first share of the groups can be left out
    assert script.classify(spans, landings, skip=0.4).waited == []
    assert script.report(script.classify(spans[:1], landings)) == ["fewer than two groups in the window"]


def test_on_the_sim_sync_groups_start_the_instant_their_last_read_lands(tmp_path: Path) -> None:
    """A real timeline through ``runahead bench --timeline``: on virtual time the loop's turnaround
    is zero, so every gap of sync's run waited for a read of its layer and none is left after it."""
    timeline = tmp_path / "tl.json"
    code = cli(
        ["bench", "--profile", "thor", "--model", "qwen3.6-35b-a3b", "--policy", "sync", "--concurrency", "4",
         "--cache-fraction", "0.3", "--steps", "8", "--timeline", str(timeline), "--quiet",
         "--out", str(tmp_path / "rows")]
    )  # fmt: skip
    assert code in (0, None)
    script = load_bench_script("idle_gaps")
    gaps = script.classify(*script.read_timeline(timeline))
    assert 0 < gaps.busy_us < gaps.window_us
    assert len(gaps.waited) > 10 and not gaps.no_read and not gaps.other_reads
    assert max(gaps.after_landing) == pytest.approx(0, abs=1e-3)
    assert sum(gaps.waited) == pytest.approx(gaps.window_us - gaps.busy_us)
