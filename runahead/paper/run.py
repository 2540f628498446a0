"""``run_paper``: the paper's evaluation, figure by figure, from one call (and the timeline view)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from runahead.bench import BenchPoint, run_point
from runahead.paper.figures import DRAW
from runahead.paper.runner import Progress, point_key, print_progress, run_points
from runahead.paper.settings import FULL, QUICK, TINY, Settings, figure_points
from runahead.paper.summary import headline


def settings_for(*, quick: bool = False, tiny: bool = False) -> Settings:
    """The settings a run uses: ``tiny`` (tests) over ``quick`` over the full set."""
    return TINY if tiny else QUICK if quick else FULL


def run_paper(
    out: Path,
    *,
    quick: bool = False,
    workers: int = 2,
    resume: bool = True,
    progress: bool | Progress = True,
    tiny: bool = False,
    settings: Settings | None = None,
    charge_overhead: bool = False,
    charge_scale: float = 1.0,
) -> list[Path]:
    """Regenerate every paper figure on the sim backend into ``out``; return the files written.

    For each figure ``NAME`` (see :data:`runahead.paper.settings.FIGURES`): ``NAME.png`` and
    ``NAME.jsonl`` (the rows behind it). Also ``rows.jsonl`` (every measured point, keyed: a rerun
    with ``resume`` skips the points already there), ``summary.json`` (the headline numbers),
    ``manifest.json`` (settings, points computed and reused, wall time) and, for one representative
    point, ``timeline/<policy>.json`` (Chrome trace) and ``timeline/<policy>.png`` for sync and
    runahead. ``quick`` runs one profile and model with short runs (minutes); ``tiny`` is for tests
    (seconds). ``workers`` processes measure points in parallel; ``progress`` prints a line per
    point (or is a callback). ``charge_overhead``: every bench point charges the runtime's own CPU
    time to virtual time (its rows are stored apart from the uncharged ones), ``charge_scale`` times
    it (a host whose cores run the runtime that many times slower; stored apart again).
    """
    started = time.perf_counter()
    s = settings if settings is not None else settings_for(quick=quick, tiny=tiny)
    if charge_overhead or charge_scale != 1.0:  # a scale without the charge: BenchPoint refuses it
        s = replace(s, charge_overhead=charge_overhead or s.charge_overhead, charge_scale=charge_scale)
    figures = figure_points(s)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = print_progress(started) if progress is True else progress or None
    result = run_points(
        (p for points in figures.values() for p in points),
        out / "rows.jsonl",
        workers=workers,
        resume=resume,
        progress=report,
    )
    written: list[Path] = []
    rows_of: dict[str, list[dict[str, Any]]] = {}
    drawings: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []  # what is left: in parallel
    if s.timeline is not None:  # the two longest first
        timelines = out / "timeline"
        timelines.mkdir(parents=True, exist_ok=True)
        drawings += [(write_timeline, (timelines, s, policy)) for policy in TIMELINE_POLICIES]
    for name, points in figures.items():
        rows = [result.rows[point_key(p)] for p in dict.fromkeys(points)]
        rows_of[name] = rows
        jsonl = out / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
        png = out / f"{name}.png"
        drawings.append((DRAW[name], (rows, png)))
        written += [png, jsonl]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for done in [pool.submit(draw, *args) for draw, args in drawings]:
                written += done.result() or []
    else:
        for draw, args in drawings:
            written += draw(*args) or []
    summary = out / "summary.json"
    summary.write_text(json.dumps(headline(rows_of), indent=1) + "\n")
    manifest = out / "manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "settings": asdict(s),
                "points": len(result.rows),
                "computed": result.computed,
                "reused": result.reused,
                "workers": workers,
                "wall_s": time.perf_counter() - started,
            },
            indent=1,
        )
        + "\n"
    )
    return [*written, summary, manifest]


TIMELINE_POLICIES = ("sync", "runahead")
"""The policies whose timelines ``run_paper`` writes for the representative point."""


def write_timeline(folder: Path, s: Settings, policy: str) -> list[Path]:
    """Chrome trace and PNG window of the representative point under ``policy``, into ``folder``."""
    from runahead.timeline import render_png, write_chrome_trace

    assert s.timeline is not None
    profile, model, workload = s.timeline
    point = BenchPoint(
        model,
        profile,
        policy,
        s.main_concurrency,
        s.main_cache,
        s.timeline_steps,
        workload,
        s.seed,
        warmup_steps=s.warmup_steps,
        prefill_chunk=s.prefill_chunk,
    )
    captured: list[Any] = []
    row = run_point(replace(point), timeline=captured.append)
    recorder = captured[0].recorder
    name = policy.replace("/", "_")
    trace, png = folder / f"{name}.json", folder / f"{name}.png"
    write_chrome_trace(recorder, trace, name=f"{policy} {profile} {model} x{s.main_concurrency}")
    render_png(
        recorder,
        png,
        title=f"{policy}: {model} on {profile}, {s.main_concurrency} {workload} requests, "
        f"{s.main_cache:.0%} cache ({row['tokens_per_s']:.1f} tok/s)",
    )
    return [trace, png]
