"""A sweep of the bottleneck rule against the stored rows: is a change to the rule worth keeping?

Reads every ``grouping-sim-*/results.jsonl`` under NEW (``POLICIES=runahead/grouping=bottleneck
OUT=NEW bash bench/grouping-sim.sh``) and, for each point, the rows of the same folder name under
STORED (default ``bench/results``, what the docs quote): the new rule's tokens/s over the stored
rule's and over the paper's grouping, both shares of the possible gain (sync's own limit), and the
new row's step over ``max(compute, fetch)``. Ends with the range, how many points fell below the
stored rule and below the paper's grouping, and the log-mean ratio per concurrency.

    python bench/grouping_against.py /tmp/sweep            # against bench/results
    python bench/grouping_against.py /tmp/sweep --stored /tmp/other-sweep-with-every-policy
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from runahead.metrics import overlap_limit

RULE = "runahead/grouping=bottleneck"
PAPER = "runahead/grouping=opportunistic"


def rows(path: Path) -> list[dict[str, Any]]:
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def pick(found: list[dict[str, Any]], policy: str, concurrency: int) -> dict[str, Any]:
    for row in found:
        if row["policy"] == policy and row["concurrency"] == concurrency:
            return row
    raise SystemExit(f"no stored {policy} row at {concurrency} requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path, help="folder holding the sweep's grouping-sim-* folders")
    parser.add_argument("--stored", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    ratios: list[float] = []
    below_stored = below_paper = 0
    logs: dict[int, list[float]] = defaultdict(list)
    folders = sorted(args.new.glob("grouping-sim-*/results.jsonl"))
    if not folders:
        raise SystemExit(f"no grouping-sim-*/results.jsonl under {args.new}")
    header = ("point", "req", "/stored", "/paper", "share stored", "new", "/bound")
    print("{:40} {:>3} {:>8} {:>8} {:>12} {:>6} {:>7}".format(*header))
    for path in folders:
        name = path.parent.name
        stored = rows(args.stored / name / "results.jsonl")
        for row in rows(path):
            if row["policy"] != RULE:
                continue
            requests = row["concurrency"]
            old, paper, sync = (pick(stored, policy, requests) for policy in (RULE, PAPER, "sync"))
            limit = overlap_limit(sync["compute_s"], sync["fetch_s"])

            def share(of: dict[str, Any], sync: dict[str, Any] = sync, limit: float = limit) -> float:
                return (of["tokens_per_s"] / sync["tokens_per_s"] - 1) / (limit - 1)

            ratio = row["tokens_per_s"] / old["tokens_per_s"]
            over_paper = row["tokens_per_s"] / paper["tokens_per_s"]
            ratios.append(ratio)
            logs[requests].append(math.log(ratio))
            below_stored += ratio < 1
            below_paper += over_paper < 1
            print(
                f"{name.removeprefix('grouping-sim-'):40} {requests:3d} {ratio:8.4f} {over_paper:8.4f} "
                f"{share(old):11.1%} {share(row):6.1%} {row['bound_ratio']:7.3f}"
            )
    print(
        f"{len(ratios)} points: {min(ratios):.4f}-{max(ratios):.4f}x the stored rule, "
        f"{below_stored} below it, {below_paper} below the paper's grouping"
    )
    print(
        "log-mean by concurrency: "
        + ", ".join(
            f"{requests}: {100 * (math.exp(sum(v) / len(v)) - 1):+.3f}%"
            for requests, v in sorted(logs.items())
        )
    )


if __name__ == "__main__":
    main()
