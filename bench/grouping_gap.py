"""Where bottleneck grouping loses to the overlap limit, on one sim point (issue 11's gap analysis).

    python bench/grouping_gap.py --model qwen3.6-35b-a3b --profile thor --concurrency 8 --steps 64

Runs one chat point on the sim (virtual time: deterministic), records every hold decision of the
rule (taken, declined because no wait saves more compute than it idles, declined by the link test,
or not asked: the compute share below the gate) and prints, per decode step on average: step time,
compute busy and idle, link busy and idle (at the step's start, its end, and in between), groups
(and groups of one job, last-layer groups), and what the 90% share of the possible gain would need.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict
from typing import Any

import runahead.scheduling as scheduling
from runahead.bench import BenchPoint, run_point
from runahead.bottleneck import HoldVerdict
from runahead.jobs import ENTRY_LAYER
from runahead.metrics import Recorder, overlap_limit, union

DECISIONS: Counter[str] = Counter()
FOREGONE: list[float] = []


def _traced_weigh_hold(original: Any) -> Any:
    """``weigh_hold``, counting each verdict by kind (held, or declined and why)."""

    def traced(*args: Any, tail: bool = False, **options: Any) -> HoldVerdict:
        verdict: HoldVerdict = original(*args, tail=tail, **options)
        kind = "tail" if tail else "mid"
        if verdict.deadline is not None:
            DECISIONS[f"{kind}: held"] += 1
        elif verdict.top_gain <= 1e-12:
            DECISIONS[f"{kind}: declined, no wait pays"] += 1
        else:
            DECISIONS[f"{kind}: declined by the link test"] += 1
            FOREGONE.append(verdict.top_gain)
        return verdict

    return traced


def _traced_plan(original: Any) -> Any:
    def traced(self, positions, lanes, outlook):  # type: ignore[no-untyped-def]
        if outlook is None and self._ready and self.grouping.bottleneck:
            DECISIONS["no outlook (nothing blocked or share below both gates)"] += 1
        elif outlook is not None and self._ready:
            layer = min(entry[2].layer for entry in self._ready.values())
            if not any(job.layer == layer for job in outlook.blocked):
                DECISIONS["nothing blocked at the group's layer"] += 1
        return original(self, positions, lanes, outlook)

    return traced


def steps_of(recorder: Recorder) -> list[tuple[float, float]]:
    """Each decode step's (start, end): from an entry group's start to the next one's."""
    starts = [record.start for record in recorder.computes if record.layer == ENTRY_LAYER]
    ends = [*starts[1:], max(record.end for record in recorder.computes)]
    return list(zip(starts, ends, strict=True))


def analyse(recorder: Recorder, fetch_s: float, last_layer: int) -> dict[str, float]:
    reads = [(record.end - fetch_s, record.end) for record in recorder.fetches]
    rows: dict[str, list[float]] = defaultdict(list)
    for start, end in steps_of(recorder)[1:]:  # the first step starts from a cold queue
        groups = [r for r in recorder.computes if start <= r.start < end]
        busy = sum(r.end - r.start for r in groups)
        link = [(max(a, start), min(b, end)) for a, b in reads if b > start and a < end]
        link_busy = sum(b - a for a, b in union(link))
        first = min((a for a, _ in link), default=end)
        last = max((b for _, b in link), default=end)
        rows["step ms"].append(end - start)
        rows["compute ms"].append(busy)
        rows["compute idle ms"].append(end - start - busy)
        rows["link busy ms"].append(link_busy)
        rows["link idle at start ms"].append(first - start)
        rows["link idle at end ms"].append(end - last)
        rows["link idle between ms"].append((last - first) - link_busy)
        rows["groups"].append(len(groups))
        rows["groups of one"].append(sum(r.size == 1 for r in groups))
        rows["last-layer groups"].append(sum(r.layer == last_layer for r in groups))
        rows["groups per layer"].append(len(groups) / (last_layer + 2))
        rows["mean group size"].append(sum(r.size for r in groups) / len(groups))
    return {
        name: statistics.fmean(values) * (1e3 if name.endswith("ms") else 1) for name, values in rows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3.6-35b-a3b")
    parser.add_argument("--profile", default="thor")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--policy", default="runahead/grouping=bottleneck")
    args = parser.parse_args()
    scheduling.weigh_hold = _traced_weigh_hold(scheduling.weigh_hold)  # type: ignore[attr-defined]
    scheduling.ComputeQueue.plan = _traced_plan(scheduling.ComputeQueue.plan)  # type: ignore[method-assign]
    kept: dict[str, Any] = {}
    rows = {}
    for policy in ("sync", args.policy):
        point = BenchPoint(
            args.model, args.profile, policy, args.concurrency, args.cache_fraction, args.steps
        )
        DECISIONS.clear()
        FOREGONE.clear()
        rows[policy] = run_point(point, timeline=lambda runtime: kept.update(runtime=runtime))
        runtime = kept["runtime"]
    costs = runtime.backend.costs
    stats = analyse(runtime.recorder, costs.fetch_transfer_time(), costs.model.num_layers - 1)
    sync, new = rows["sync"], rows[args.policy]
    limit = overlap_limit(sync["compute_s"], sync["fetch_s"])
    x = new["tokens_per_s"] / sync["tokens_per_s"]
    print(
        f"{args.model} {args.profile} {args.concurrency} requests, {args.cache_fraction:.0%} cache, "
        f"{args.steps} steps"
    )
    print(
        f"sync: step {sync['step_time_s'] * 1e3:.2f} ms, compute {sync['compute_s'] * 1e3:.2f}, "
        f"fetch {sync['fetch_s'] * 1e3:.2f}"
    )
    print(f"{args.policy}: x {x:.3f}, share {(x - 1) / (limit - 1):.0%} (limit {limit:.3f})")
    for name, value in stats.items():
        print(f"  {name:<24} {value:8.2f}")
    target = sync["step_time_s"] / (1 + 0.9 * (limit - 1))
    print(
        f"90% share needs a step of {target * 1e3:.2f} ms: compute <= that, link busy >= "
        f"{new['fetch_s'] / target:.0%} of it"
    )
    print("hold decisions:")
    for name, count in sorted(DECISIONS.items()):
        print(f"  {name:<56} {count:7d}")
    if FOREGONE:
        print(
            "  compute a declined (link test) hold would have saved: mean "
            f"{statistics.fmean(FOREGONE) * 1e3:.3f} ms,"
            f" total per step {sum(FOREGONE) / args.steps * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
