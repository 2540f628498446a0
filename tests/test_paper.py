"""The paper-figures command on tiny settings: every file, sane rows, resume, parallel == serial."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from runahead.paper import FIGURES, TINY, figure_points, run_paper, runner
from runahead.paper.precision import replay_precision
from runahead.specs import load_model_spec
from runahead.synthetic import default_trace
from runahead.trace import RoutingTrace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("paper")
    run_paper(out, tiny=True, workers=1, progress=False)
    return out


def test_every_figure_file_is_written(tiny_run: Path) -> None:
    for name in FIGURES:
        assert (tiny_run / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        rows = _rows(tiny_run / f"{name}.jsonl")
        assert len(rows) == len(dict.fromkeys(figure_points(TINY)[name]))
    for policy in ("sync", "runahead"):
        assert (tiny_run / "timeline" / f"{policy}.png").read_bytes()[:8] == PNG_MAGIC
        assert json.loads((tiny_run / "timeline" / f"{policy}.json").read_text())["traceEvents"]
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert set(summary) == set(FIGURES)


def test_precision_rows_cover_every_cache(tiny_run: Path) -> None:
    rows = _rows(tiny_run / "fig1_precision.jsonl")
    assert {r["cache"] for r in rows} == {"none", "lru", "lfu", "random"}


def test_precision_counts_match_a_hand_worked_trace() -> None:
    selections = [[[0, 1], [2, 3], [0, 2]], [[1, 2], [2, 3], [1, 3]]]
    predictions = [[[0, 1], [2, 0], [3, 1]], [[1, 2], [1, 3], [1, 3]]]
    trace = RoutingTrace.from_selections([selections], 4, [predictions])
    counts = replay_precision(trace, "none", 0.0)
    # layers 1 and 2 of both steps predict 2 experts each; right: 1, 0, 1 and 2 of them
    assert (counts["prefetched"], counts["useful"], counts["precision"]) == (8, 4, 0.5)
    assert (counts["needed"], counts["held"]) == (12, 0)


def test_more_cache_never_means_more_sync_fetches(tiny_run: Path) -> None:
    rows = [r for r in _rows(tiny_run / "fig3_throughput_cache.jsonl") if r["policy"] == "sync"]
    rows = [r for r in rows if r["workload"] == "chat"]
    assert len(rows) == len(TINY.cache_fractions)
    fetches = [r["fetches"] for r in sorted(rows, key=lambda r: r["cache_fraction"])]
    assert all(a >= b for a, b in itertools.pairwise(fetches)), fetches


def test_breakdown_parts_are_never_negative(tiny_run: Path) -> None:
    """Each part is a difference of measured busy times: a negative one means busy time counted
    twice (overlapping reads summed instead of merged, say)."""
    rows = _rows(tiny_run / "fig4_breakdown.jsonl")
    assert {r["workload"] for r in rows} == {"chat", "agentic"}
    for row in rows:
        parts = ("overlap_fraction", "compute_only_fraction", "link_only_fraction", "idle_fraction")
        assert all(row[p] >= -1e-12 for p in parts), row
        assert row["tokens_per_s"] > 0
        assert row["overlap_fraction"] == 0.0 or row["policy"] != "sync"


def test_agentic_rows_measure_a_closed_loop_window(tiny_run: Path) -> None:
    rows = [r for r in _rows(tiny_run / "fig2_throughput_concurrency.jsonl") if r["workload"] == "agentic"]
    assert rows
    for row in rows:
        assert row["prefill_tokens"] > 0 and row["requests"] >= row["concurrency"]
        assert 0 < row["window_start_s"] < row["window_end_s"]


def test_resume_skips_finished_points(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert json.loads((tiny_run / "manifest.json").read_text())["computed"] > 0
    lines = (tiny_run / "rows.jsonl").read_text().splitlines(keepends=True)
    kept = len(lines) - 5
    (tmp_path / "rows.jsonl").write_text("".join(lines[:kept]) + lines[kept][:20])  # a torn last line
    calls: list[runner.Point] = []
    real = runner.run_task

    def counting(point: runner.Point) -> dict[str, Any]:
        calls.append(point)
        return real(point)

    monkeypatch.setattr(runner, "run_task", counting)
    run_paper(tmp_path, tiny=True, workers=1, progress=False)
    assert len(calls) == 5
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (manifest["computed"], manifest["reused"]) == (5, len(lines) - 5)
    calls.clear()
    run_paper(tmp_path, tiny=True, workers=1, progress=False)
    assert calls == []


def test_parallel_rows_equal_serial_rows(tmp_path: Path) -> None:
    points = figure_points(TINY)["fig2_throughput_concurrency"][:6]
    serial = runner.run_points(points, tmp_path / "serial.jsonl", workers=1)
    parallel = runner.run_points(points, tmp_path / "parallel.jsonl", workers=2)
    assert serial.computed == parallel.computed == 6
    keys = sorted(serial.rows)
    assert keys == sorted(parallel.rows)
    assert runner.comparable([serial.rows[k] for k in keys]) == runner.comparable(
        [parallel.rows[k] for k in keys]
    )


def test_randomized_cache_keeps_the_hold_fraction_and_loses_less_precision() -> None:
    trace = default_trace(load_model_spec("olmoe-1b-7b"), 2, 40, 0)
    none = replay_precision(trace, "none", 0.0, warmup_steps=4)
    lfu = replay_precision(trace, "lfu", 0.3, warmup_steps=4)
    rand = replay_precision(trace, "random", 0.3, warmup_steps=4)
    assert lfu["hold_fraction"] == rand["hold_fraction"]
    assert lfu["precision"] < rand["precision"] < none["precision"]
