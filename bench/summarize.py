"""Summarize bench rows against the issues' targets: ratios side by side from one run.

    python bench/summarize.py bench/results/core-sim-*/results.jsonl

For every (model, profile or device, concurrency, cache fraction, barrier): runahead vs sync, the
overlap limit (compute + fetch) / max(compute, fetch) of sync's own row, the share of that limit
runahead reaches, runahead vs the best prefetcher, runahead's step time over its lower bound, and
its both-busy fraction. Zero-cost rows (``--zero-cost``: the runtime's own cost, no modelled time)
have no throughput to compare and are left out; charged rows (``--charge-overhead``) are compared
with each other (at one ``--charge-scale``), never with uncharged ones.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

from runahead.metrics import overlap_limit

PREFETCHERS = ("prefetch-gate", "prefetch-history")


def load(paths: list[str]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        with open(path) as lines:
            rows.extend(json.loads(line) for line in lines if line.strip())
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    points: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row.get("zero_cost"):
            continue
        where = (row["model"], row.get("profile", row.get("device")), row["concurrency"], row["cache_fraction"],
                 row["step_barrier"], bool(row.get("charge_overhead")),
                 row.get("charge_scale", 1.0) if row.get("charge_overhead") else None)
        points[where][row["policy"]] = row
    out = []
    for (model, place, concurrency, fraction, barrier, *_), by_policy in sorted(points.items()):
        sync, runahead = by_policy.get("sync"), by_policy.get("runahead")
        if not sync or not runahead:
            continue
        limit = overlap_limit(sync["compute_s"], sync["fetch_s"])
        speedup = runahead["tokens_per_s"] / sync["tokens_per_s"]
        prefetchers = [by_policy[p]["tokens_per_s"] for p in PREFETCHERS if p in by_policy]
        out.append({
            "model": model, "where": place, "concurrency": concurrency, "cache": fraction,
            "barrier": "on" if barrier else "off",
            "vs_sync": speedup, "limit": limit, "of_limit": (speedup - 1) / (limit - 1) if limit > 1 else 1.0,
            "vs_best_prefetch": runahead["tokens_per_s"] / max(prefetchers) if prefetchers else None,
            "bound_ratio": runahead["bound_ratio"], "overlap": runahead["overlap_fraction"],
            "sync_c_over_f": sync["compute_s"] / sync["fetch_s"] if sync["fetch_s"] else float("inf"),
            "runahead_plus_prefetch": (by_policy["runahead+prefetch"]["tokens_per_s"] / runahead["tokens_per_s"]
                                       if "runahead+prefetch" in by_policy else None),
        })
    return out


def main() -> None:
    rows = summarize(load(sys.argv[1:]))
    header = (f"{'model':<16} {'where':<14} {'conc':>4} {'cache':>5} {'bar':>3} {'vs sync':>7} {'limit':>6} "
              f"{'of lim':>6} {'vs pref':>7} {'/bound':>6} {'overlap':>7} {'c/f':>5} {'+pref':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        pref = f"{r['vs_best_prefetch']:7.2f}" if r["vs_best_prefetch"] else f"{'-':>7}"
        plus = f"{r['runahead_plus_prefetch']:6.3f}" if r["runahead_plus_prefetch"] else f"{'-':>6}"
        print(f"{str(r['model'])[-16:]:<16} {str(r['where'])[-14:]:<14} {r['concurrency']:>4} {r['cache']:>5.2f} "
              f"{r['barrier']:>3} {r['vs_sync']:7.2f} {r['limit']:6.2f} {r['of_limit']:6.0%} {pref} "
              f"{r['bound_ratio']:6.3f} {r['overlap']:7.2f} {r['sync_c_over_f']:5.2f} {plus}")


if __name__ == "__main__":
    main()
