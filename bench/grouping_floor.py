"""The overlap relaxation's floor under every bench point of a grouping sweep (issue 11's bound).

    python bench/grouping_floor.py [--max-requests 8] bench/results/grouping-sim-*-0.3/results.jsonl

For every (model, profile, cache, concurrency) with sync, the paper's grouping and the new one in
the rows: the levels of each decode step of the point's own trace (:func:`runahead.bench.run_point`
builds the same: synthetic routing, the chat requests' contexts) at the cost model's prices,
pooled over the run with its reads (the fewest of the three rows' reads, each holding the link
``expert_bytes / link_bandwidth``) into :func:`runahead.relaxation.floor`: no grouping without
prediction has a shorter step. Printed: sync's overlap limit, the floor's speed-up over sync and
its share of the limit's gain (``of limit``: what no grouping can pass), and each grouping's share
of the floor's gain. Points above ``--max-requests`` (default 8) are left out: the split of a level
tries every cut (``2 ** (n - 1) - 1``), ~40 s a file at 8 requests, too many at 16.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from grouping_summary import NEW, PAPER  # bench/grouping_summary.py
from summarize import load  # bench/summarize.py: the rows of results.jsonl files

from runahead.bench import BenchPoint
from runahead.bench_requests import request_specs
from runahead.costs import CostModel
from runahead.jobs import ENTRY_LAYER, Job, distinct_experts
from runahead.metrics import overlap_limit
from runahead.relaxation import Level, floor, level
from runahead.specs import load_model_spec, load_profile
from runahead.synthetic import default_trace


def point_levels(point: BenchPoint) -> tuple[list[Level], CostModel]:
    """Every decode step's levels of ``point`` (chat, step barrier on) at its cost model's prices."""
    model = load_model_spec(point.model)
    costs = CostModel(model, load_profile(point.profile))
    specs = request_specs(point)
    trace = default_trace(model, len(specs), point.warmup_steps + point.steps, point.seed)
    prompts = {spec.request: spec.prompt_tokens for spec in specs}

    def group_s(jobs: Sequence[Job]) -> float:
        contexts = [prompts[job.request] + job.step + 1 for job in jobs]
        return costs.compute_time(jobs[0].layer, [1] * len(jobs), contexts, distinct_experts(jobs))

    latency = costs.link_latency_s
    levels = []
    for step in range(point.steps):
        routed = [trace.selections(r % trace.num_requests)[point.warmup_steps + step] for r in prompts]
        entry = [Job(r, step, ENTRY_LAYER, lane=r) for r in prompts]
        levels.append(level(entry, group_s, first=True, latency_s=latency))
        for layer in range(model.num_layers):
            jobs = [Job(r, step, layer, tuple(routed[r][layer]), lane=r) for r in prompts]
            levels.append(level(jobs, group_s, last=layer == model.num_layers - 1, latency_s=latency))
    return levels, costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-requests", type=int, default=8)
    parser.add_argument("results", nargs="+", help="results.jsonl files of a grouping sweep")
    args = parser.parse_args()
    points: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in load(args.results):
        key = (row["model"], row["profile"], row["cache_fraction"], row["concurrency"], row["steps"])
        points[key][row["policy"]] = row
    print(
        f"{'model':<16} {'profile':<9} {'cache':>5} {'conc':>4} {'limit':>6} | {'floor ms':>8} "
        f"{'floor x':>7} {'of limit':>8} | {'paper x':>7} {'of floor':>8} | {'new x':>7} {'of floor':>8}"
    )
    for (model, profile, cache, concurrency, steps), by in sorted(points.items()):
        if concurrency > args.max_requests or not {"sync", PAPER, NEW} <= by.keys():
            continue
        point = BenchPoint(model, profile, "sync", concurrency, cache, steps)
        levels, costs = point_levels(point)
        reads = min(row["fetches"] for row in by.values()) * costs.fetch_transfer_time()
        step = floor(levels, reads) / steps
        sync = by["sync"]
        limit = overlap_limit(sync["compute_s"], sync["fetch_s"])
        floor_x = sync["step_time_s"] / step
        shares = []
        for policy in (PAPER, NEW):
            x = by[policy]["tokens_per_s"] / sync["tokens_per_s"]
            shares.append(f"{x:7.3f} {(x - 1) / (floor_x - 1):8.0%}")
        print(
            f"{model[-16:]:<16} {profile:<9} {cache:5.2f} {concurrency:>4} {limit:6.2f} | {step * 1e3:8.2f} "
            f"{floor_x:7.3f} {(floor_x - 1) / (limit - 1):8.0%} | {shares[0]} | {shares[1]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
