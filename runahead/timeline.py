"""Timelines of a run: a Chrome-trace / Perfetto JSON export and a PNG of a short window.

Both read a finished run's :class:`~runahead.metrics.Recorder` (``runtime.recorder``) and nothing
else, so they work the same for the ``sim`` backend on virtual time and for real hardware::

    write_chrome_trace(runtime.recorder, "run.json")  # open in https://ui.perfetto.dev
    render_png(runtime.recorder, "run.png")  # the middle of the run, compute vs link

Tracks (Chrome-trace threads of one process):

- ``compute``: one complete event per group, named ``L12 x4`` (layer 12, 4 jobs); the entry job of
  a token (layer :data:`~runahead.jobs.ENTRY_LAYER`) is named ``entry x4``.
- ``link 0``, ``link 1``, ...: one complete event per read, named ``L3/E17``. Reads overlap (the
  link has several in flight), so each read goes to the lowest-numbered lane that is free when it
  starts; there are exactly as many lanes as the most reads ever in flight at once. Prefetches have
  category ``prefetch``, reads that a blocked job needs have category ``fetch``.
- ``request N``: one complete event per job of that request (copied from its group's record) and one
  instant event per generated token.

Timestamps are microseconds on the run's clock (``seconds * 1e6``, not rounded or shifted), so an
event's ``ts`` and ``ts + dur`` are its record's ``start`` and ``end`` (to float rounding).
matplotlib is needed only by :func:`render_png` and is imported there, never at module import.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runahead.jobs import ENTRY_LAYER
from runahead.metrics import (
    ComputeRecord,
    FetchRecord,
    Interval,
    Recorder,
    clip,
    intersection_total,
    total,
    union,
)

US_PER_S = 1e6
PID = 1
COMPUTE_TID = 0
LINK_TID_BASE = 1
"""Link lane ``i`` is thread ``LINK_TID_BASE + i``; request tracks follow the last lane."""

FETCH_COLOR = "#6c8ebf"
PREFETCH_COLOR = "#f4a259"
PREFETCH_EDGE = "#7a3e00"
TOKEN_COLOR = "#d62728"

DEFAULT_WINDOW_FRACTION = 0.05
"""The default PNG window: this fraction of the run, around its middle ..."""
DEFAULT_WINDOW_STEPS = 3
"""... but never fewer than this many decode steps' worth of time."""


def group_name(layer: int, size: int) -> str:
    """Display name of a compute group: ``L12 x4``, or ``entry x4`` for a token's entry jobs."""
    return f"{'entry' if layer == ENTRY_LAYER else f'L{layer}'} x{size}"


def fetch_name(record: FetchRecord) -> str:
    """Display name of a read: ``L3/E17`` (layer 3, expert 17)."""
    return f"L{record.key.layer}/E{record.key.expert}"


def link_lanes(fetches: Sequence[FetchRecord]) -> list[int]:
    """The link lane of every read, in the order of ``fetches``.

    Called by both exporters. Reads are taken by start time (ties: end, then position) and each goes
    to the lowest-numbered lane whose last read has ended by its start (a read ending exactly when
    another starts shares its lane). This first-fit uses exactly as many lanes as the most reads in
    flight at one instant, and two reads on one lane never overlap.
    """
    order = sorted(range(len(fetches)), key=lambda i: (fetches[i].start, fetches[i].end, i))
    lane_free_at: list[float] = []
    lanes = [0] * len(fetches)
    for i in order:
        record = fetches[i]
        lane = next(
            (lane for lane, free_at in enumerate(lane_free_at) if free_at <= record.start),
            len(lane_free_at),
        )
        if lane == len(lane_free_at):
            lane_free_at.append(record.end)
        lane_free_at[lane] = record.end
        lanes[i] = lane
    return lanes


def request_ids(recorder: Recorder) -> list[int]:
    """Every request that computed or produced a token in the run, sorted."""
    ids = {request for record in recorder.computes for request in record.requests}
    ids.update(request for request, _, _ in recorder.tokens)
    return sorted(ids)


def _us(seconds: float) -> float:
    return seconds * US_PER_S


def _complete(
    name: str, cat: str, tid: int, start: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    ts = _us(start)
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": PID,
        "tid": tid,
        "ts": ts,
        "dur": _us(end) - ts,
        "args": args,
    }


def _metadata(kind: str, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"name": kind, "ph": "M", "pid": PID, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _compute_args(record: ComputeRecord) -> dict[str, Any]:
    return {"layer": record.layer, "size": record.size, "requests": list(record.requests)}


def to_chrome_trace(recorder: Recorder, *, name: str = "runahead") -> dict[str, Any]:
    """The run as a Chrome-trace / Perfetto JSON object (see the module docstring for the tracks).

    Call it after a run has finished (e.g. on ``runtime.recorder``); it only reads the recorder and
    gives the same output for the same records. Returns ``{"traceEvents": [...],
    "displayTimeUnit": "ms"}``: the track-naming metadata events (``"M"``) first, then every track's
    events in time order: one ``"X"`` per compute group, per read and per (request, job), and one
    ``"i"`` per token. ``name`` labels the process.
    """
    lanes = link_lanes(recorder.fetches)
    num_lanes = max(lanes, default=-1) + 1
    requests = request_ids(recorder)
    request_tid = {request: LINK_TID_BASE + num_lanes + i for i, request in enumerate(requests)}

    tracks = [(COMPUTE_TID, "compute")]
    tracks += [(LINK_TID_BASE + lane, f"link {lane}") for lane in range(num_lanes)]
    tracks += [(request_tid[request], f"request {request}") for request in requests]
    meta = [_metadata("process_name", None, {"name": name})]
    for order, (tid, label) in enumerate(tracks):
        meta.append(_metadata("thread_name", tid, {"name": label}))
        meta.append(_metadata("thread_sort_index", tid, {"sort_index": order}))

    events: list[dict[str, Any]] = []
    for group in recorder.computes:
        args = _compute_args(group)
        events.append(
            _complete(group_name(group.layer, group.size), "compute", COMPUTE_TID, *_span(group), args)
        )
        job = "entry" if group.layer == ENTRY_LAYER else f"L{group.layer}"
        for request in group.requests:
            events.append(_complete(job, "job", request_tid[request], *_span(group), dict(args)))
    for record, lane in zip(recorder.fetches, lanes, strict=True):
        args = {
            "layer": record.key.layer,
            "expert": record.key.expert,
            "prefetch": record.prefetch,
            "lane": lane,
        }
        category = "prefetch" if record.prefetch else "fetch"
        events.append(_complete(fetch_name(record), category, LINK_TID_BASE + lane, *_span(record), args))
    for request, step, time in recorder.tokens:
        events.append(
            {
                "name": f"token {step}",
                "cat": "token",
                "ph": "i",
                "s": "t",
                "pid": PID,
                "tid": request_tid[request],
                "ts": _us(time),
                "args": {"request": request, "step": step},
            }
        )
    # Stable sort: records of equal time keep the order the actors appended them in.
    events.sort(key=lambda event: (event["tid"], event["ts"]))
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def _span(record: ComputeRecord | FetchRecord) -> tuple[float, float]:
    return record.start, record.end


def write_chrome_trace(recorder: Recorder, path: str | os.PathLike[str], *, name: str = "runahead") -> None:
    """Write :func:`to_chrome_trace` of a finished run to ``path`` as JSON (open it in Perfetto)."""
    with open(path, "w", encoding="utf-8") as sink:
        json.dump(to_chrome_trace(recorder, name=name), sink)


def run_span(recorder: Recorder) -> Interval:
    """First start to last end (or token) of any record: the run's extent in seconds."""
    starts = [c.start for c in recorder.computes] + [f.start for f in recorder.fetches]
    ends = [c.end for c in recorder.computes] + [f.end for f in recorder.fetches]
    ends += [time for _, _, time in recorder.tokens]
    if not starts:
        raise ValueError("the recorder holds no compute or fetch records")
    return min(starts), max(ends)


def default_window(recorder: Recorder) -> Interval:
    """The window :func:`render_png` draws when given none: the middle of the run.

    Its width is :data:`DEFAULT_WINDOW_FRACTION` of the run, widened to at least
    :data:`DEFAULT_WINDOW_STEPS` mean decode steps (run time / most tokens of one request), and
    never wider than the run.
    """
    first, last = run_span(recorder)
    span = last - first
    per_request: dict[int, int] = {}
    for request, _, _ in recorder.tokens:
        per_request[request] = per_request.get(request, 0) + 1
    steps = max(per_request.values(), default=1)
    width = min(span, max(DEFAULT_WINDOW_FRACTION * span, DEFAULT_WINDOW_STEPS * span / steps))
    middle = first + span / 2
    start = max(first, middle - width / 2)
    return start, min(last, start + width)


def window_overlap(recorder: Recorder, start: float, end: float) -> tuple[float, float, float]:
    """Fractions of ``[start, end]`` with the compute unit busy, the link busy, and both busy."""
    width = end - start
    if width <= 0:
        return 0.0, 0.0, 0.0
    compute = clip(union([(c.start, c.end) for c in recorder.computes]), start, end)
    link = clip(union([(f.start, f.end) for f in recorder.fetches]), start, end)
    return total(compute) / width, total(link) / width, intersection_total(compute, link) / width


def render_png(
    recorder: Recorder,
    path: str | os.PathLike[str],
    *,
    start: float | None = None,
    end: float | None = None,
    max_requests: int = 16,
    title: str | None = None,
) -> None:
    """Draw a short window of a finished run as a PNG at ``path`` (12 x 6 inches, 120 dpi).

    Rows, top to bottom: the compute unit (bars colored by layer, labelled with the group size where
    wide enough), one row per link lane (demand reads plain, prefetches hatched), and one row per
    request (when its jobs computed, colored by layer; ``|`` marks a token), at most
    ``max_requests`` of those that computed in the window. ``start``/``end`` are seconds on the
    run's clock; a missing bound comes from :func:`default_window`'s width. The x axis is ms from
    the window's start; the title gives the compute-busy, link-busy and both-busy fractions of the
    window. Uses matplotlib's Agg canvas directly: no pyplot, no global backend or rcParams change.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    if start is None or end is None:
        lo, hi = default_window(recorder)
        if start is None and end is None:
            start, end = lo, hi
        elif start is None:
            assert end is not None
            start = end - (hi - lo)
        else:
            end = start + (hi - lo)
    if not end > start:
        raise ValueError(f"the window must have end > start, got [{start}, {end}]")
    width_s = end - start

    def ms(t: float) -> float:
        return (t - start) * 1e3

    def inside(a: float, b: float) -> bool:
        return b > start and a < end

    lanes = link_lanes(recorder.fetches)
    num_lanes = max(lanes, default=-1) + 1
    active = sorted(
        {r for c in recorder.computes if inside(c.start, c.end) for r in c.requests}
        | {r for r, _, t in recorder.tokens if start <= t <= end}
    )
    shown, hidden = active[: max(0, max_requests)], max(0, len(active) - max(0, max_requests))
    labels = ["compute", *(f"link {lane}" for lane in range(num_lanes)), *(f"req {r}" for r in shown)]
    row = {label: len(labels) - 1 - i for i, label in enumerate(labels)}  # compute on top

    layers = [c.layer for c in recorder.computes] + [f.key.layer for f in recorder.fetches]
    norm = Normalize(
        vmin=min(layers, default=0), vmax=max(max(layers, default=1), min(layers, default=0) + 1)
    )
    colormap = colormaps["viridis"]
    mappable = ScalarMappable(norm=norm, cmap=colormap)

    figure = Figure(figsize=(12, 6), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    height = 0.8
    label_min_ms = width_s * 1e3 / 60  # label a bar only when it is wider than 1/60 of the window
    edge_min_ms = width_s * 1e3 / 400  # outline a bar only when the outline cannot hide its color

    # One collection per (row, style): thousands of reads draw in one call, not thousands.
    bars: dict[tuple[str, str], list[tuple[float, float, Any]]] = defaultdict(list)

    def add(label: str, kind: str, a: float, b: float, color: Any) -> None:
        x0, x1 = ms(max(a, start)), ms(min(b, end))
        bars[label, kind].append((x0, x1 - x0, color))

    for c in recorder.computes:
        if not inside(c.start, c.end):
            continue
        color = colormap(norm(c.layer))
        add("compute", "compute", c.start, c.end, color)
        x0, x1 = ms(max(c.start, start)), ms(min(c.end, end))
        if x1 - x0 >= label_min_ms:
            axes.text(
                (x0 + x1) / 2,
                row["compute"],
                f"x{c.size}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if norm(c.layer) < 0.6 else "black",
            )
        for r in c.requests:
            if f"req {r}" in row:
                add(f"req {r}", "job", c.start, c.end, color)
    for f, lane in zip(recorder.fetches, lanes, strict=True):
        if inside(f.start, f.end):
            kind = "prefetch" if f.prefetch else "fetch"
            add(f"link {lane}", kind, f.start, f.end, PREFETCH_COLOR if f.prefetch else FETCH_COLOR)
    for (label, kind), spans in sorted(bars.items()):
        outline = {"job": "none", "prefetch": PREFETCH_EDGE}.get(kind, "black")
        axes.broken_barh(
            [(x, w) for x, w, _ in spans],
            (row[label] - height / 2, height),
            facecolors=[color for _, _, color in spans],
            edgecolors=outline,
            linewidths=[0.4 if w >= edge_min_ms else 0.0 for _, w, _ in spans],
            hatch="////" if kind == "prefetch" else None,
        )
    ticks = [
        (ms(t), row[f"req {r}"]) for r, _, t in recorder.tokens if start <= t <= end and f"req {r}" in row
    ]
    axes.vlines(
        [x for x, _ in ticks],
        [y - 0.48 for _, y in ticks],
        [y + 0.48 for _, y in ticks],
        colors=TOKEN_COLOR,
        linewidths=2.0,
        zorder=3,
    )

    axes.set_yticks(range(len(labels)), labels=labels[::-1], fontsize=8)
    axes.set_ylim(-0.6, len(labels) - 0.4)
    axes.set_xlim(0.0, width_s * 1e3)
    axes.set_xlabel(f"ms from t = {start * 1e3:.3f} ms on the run's clock")
    axes.grid(axis="x", alpha=0.3)
    if num_lanes:
        axes.axhline(row["compute"] - 0.5, color="gray", linewidth=0.6)
    if shown:
        axes.axhline(
            row[f"link {num_lanes - 1}" if num_lanes else "compute"] - 0.5, color="gray", linewidth=0.6
        )
    busy_compute, busy_link, both = window_overlap(recorder, start, end)
    more = f" (+{hidden} more requests not shown)" if hidden else ""
    axes.set_title(
        f"{title + ': ' if title else ''}{width_s * 1e3:.2f} ms window: compute busy {busy_compute:.0%}, "
        f"link busy {busy_link:.0%}, both busy (overlap) {both:.0%}{more}",
        fontsize=10,
    )
    axes.legend(
        handles=[
            Patch(facecolor=FETCH_COLOR, edgecolor="black", label="read (a blocked job needs it)"),
            Patch(facecolor=PREFETCH_COLOR, hatch="////", edgecolor=PREFETCH_EDGE, label="prefetch"),
            Line2D([], [], color=TOKEN_COLOR, linewidth=2.0, label="token done"),
        ],
        loc="upper right",
        bbox_to_anchor=(1.0, -0.08),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    colorbar = figure.colorbar(mappable, ax=axes, pad=0.01, fraction=0.03)
    colorbar.set_label(f"layer of the compute group ({ENTRY_LAYER} = entry)", fontsize=8)
    colorbar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    colorbar.ax.tick_params(labelsize=7)
    figure.tight_layout()
    figure.savefig(os.fspath(path), format="png")


def numbered_paths(path: str | Path, count: int) -> list[Path]:
    """Where the timelines of ``count`` runs go: ``path`` itself for one, ``stem-<i>.json`` for several."""
    path = Path(path)
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix or '.json'}") for i in range(count)]
