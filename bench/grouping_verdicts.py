"""Count what bottleneck grouping decided in one `runahead` command: held, declined by the link (or
tail) test, or no wait paid; and how often the scheduler gave the rule no outlook at all (nothing
blocked, nothing measured yet, or a compute share below both gates).

Any backend (the sim has `bench/grouping_gap.py` besides, which times a step's parts). It wraps the rule
(`weigh_hold`, `ComputeQueue.plan`) to count and runs the CLI with the arguments given:

    python bench/grouping_verdicts.py bench --backend torch --model medium --store disk \
        --policy runahead --concurrency 8 --cache-fraction 0.7 --steps 32 --warmup-steps 8 --out DIR

Prints the counts after the command's own output, and for the declined holds the median net
compute gain, revealed link work left and the ready group's estimated time.
"""

from __future__ import annotations

import collections
import statistics
import sys

import runahead.scheduling as scheduling
from runahead.bottleneck import weigh_hold
from runahead.cli import main

counts: collections.Counter[object] = collections.Counter()
declined: list[tuple[float, float, float]] = []


def counted_weigh_hold(now, ready, waiting, link_free_at, group_s, *, tail=False, **options):  # type: ignore[no-untyped-def]
    verdict = weigh_hold(now, ready, waiting, link_free_at, group_s, tail=tail, **options)
    where = "tail" if tail else "below the tail"
    if verdict.deadline is not None:
        counts[where, "held"] += 1
    elif verdict.top_gain > 0:
        counts[where, "declined by the link/tail test"] += 1
        declined.append((verdict.top_gain, link_free_at - now, group_s(list(ready))))
    else:
        counts[where, "no wait pays"] += 1
    return verdict


plan = scheduling.ComputeQueue.plan


def counted_plan(self, positions, lanes, outlook):  # type: ignore[no-untyped-def]
    counts["decisions with an outlook" if outlook is not None else "decisions without one"] += 1
    return plan(self, positions, lanes, outlook)


scheduling.weigh_hold = counted_weigh_hold  # type: ignore[assignment]
scheduling.ComputeQueue.plan = counted_plan  # type: ignore[method-assign]

if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        for key, value in sorted(counts.items(), key=str):
            print(f"{key}: {value}")
        if declined:
            gain, link, ready = (statistics.median(row[i] for row in declined) * 1e3 for i in range(3))
            print(f"declined: median net gain {gain:.2f} ms, link work left {link:.2f} ms, ", end="")
            print(f"g(ready) {ready:.2f} ms")
