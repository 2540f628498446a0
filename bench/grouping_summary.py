"""Bottleneck-aware grouping against the paper's, from bench rows of one run (issue 11's targets).

    python bench/grouping_summary.py bench/results/grouping-sim-*/results.jsonl

For every (model, profile, cache, concurrency): sync's overlap limit ``(C + F) / max(C, F)``, then
for the paper's grouping (``runahead/grouping=opportunistic``) and the new one
(``runahead/grouping=bottleneck``) the speed-up over sync, the share of the possible gain
``(x - 1) / (limit - 1)`` and the step time over the row's own ``max(compute, fetch)``; ``new/paper``
is the new grouping's tokens/s over the paper's (the "never below" target is ``>= 1``).

Rows of real backends (``runahead bench --backend torch``) work too: their ``profile`` column shows
the backend and link cap (``torch@1.5GB/s``), and a plain ``runahead`` row stands for the new
grouping (it is what ``runahead`` means). Rows of several files for the same point are separate
rounds: each file is summarized on its own, in the order given.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

from summarize import load  # bench/summarize.py: the rows of results.jsonl files

from runahead.metrics import overlap_limit

PAPER = "runahead/grouping=opportunistic"
NEW = "runahead/grouping=bottleneck"


def where_run(row: dict[str, Any]) -> str:
    """The sim's profile, or a real backend and its link cap (``torch@1.5GB/s``, ``torch@disk``)."""
    if "profile" in row:
        return str(row["profile"])
    link = f"{row['link_gbps']:g}GB/s" if row.get("link_gbps") else row.get("store", "")
    return f"{row.get('backend', 'torch')}@{link}"


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    points: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        where = (row["model"], where_run(row), row["cache_fraction"], row["concurrency"], row["step_barrier"])
        policy = NEW if row["policy"] == "runahead" else row["policy"]
        points[where][policy] = row
    out = []
    for (model, profile, cache, concurrency, barrier), by in sorted(points.items()):
        if not {"sync", PAPER, NEW} <= by.keys():
            continue
        sync = by["sync"]
        limit = overlap_limit(sync["compute_s"], sync["fetch_s"])
        entry: dict[str, Any] = {
            "model": model,
            "profile": profile,
            "cache": cache,
            "concurrency": concurrency,
            "barrier": barrier,
            "limit": limit,
            "new_over_paper": by[NEW]["tokens_per_s"] / by[PAPER]["tokens_per_s"],
        }
        for name, policy in (("paper", PAPER), ("new", NEW)):
            x = by[policy]["tokens_per_s"] / sync["tokens_per_s"]
            entry[f"{name}_x"] = x
            entry[f"{name}_share"] = (x - 1) / (limit - 1) if limit > 1 else 1.0
            entry[f"{name}_bound"] = by[policy]["bound_ratio"]
        out.append(entry)
    return out


def main() -> None:
    rows = [entry for path in sys.argv[1:] for entry in table(load([path]))]
    header = (
        f"{'model':<16} {'profile':<9} {'cache':>5} {'conc':>4} {'limit':>6} | {'paper x':>7} {'share':>6} "
        f"{'/bound':>6} | {'new x':>7} {'share':>6} {'/bound':>6} | {'new/paper':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model'][-16:]:<16} {r['profile']:<9} {r['cache']:5.2f} {r['concurrency']:>4} {r['limit']:6.2f} | "
            f"{r['paper_x']:7.3f} {r['paper_share']:6.0%} {r['paper_bound']:6.3f} | "
            f"{r['new_x']:7.3f} {r['new_share']:6.0%} {r['new_bound']:6.3f} | {r['new_over_paper']:9.3f}"
        )
    if rows:
        worst = min(rows, key=lambda r: r["new_over_paper"])
        print(
            f"\nnew/paper: min {worst['new_over_paper']:.3f} ({worst['model']}, {worst['profile']}, cache "
            f"{worst['cache']}, {worst['concurrency']} requests); rows below 1: "
            f"{sum(r['new_over_paper'] < 1 for r in rows)} of {len(rows)}"
        )


if __name__ == "__main__":
    main()
