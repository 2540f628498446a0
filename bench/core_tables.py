"""Markdown tables of the core sim sweep for docs/results-core.md.

    python bench/core_tables.py bench/results/core-sim-*-*/results.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

POLICIES = ("sync", "prefetch-gate", "prefetch-history", "runahead", "runahead+prefetch")


def main() -> None:
    rows = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.strip()]
    points: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row["step_barrier"]:
            points[(row["profile"], row["model"], row["concurrency"])][row["policy"]] = row
    print("| profile | model | requests | " + " | ".join(POLICIES)
          + " | sync compute / fetch (ms) | runahead compute / fetch (ms) | experts fetched per step |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in POLICIES) + " | ---: | ---: | ---: |")
    for (profile, model, concurrency), by in sorted(points.items()):
        speeds = " | ".join(f"{by[p]['tokens_per_s']:.1f}" for p in POLICIES)
        sync, runahead = by["sync"], by["runahead"]
        print(f"| {profile} | {model} | {concurrency} | {speeds} | "
              f"{sync['compute_s'] * 1e3:.1f} / {sync['fetch_s'] * 1e3:.1f} | "
              f"{runahead['compute_s'] * 1e3:.1f} / {runahead['fetch_s'] * 1e3:.1f} | "
              f"{sync['fetches_per_step']:.0f} |")
    fetch_ratio = [by[p]["fetches"] / by["sync"]["fetches"] for by in points.values()
                   for p in ("prefetch-gate", "prefetch-history")]
    unused = [by[p]["wasted_prefetches"] / max(1, by[p]["prefetches"]) for by in points.values()
              for p in ("prefetch-gate", "prefetch-history")]
    print(f"\nprefetchers' fetches vs sync: {min(fetch_ratio):.2f}-{max(fetch_ratio):.2f}x; "
          f"unused prefetches: {min(unused):.0%}-{max(unused):.0%}")


if __name__ == "__main__":
    main()
