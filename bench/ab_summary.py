"""Summarise an A/B of the torch backend's rows in folders ``<point>-<variant>-<round>``: per point,
policy and variant, tokens/s of each round, then medians of runahead / sync, the overlap limit of
sync's row and the share of the possible gain, the compute thread's share of its group time, the
hand-off to the compute thread a group, compute and link ms a step. A point whose rounds computed in
different dtypes (``--dtype auto`` times its race in each process, and may draw either) is named
below the table: its variants are not compared like with like.

    python bench/ab_summary.py bench/results/native-reads        # bench/native-reads-ab.sh: off / on
    python bench/ab_summary.py bench/results/submit-gil --variant before="GIL kept" \
        --variant after="GIL let go"                              # bench/tree-ab.sh: before / after
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from runahead.metrics import overlap_limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--variant",
        action="append",
        metavar="NAME=LABEL",
        help="a variant's folder name and its label (default: off=Python threads, on=C threads)",
    )
    args = parser.parse_args()
    labels = dict(item.split("=", 1) for item in args.variant or ["off=Python threads", "on=C threads"])
    rows: dict[tuple[str, str, str], list[tuple[float, ...]]] = defaultdict(list)
    dtypes: dict[str, set[tuple[str, str]]] = defaultdict(set)  # point -> (variant-round, dtype)
    for path in sorted(args.folder.glob("*-*-*/results.jsonl")):
        found = re.fullmatch(rf"(.+)-({'|'.join(map(re.escape, labels))})-(\d+)", path.parent.name)
        if found is None:
            continue
        point, mode, round_ = found.groups()
        by_policy = {
            (row["concurrency"], row["cache_fraction"], row["policy"]): row
            for row in map(json.loads, path.read_text().splitlines())
        }
        for (requests, fraction, policy), row in by_policy.items():
            sync = by_policy.get((requests, fraction, "sync"))
            if sync is None:
                continue  # a round still running: its sync row is not written yet
            limit = overlap_limit(sync["compute_s"], sync["fetch_s"])
            ratio = row["tokens_per_s"] / sync["tokens_per_s"]
            same = float(row["token_digest"] == sync["token_digest"])
            share = (ratio - 1) / (limit - 1) if limit > 1 else float("nan")  # nothing read: no gain to share
            cells = (
                row["tokens_per_s"],
                ratio,
                limit,
                share,
                row["compute_cpu_share"],
                row["compute_s"],
                row["fetch_s"],
                same,
                float("nan") if row.get("handoff_us_per_group") is None else row["handoff_us_per_group"],
            )
            label = f"{point}, {requests} req, {fraction:.0%} cache"
            rows[label, policy, mode].append(cells)
            dtypes[label].add((f"{mode}-{round_}", str(row.get("compute_dtype"))))
    print(
        "| point | policy | variant | tok/s by round | x sync | limit | share | thread ran | hand-off us "
        "| C / F ms a step |"
    )
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (point, policy, mode), cells in sorted(rows.items()):

        def med(i: int, cells: list[tuple[float, ...]] = cells) -> float:
            return statistics.median(c[i] for c in cells)

        if not all(c[7] for c in cells):
            raise ValueError(f"{point} {policy} {mode}: tokens differ from sync's")
        rounds = " / ".join(f"{c[0]:.1f}" for c in cells)
        print(
            f"| {point} | {policy} | {labels[mode]} | {rounds} | {med(1):.2f} | {med(2):.2f} | "
            f"{med(3) * 100:.0f}% | {med(4) * 100:.0f}% | {med(8):.0f} | "
            f"{med(5) * 1e3:.1f} / {med(6) * 1e3:.1f} |"
        )
    mixed = {label: drawn for label, drawn in sorted(dtypes.items()) if len({d for _, d in drawn}) > 1}
    if mixed:
        print()
    for label, drawn in mixed.items():
        runs = ", ".join(f"{run} {dtype}" for run, dtype in sorted(drawn))
        print(f"note: {label} computed in more than one dtype ({runs}): not like with like")


if __name__ == "__main__":
    main()
