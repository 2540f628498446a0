"""Run many independent points in parallel worker processes, resumably.

Rows go to one JSONL store as each point finishes, each keyed by its point (``point_key``); a
rerun reads the store and skips every point already in it, so an interrupted sweep resumes where
it stopped and figures that share points measure them once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runahead.bench import BenchPoint, run_point
from runahead.paper.precision import run_precision_point
from runahead.paper.settings import PrecisionPoint

Point = BenchPoint | PrecisionPoint
Row = dict[str, Any]
Progress = Callable[[int, int, Point, Row], None]

TIMING_FIELDS = frozenset(
    {"wall_s", "cpu_s", "overhead_us_per_job", "overhead_us_per_group", "overhead_us_per_read", "host_cpu"}
)
"""Row fields measured on (or naming) the host: they differ between runs and machines; every other
field is deterministic."""


def point_key(point: Point) -> str:
    """The key a row is stored under: the point's kind and every field, as canonical JSON."""
    fields = asdict(point)
    if fields.get("charge_overhead") is False:
        del fields["charge_overhead"]  # added later: keys of rows stored before it stay valid
    if "workload_file" in fields and fields["workload_file"] is None:
        del fields["workload_file"]  # likewise
    if fields.get("preload") is False:
        del fields["preload"]  # likewise
    if fields.get("charge_scale") == 1.0:
        del fields["charge_scale"]  # likewise
    return json.dumps({"kind": type(point).__name__, **fields}, sort_keys=True)


def run_task(point: Point) -> Row:
    """Measure one point (a bench point on the sim backend, or a precision replay); return its row."""
    row = run_precision_point(point) if isinstance(point, PrecisionPoint) else run_point(point)
    return {"point_key": point_key(point), **row}


def cost(point: Point) -> float:
    """A rough relative cost, to start the longest points first (better load balance)."""
    if isinstance(point, PrecisionPoint):
        return 0.01 * point.requests * point.steps
    heavy = 3.5 if point.workload == "agentic" else 1.0
    return heavy * point.concurrency * point.steps


def load_rows(store: Path) -> dict[str, Row]:
    """The rows in ``store`` by key (a torn last line, from an interrupted write, is ignored)."""
    rows: dict[str, Row] = {}
    if not store.exists():
        return rows
    with store.open() as lines:
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "point_key" in row:
                rows[row["point_key"]] = row
    return rows


@dataclass(slots=True)
class SweepResult:
    """Rows of every requested point by key; ``computed`` of them were measured in this call."""

    rows: dict[str, Row]
    computed: int
    reused: int


def run_points(
    points: Iterable[Point],
    store: Path,
    *,
    workers: int = 2,
    resume: bool = True,
    progress: Progress | None = None,
) -> SweepResult:
    """Measure every distinct point of ``points`` not yet in ``store``, ``workers`` processes at a time.

    With ``resume=False`` the store is started afresh. Rows are appended (and flushed) as points
    finish, in completion order; ``workers <= 1`` runs in this process, in order.
    """
    unique: dict[str, Point] = {}
    for point in points:
        unique.setdefault(point_key(point), point)
    store.parent.mkdir(parents=True, exist_ok=True)
    if not resume and store.exists():
        store.unlink()
    done = load_rows(store)
    store.write_text("".join(json.dumps(row) + "\n" for row in done.values()))  # drop a torn line
    todo = sorted((p for k, p in unique.items() if k not in done), key=cost, reverse=True)
    reused = len(unique) - len(todo)
    with store.open("a") as sink:

        def finished(index: int, point: Point, row: Row) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            done[row["point_key"]] = row
            if progress is not None:
                progress(index, len(todo), point, row)

        if workers <= 1 or len(todo) <= 1:
            for index, point in enumerate(todo, 1):
                finished(index, point, run_task(point))
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                futures: dict[Future[Row], Point] = {pool.submit(run_task, p): p for p in todo}
                for index, future in enumerate(as_completed(futures), 1):
                    finished(index, futures[future], future.result())
    return SweepResult({k: done[k] for k in unique}, len(todo), reused)


def describe(point: Point) -> str:
    """A short label of a point for progress lines."""
    if isinstance(point, PrecisionPoint):
        return f"precision {point.model} {point.cache} cache={point.cache_fraction:.0%}"
    barrier = "" if point.step_barrier else " no-barrier"
    return (
        f"{point.profile} {point.model} {point.workload} {point.policy} x{point.concurrency} "
        f"cache={point.cache_fraction:.0%}{barrier}"
    )


def print_progress(started: float | None = None) -> Progress:
    """A progress callback printing one line per finished point to stderr."""
    origin = time.perf_counter() if started is None else started

    def report(index: int, count: int, point: Point, row: Row) -> None:
        elapsed = time.perf_counter() - origin
        if "tokens_per_s" in row:
            result = f"{row['tokens_per_s']:8.1f} tok/s"
        else:
            result = f"precision {row['precision']:.3f}"
        print(
            f"[{index:>{len(str(count))}}/{count}] {elapsed:6.1f}s  {describe(point)}: {result} "
            f"({row.get('wall_s', 0.0):.1f}s)",
            file=sys.stderr,
            flush=True,
        )

    return report


def comparable(rows: Sequence[Row]) -> list[Row]:
    """Rows without the host-timing fields, for comparing two runs of the same points."""
    return [{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in rows]


def default_workers() -> int:
    """Worker processes to use when not told: the CPUs this process may use (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)
