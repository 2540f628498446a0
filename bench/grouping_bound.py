"""The best schedule reachable without prediction on small cases, and each grouping's share of it.

    python bench/grouping_bound.py [--out bench/results/grouping-bound.json]

For each paper model on each profile: the sim's synthetic routing (seed 0, the bench's), one decode
step after 8 warm-up steps whose experts fill the cache (30% of all experts, most used first), with
2 requests over every layer and 4 requests over the first 8 layers (the search grows fast with
requests). :func:`runahead.bound.best_schedule` finds the shortest makespan over every group/wait
decision; sync, the paper's grouping and the bottleneck-aware one are played through the same
model (:func:`runahead.bound.run_policy`). Printed per case: sync's overlap limit ``(C + F) /
max(C, F)``, the bound's speed-up over sync and its share of the limit's gain (what is reachable at
all), and each grouping's speed-up and share of the bound's gain.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from runahead.bench import cache_slots, warm_keys
from runahead.bound import SmallCase, best_schedule, run_policy
from runahead.costs import CostModel
from runahead.jobs import Job
from runahead.scheduling import Grouping
from runahead.specs import load_model_spec, load_profile
from runahead.trace import default_trace

WARMUP = 8
CONTEXT = 200  # tokens of context each job's attention reads (a chat prompt's order of magnitude)
CASES = ((2, None), (4, 8))  # (requests, layers: None for every layer)
GROUPINGS = {
    "sync": Grouping(static=True),
    "paper": Grouping(),
    "bottleneck": Grouping(bottleneck=True),
}


def small_case(model: str, profile: str, requests: int, layers: int | None, cache: float) -> SmallCase:
    spec = load_model_spec(model)
    costs = CostModel(spec, load_profile(profile))
    layers = layers or spec.num_layers
    trace = default_trace(spec, requests, WARMUP + 1, seed=0)
    used = Counter(warm_keys(trace, requests, WARMUP))
    resident = frozenset(k for k, _ in used.most_common(cache_slots(spec, cache)) if k.layer < layers)
    selections = [
        [[tuple(trace.selections(r)[WARMUP][layer]) for layer in range(layers)]] for r in range(requests)
    ]

    def group_s(jobs: Sequence[Job]) -> float:
        distinct = len({e for job in jobs for e in job.experts})
        return costs.compute_time(jobs[0].layer, [1] * len(jobs), [CONTEXT] * len(jobs), distinct)

    return SmallCase(selections, resident, costs.fetch_transfer_time(), group_s)


def measure(model: str, profile: str, requests: int, layers: int | None, cache: float) -> dict[str, object]:
    case = small_case(model, profile, requests, layers, cache)
    played = {name: run_policy(case, grouping) for name, grouping in GROUPINGS.items()}
    started = time.perf_counter()
    best = best_schedule(case, incumbent=min(s.makespan for s in played.values()) + 1e-9)
    seconds = time.perf_counter() - started
    sync = played["sync"]
    limit = (sync.compute_s + sync.fetch_s) / max(sync.compute_s, sync.fetch_s)
    bound_x = sync.makespan / best.makespan
    row: dict[str, object] = {
        "model": model,
        "profile": profile,
        "requests": requests,
        "layers": case.layers,
        "cache_fraction": cache,
        "limit": limit,
        "bound_x": bound_x,
        "bound_share_of_limit": (bound_x - 1) / (limit - 1),
        "bound_ms": best.makespan * 1e3,
        "bound_compute_ms": best.compute_s * 1e3,
        "fetch_ms": sync.fetch_s * 1e3,
        "explored": best.explored,
        "search_s": seconds,
    }
    for name, schedule in played.items():
        x = sync.makespan / schedule.makespan
        row[f"{name}_ms"] = schedule.makespan * 1e3
        row[f"{name}_compute_ms"] = schedule.compute_s * 1e3
        row[f"{name}_x"] = x
        row[f"{name}_share_of_bound"] = (x - 1) / (bound_x - 1) if bound_x > 1 else 1.0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    args = parser.parse_args()
    rows = []
    print(
        f"{'model':<16} {'profile':<9} {'req':>3} {'layers':>6} {'limit':>6} {'bound x':>7} {'of limit':>8} | "
        f"{'paper x':>7} {'of bound':>8} | {'new x':>7} {'of bound':>8} | {'nodes':>7} {'s':>5}"
    )
    for profile in ("thor", "mac-mini"):
        for model in ("qwen3.6-35b-a3b", "gemma4-26b-a4b"):
            for requests, layers in CASES:
                r = measure(model, profile, requests, layers, args.cache_fraction)
                rows.append(r)
                print(
                    f"{model:<16} {profile:<9} {requests:>3} {r['layers']:>6} {r['limit']:6.2f} "
                    f"{r['bound_x']:7.3f} {r['bound_share_of_limit']:8.0%} | {r['paper_x']:7.3f} "
                    f"{r['paper_share_of_bound']:8.0%} | {r['bottleneck_x']:7.3f} "
                    f"{r['bottleneck_share_of_bound']:8.0%} | {r['explored']:>7} {r['search_s']:5.1f}",
                    flush=True,
                )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
