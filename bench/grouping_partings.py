"""Where the pilot without hindsight and the bottleneck rule part, decision by decision (issue 11).

The small-case model of ``bench/grouping_bound.py`` (the sim's link, the cache after the warm-up steps):
the pilot method without hindsight (:func:`runahead.bound_online.partings`) is played with the rule
for its rollouts, and at each decision with a choice the rule's own choice is asked too. Each decision
where they differ is printed with what the rule saw (ready jobs, blocked jobs with their missing
experts and when those land, the compute share) and the regret, the mean makespan the rule's option
costs over the reference's; then a count and the summed regret per kind:

- ``wait``: the rule computes the lowest ready layer, the reference waits;
- ``runner``: both compute, the reference a higher layer (the lowest waits for its partner);
- ``compute``: the rule holds, the reference computes the lowest layer;
- ``runner-in-hold``: the rule holds, the reference computes a higher layer meanwhile.

Regrets are each decision's alone (the rule plays every rollout after it), so their sum only
approximates the makespan gap. Tens of seconds to minutes a step (48 samples: ~1.5 min for
Gemma4 on the Thor at 4 requests, ~4 for Qwen3.6):

    python bench/grouping_partings.py --model gemma4-26b-a4b --profile thor --requests 4 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouping_bound import GROUPINGS, HISTORY, WARMUP, case_history, small_case

from runahead.bound_online import Parting, partings


def kind(parting: Parting) -> str:
    """Which way the two parted (module docstring)."""
    lowest = min(layer for layer, _ in parting.ready)
    if parting.reference is None:
        return "wait"
    if parting.rule is not None:
        return "runner" if parting.reference > parting.rule else "lower"
    return "compute" if parting.reference == lowest else "runner-in-hold"


def step_partings(
    model: str, profile: str, requests: int, seed: int, samples: int, cache: float = 0.3
) -> tuple[float, list[Parting]]:
    """One step of routing (``seed``): the reference's makespan and where the rule parts from it."""
    case = small_case(model, profile, requests, None, cache, seed=seed, warmup=WARMUP)
    history = case_history(model, requests, case.layers, seed, WARMUP, HISTORY)
    schedule, found = partings(case, GROUPINGS["bottleneck"], history, samples, seed)
    return schedule.makespan, found


def describe(parting: Parting) -> str:
    blocked = [(layer, r, missing, round(t * 1e3, 3)) for layer, r, missing, t in parting.blocked]
    share = "-" if parting.compute_share is None else f"{parting.compute_share:.2f}"
    return (
        f"t={parting.now * 1e3:8.3f} ms  ready={list(parting.ready)}  blocked={blocked}  "
        f"rule={parting.rule} reference={parting.reference}  "
        f"regret={parting.regret * 1e3:.4f} ms  share={share}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3.6-35b-a3b")
    parser.add_argument("--profile", default="thor")
    parser.add_argument("--requests", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--seeds", default="0", help="comma list of routing steps")
    parser.add_argument("--samples", type=int, default=48, help="completions drawn at each decision")
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--json", type=Path, help="write every parting here")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    counts: Counter[str] = Counter()
    regrets: Counter[str] = Counter()
    rows = []
    for seed in seeds:
        makespan, found = step_partings(
            args.model, args.profile, args.requests, seed, args.samples, args.cache_fraction
        )
        print(f"step {seed}: the reference {makespan * 1e3:.3f} ms, {len(found)} partings", flush=True)
        for parting in found:
            print("  " + describe(parting))
            counts[kind(parting)] += 1
            regrets[kind(parting)] += parting.regret
            rows.append({"seed": seed, "kind": kind(parting)} | asdict(parting))
    print(f"{'kind':<16} {'count':>5} {'summed regret (ms)':>19}")
    for name, count in counts.most_common():
        print(f"{name:<16} {count:>5} {regrets[name] * 1e3:19.3f}")
    if args.json:
        for row in rows:
            row["means"] = {str(option): mean for option, mean in row["means"].items()}
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
