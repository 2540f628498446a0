"""The timeline exports: Chrome-trace JSON structure and exact times, and the PNG renderer."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from runahead.backends.sim import FixedCosts
from runahead.jobs import RequestSpec
from runahead.metrics import Recorder
from runahead.runtime import Runtime
from runahead.timeline import (
    COMPUTE_TID,
    default_window,
    link_lanes,
    render_png,
    to_chrome_trace,
    write_chrome_trace,
)
from runahead.trace import RoutingTrace

from simhelpers import random_trace, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The hand-computed case of tests/test_timeline.py (times worked out there).
HAND_COSTS = FixedCosts(group_s=0.001, per_expert_s=0.0002, transfer_s=0.0005, latency_s=0.0)
HAND_TRACE = RoutingTrace.from_selections([[[[0], [0]]], [[[1], [1]]]], num_experts=2)
HAND_REQUESTS = [RequestSpec(0, max_tokens=1), RequestSpec(1, max_tokens=1)]


def hand_run() -> Runtime:
    return simulate(
        HAND_TRACE,
        policy="runahead/grouping=opportunistic",
        slots=2,
        requests=HAND_REQUESTS,
        costs=HAND_COSTS,
    )


@pytest.fixture(scope="module")
def random_run() -> Runtime:
    """4 requests x 12 tokens, 4 layers, top-2 of 8 experts, a tight cache, with prefetching."""
    trace = random_trace(requests=4, steps=12, layers=4, experts=8, top_k=2, seed=3)
    requests = [RequestSpec(r, max_tokens=12) for r in range(4)]
    return simulate(trace, policy="runahead+prefetch", slots=12, requests=requests, link_queue_depth=3)


def thread_names(trace: dict[str, Any]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def events(trace: dict[str, Any], phase: str, cat: str | None = None) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == phase and (cat is None or e.get("cat") == cat)]


def test_event_counts_and_tracks_match_the_records(random_run: Runtime) -> None:
    recorder = random_run.recorder
    trace = to_chrome_trace(recorder, name="random")
    assert trace["displayTimeUnit"] == "ms"
    names = thread_names(trace)
    assert names[COMPUTE_TID] == "compute"

    computes = events(trace, "X", "compute")
    assert len(computes) == len(recorder.computes)
    assert {e["tid"] for e in computes} == {COMPUTE_TID}
    for event, record in zip(computes, recorder.computes, strict=True):
        assert event["args"] == {
            "layer": record.layer,
            "size": record.size,
            "requests": list(record.requests),
        }

    reads = events(trace, "X", "fetch") + events(trace, "X", "prefetch")
    assert len(reads) == len(recorder.fetches)
    prefetches = sum(record.prefetch for record in recorder.fetches)
    assert 0 < prefetches < len(recorder.fetches)  # the case exercises both categories
    assert len(events(trace, "X", "prefetch")) == prefetches
    assert all(e["args"]["prefetch"] == (e["cat"] == "prefetch") for e in reads)
    assert all(names[e["tid"]] == f"link {e['args']['lane']}" for e in reads)

    jobs = events(trace, "X", "job")
    assert len(jobs) == sum(record.size for record in recorder.computes)
    tokens = events(trace, "i")
    assert len(tokens) == len(recorder.tokens) == 4 * 12
    for event in jobs + tokens:
        assert names[event["tid"]].startswith("request ")
    for request in range(4):
        tid = next(tid for tid, name in names.items() if name == f"request {request}")
        assert sum(e["tid"] == tid for e in tokens) == 12
    assert {e["tid"] for e in events(trace, "M") if "tid" in e} == set(names)


def test_link_lanes_never_overlap_and_use_the_most_reads_in_flight(random_run: Runtime) -> None:
    fetches = random_run.recorder.fetches
    trace = to_chrome_trace(random_run.recorder)
    by_lane: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events(trace, "X", "fetch") + events(trace, "X", "prefetch"):
        by_lane[event["tid"]].append((event["ts"], event["ts"] + event["dur"]))
    for spans in by_lane.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans))
    # Lanes = the most reads in flight at one instant (a read ending as another starts is not).
    points = sorted(
        [(f.start, 1) for f in fetches] + [(f.end, -1) for f in fetches], key=lambda p: (p[0], p[1])
    )
    in_flight = most = 0
    for _, delta in points:
        in_flight += delta
        most = max(most, in_flight)
    assert most > 1  # reads do overlap here
    assert max(link_lanes(fetches)) + 1 == most == len(by_lane)


def test_hand_computed_case_has_exact_microsecond_times() -> None:
    trace = to_chrome_trace(hand_run().recorder)
    names = thread_names(trace)

    def spans(cat: str) -> list[tuple[str, str, int, int]]:
        return [
            (e["name"], names[e["tid"]], round(e["ts"]), round(e["ts"] + e["dur"]))
            for e in events(trace, "X", cat)
        ]

    assert sorted(spans("compute"), key=lambda s: s[2]) == [
        ("entry x2", "compute", 0, 1000),
        ("L0 x1", "compute", 1500, 2700),
        ("L0 x1", "compute", 2700, 3900),
        ("L1 x1", "compute", 3900, 5100),
        ("L1 x1", "compute", 5100, 6300),
    ]
    # The two first reads overlap (1000-1500 and 1000-2000): two lanes; later reads reuse lane 0.
    assert sorted(spans("fetch"), key=lambda s: s[2:]) == [
        ("L0/E0", "link 0", 1000, 1500),
        ("L0/E1", "link 1", 1000, 2000),
        ("L1/E0", "link 0", 2700, 3200),
        ("L1/E1", "link 0", 3900, 4400),
    ]
    assert spans("prefetch") == []
    assert sorted(spans("job"), key=lambda s: (s[1], s[2])) == [
        ("entry", "request 0", 0, 1000),
        ("L0", "request 0", 1500, 2700),
        ("L1", "request 0", 3900, 5100),
        ("entry", "request 1", 0, 1000),
        ("L0", "request 1", 2700, 3900),
        ("L1", "request 1", 5100, 6300),
    ]
    assert sorted((names[e["tid"]], e["name"], e["ts"]) for e in events(trace, "i")) == [
        ("request 0", "token 0", pytest.approx(5100)),
        ("request 1", "token 0", pytest.approx(6300)),
    ]
    # Timestamps are the records' seconds x 1e6, unrounded.
    recorder = hand_run().recorder
    compute_ts = [e["ts"] for e in events(trace, "X", "compute")]
    assert compute_ts == [c.start * 1e6 for c in recorder.computes]


def test_json_round_trips_and_export_is_deterministic(tmp_path: Path, random_run: Runtime) -> None:
    trace = to_chrome_trace(random_run.recorder)
    assert json.loads(json.dumps(trace)) == trace
    assert to_chrome_trace(random_run.recorder) == trace
    assert to_chrome_trace(hand_run().recorder) == to_chrome_trace(hand_run().recorder)
    path = tmp_path / "trace.json"
    write_chrome_trace(random_run.recorder, path)
    assert json.loads(path.read_text()) == trace
    metadata = events(trace, "M")
    assert trace["traceEvents"][: len(metadata)] == metadata  # labels come first
    assert {e["name"] for e in metadata} == {"process_name", "thread_name", "thread_sort_index"}


def test_empty_recorder_gives_only_the_compute_track() -> None:
    trace = to_chrome_trace(Recorder())
    assert [e["ph"] for e in trace["traceEvents"]] == ["M", "M", "M"]
    assert thread_names(trace) == {COMPUTE_TID: "compute"}


def test_default_window_is_inside_the_run_and_spans_at_least_three_steps(random_run: Runtime) -> None:
    recorder = random_run.recorder
    start, end = default_window(recorder)
    first = min(c.start for c in recorder.computes)
    last = max(t for _, _, t in recorder.tokens)
    assert first <= start < end <= last
    assert end - start >= 3 * (last - first) / 12 - 1e-9


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000


def test_render_png_of_a_window_and_of_the_default_window(tmp_path: Path, random_run: Runtime) -> None:
    pytest.importorskip("matplotlib")
    recorder = random_run.recorder
    window = tmp_path / "window.png"
    render_png(recorder, window, start=0.01, end=0.03, max_requests=2)
    assert_png(window)
    default = tmp_path / "default.png"
    render_png(recorder, default)
    assert_png(default)
    hand = tmp_path / "hand.png"
    render_png(hand_run().recorder, hand, start=0.0, end=0.0065)
    assert_png(hand)
    with pytest.raises(ValueError, match="end > start"):
        render_png(recorder, tmp_path / "bad.png", start=0.02, end=0.01)
