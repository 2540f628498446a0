"""The event loop's CPU time per expert read on a real store, before and after a change, side by side.

Each tree (a folder holding a ``runahead`` package) runs in its own fresh processes, alternating: the
small model's torch backend opens with the host or disk store (optionally behind a link cap), and
``--reads`` reads of its experts go through ``TorchBackend.fetch`` (the runtime's own call) with
``--in-flight`` of them at a time, one task each, as the runtime's link workers do. What is counted
is the event loop thread's CPU time (``time.thread_time``) per read: the runtime's share of a read,
which a real run pays on the same thread as its scheduling (docs/results-torch.md, "Hand-offs").
The least of ``--rounds`` processes per tree counts (a busy machine only ever adds time).

``--busy`` runs a thread beside the loop that alternates Python and small torch products, as the
compute thread does: the loop's torch calls that let go of the GIL then cost a hand-over each.

    python bench/read_cost.py --before /tmp/main-src --after . [--store host|disk] [--link-gbps 0.6] [--busy]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = """
import asyncio, itertools, json, sys, time
from runahead import loops
from runahead.backends.torch import TorchBackend
from runahead.jobs import ExpertKey
from runahead.medium import small_model

import threading, torch
store, link, reads, in_flight = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
busy = sys.argv[5] == "busy"
backend = TorchBackend.open(
    str(small_model()), cache_fraction=0.5, store=store, dtype="float32",
    link_bandwidth=None if link == "none" else float(link) * 1e9,
)
config = backend.model.config
keys = [ExpertKey(layer, e) for layer in range(config.num_layers) for e in range(config.num_experts)]
slots = backend.num_slots

async def main() -> tuple[float, float]:
    order = itertools.cycle(keys)
    free = list(range(slots))
    async def worker(count: int) -> None:
        for _ in range(count):
            slot = free.pop()
            await backend.fetch(next(order), slot)
            free.append(slot)
    await asyncio.gather(*(worker(8) for _ in range(in_flight)))  # warm-up: threads started, buffers made
    cpu, wall = time.thread_time(), time.perf_counter()
    await asyncio.gather(*(worker(reads // in_flight) for _ in range(in_flight)))
    return time.thread_time() - cpu, time.perf_counter() - wall

stop = threading.Event()

def compute_like() -> None:  # Python between small torch products, as a group's compute thread runs
    a, b = torch.randn(256, 256), torch.randn(2, 256)
    while not stop.is_set():
        x = 0
        for i in range(200):
            x += i
        b @ a

worker = threading.Thread(target=compute_like)
if busy:
    worker.start()
try:
    cpu, wall = loops.run(main())
finally:
    stop.set()
    if busy:
        worker.join()
    backend.close()
print(json.dumps({"cpu_us": cpu / reads * 1e6, "wall_us": wall / reads * 1e6}))
"""


def run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    # -P: the tree's package, not the current folder's (``-c`` would put the current folder first)
    argv = [
        sys.executable,
        "-P",
        "-c",
        _CHILD,
        args.store,
        args.link_gbps,
        str(args.reads),
        str(args.in_flight),
    ]
    argv.append("busy" if args.busy else "alone")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="folder holding the old runahead package")
    parser.add_argument("--after", type=Path, default=Path("."), help="folder holding the new one")
    parser.add_argument("--store", default="host", choices=["host", "disk"])
    parser.add_argument("--link-gbps", default="none", help="a link cap in GB/s, or none")
    parser.add_argument("--reads", type=int, default=4000)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--busy", action="store_true", help="a thread running Python between small torch products meanwhile"
    )
    args = parser.parse_args()
    trees = {"before": args.before, "after": args.after}
    best: dict[str, dict[str, float]] = {}
    for round_ in range(args.rounds):
        for name in list(trees) if round_ % 2 == 0 else list(trees)[::-1]:
            result = run(trees[name], args)
            cpu, wall = result["cpu_us"], result["wall_us"]
            print(f"round {round_} {name:>6}: {cpu:6.1f} us loop CPU a read, {wall:6.1f} us wall")
            if name not in best or result["cpu_us"] < best[name]["cpu_us"]:
                best[name] = result
    before, after = best["before"], best["after"]
    print(
        f"least loop CPU a read: before {before['cpu_us']:.1f} us, after {after['cpu_us']:.1f} us "
        f"(after / before {after['cpu_us'] / before['cpu_us']:.2f}); wall a read {before['wall_us']:.1f} -> "
        f"{after['wall_us']:.1f} us ({args.store} store, link {args.link_gbps}, {args.in_flight} in flight"
        f"{', a busy thread beside it' if args.busy else ''})"
    )


if __name__ == "__main__":
    main()
