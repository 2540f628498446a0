"""Where the compute unit idles in a run: every gap between two groups, by what the loop saw in it.

Reads a run's timeline (``runahead bench ... --timeline tl.json``: the Chrome-trace file, one per
point) and takes the compute unit's spans (each from a hand-off to the loop resuming with the
results, so the hand-offs are inside them) and the reads' landings as the event loop saw them. Each
gap between one group's end and the next group's start is one of:

- *waited for a read*: a read of the next group's layer landed in the gap. Its time splits into the
  wait until the last such landing and the turnaround from that landing to the group's start;
- *other reads landed*: reads landed in the gap, none of the next group's layer;
- *no read landed*: the next group's reads were in when the gap began; the gap is the loop's
  turnaround (its work between a result and the next hand-off), a hold of the grouping rule, or the
  step barrier.

The first ``--skip`` share of the groups (the cold start) is left out. On the sim (virtual time)
a group starts the instant its last read lands, so there the turnarounds are zero.

    runahead bench --backend torch --model medium --store host --link-gbps 3 --cache-fraction 0.7 \\
        --concurrency 4 --policy runahead/grouping=bottleneck --steps 32 --warmup-steps 8 --timeline tl.json
    python bench/idle_gaps.py tl.json
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Span:
    """One group on the compute unit: start and end (microseconds), its layer."""

    start: float
    end: float
    layer: int


@dataclass(frozen=True, slots=True)
class Landing:
    """One read as the loop saw it land: when (microseconds), and its layer."""

    at: float
    layer: int


@dataclass(slots=True)
class Gaps:
    """The compute unit's gaps in a window, by kind (microseconds each)."""

    window_us: float = 0.0
    busy_us: float = 0.0
    waited: list[float] = field(default_factory=list)  # a read of the next group's layer landed
    waiting: list[float] = field(default_factory=list)  # of those: until the last such landing
    after_landing: list[float] = field(default_factory=list)  # of those: that landing -> the start
    other_reads: list[float] = field(default_factory=list)
    no_read: list[float] = field(default_factory=list)


def classify(spans: Sequence[Span], landings: Sequence[Landing], skip: float = 0.2) -> Gaps:
    """The gaps between consecutive ``spans`` (sorted here) after the first ``skip`` share of them,
    each classified by the ``landings`` inside it."""
    spans = sorted(spans, key=lambda s: s.start)
    landings = sorted(landings, key=lambda r: r.at)
    times = [r.at for r in landings]
    kept = spans[int(skip * len(spans)) :]
    gaps = Gaps()
    if len(kept) < 2:
        return gaps
    gaps.window_us = kept[-1].end - kept[0].start
    gaps.busy_us = sum(s.end - s.start for s in kept)
    for done, following in itertools.pairwise(kept):
        gap = following.start - done.end
        if gap <= 0:
            continue
        inside = landings[bisect.bisect_left(times, done.end) : bisect.bisect_right(times, following.start)]
        same = [r.at for r in inside if r.layer == following.layer]
        if same:
            gaps.waited.append(gap)
            gaps.waiting.append(max(same) - done.end)
            gaps.after_landing.append(following.start - max(same))
        elif inside:
            gaps.other_reads.append(gap)
        else:
            gaps.no_read.append(gap)
    return gaps


def read_timeline(path: Path) -> tuple[list[Span], list[Landing]]:
    """The compute spans and read landings of a ``--timeline`` file."""
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans, landings = [], []
    for event in events:
        if event.get("ph") != "X":
            continue
        if event.get("cat") == "compute":
            spans.append(Span(event["ts"], event["ts"] + event["dur"], event["args"]["layer"]))
        elif event.get("cat") == "fetch":
            landings.append(Landing(event["ts"] + event["dur"], event["args"]["layer"]))
    return spans, landings


def report(gaps: Gaps) -> list[str]:
    """Printable lines: the busy share, then each kind's count, total and spread."""
    if not gaps.window_us:
        return ["fewer than two groups in the window"]
    idle = gaps.window_us - gaps.busy_us
    lines = [
        f"window {gaps.window_us / 1e3:.1f} ms: compute busy {gaps.busy_us / 1e3:.1f} ms "
        f"({100 * gaps.busy_us / gaps.window_us:.1f}%), idle {idle / 1e3:.1f} ms"
    ]
    kinds = [
        ("waited for a read", gaps.waited),
        ("  of it: until the landing", gaps.waiting),
        ("  of it: landing -> start", gaps.after_landing),
        ("other reads landed", gaps.other_reads),
        ("no read landed", gaps.no_read),
    ]
    for name, values in kinds:
        if values:
            lines.append(
                f"{name:28s} {len(values):6d} gaps {sum(values) / 1e3:8.1f} ms  "
                + spread([v / 1e6 for v in values])
            )
    return lines


def spread(values: Sequence[float]) -> str:
    """Median, mean and 90th percentile of ``values`` (seconds) in microseconds."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (
        f"median {statistics.median(ordered) * 1e6:6.0f} us, mean {statistics.fmean(ordered) * 1e6:6.0f}, "
        f"p90 {p90 * 1e6:6.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("timelines", nargs="+", type=Path, help="--timeline files of runahead bench")
    parser.add_argument("--skip", type=float, default=0.2, help="share of the groups left out at the start")
    args = parser.parse_args()
    for path in args.timelines:
        print(path)
        for line in report(classify(*read_timeline(path), skip=args.skip)):
            print("  " + line)


if __name__ == "__main__":
    main()
