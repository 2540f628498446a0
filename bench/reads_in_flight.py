"""Expert reads in flight (the store's workers and the runtime's link workers): sync and runahead at
each depth, the depths alternating round by round, on a real store.

Experts from disk (``O_DIRECT``) by default; 8 requests, 30% cache. Prints tokens/s and compute /
link ms a step per policy, depth and round (a disk's pace moves between minutes: compare within a
round). What set ``runahead.backend.READS_IN_FLIGHT`` (docs/results-torch.md).

    python bench/reads_in_flight.py [--model small|medium|PATH] [--depths 2,4] [--rounds 4]
"""

from __future__ import annotations

import argparse

from runahead.medium import medium_model, small_model
from runahead.torchbench import TorchPoint, run_torch_point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="small, medium or a model folder")
    parser.add_argument("--depths", default="2,4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--store", default="disk", choices=["disk", "host"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=4)
    args = parser.parse_args()
    path = {"small": small_model, "medium": medium_model}.get(args.model, lambda: args.model)()
    depths = [int(d) for d in args.depths.split(",")]
    for round_ in range(args.rounds):
        for depth in depths if round_ % 2 == 0 else depths[::-1]:
            cells = []
            for policy in ("sync", "runahead"):
                point = TorchPoint(
                    str(path), policy, 8, 0.3, args.steps, store=args.store,
                    warmup_steps=args.warmup_steps, queue_depth=depth,
                )  # fmt: skip
                row = run_torch_point(point)
                compute, link = 1e3 * row["compute_s"], 1e3 * row["fetch_s"]
                cells.append(f"{policy} {row['tokens_per_s']:.2f} tok/s (C/F {compute:.0f}/{link:.0f} ms)")
            print(f"round {round_} depth {depth}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
