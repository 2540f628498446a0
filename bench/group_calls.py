"""Torch calls a decode group takes on the GPU's code path, counted on CPU (docs/cuda-runs.md).

On the first H200 run the compute thread was on a core for all of every group's time, and a group
cost about as many tens of microseconds as it made torch calls: the host's per-call time (Python,
dispatch, launch) set the pace, not the kernels. The calls can be counted anywhere: this runs the
torch backend on CPU with the CPU kernel off (``RUNAHEAD_QUANT_KERNEL=off``, as on a GPU, where torch
multiplies), every expert resident, and counts each group's torch operators (a dispatch mode on the
compute thread), with the experts' grouped products over the slot pool on and off
(runahead/models/pooled.py).

    python bench/group_calls.py [--model small] [--requests 1,2,8,16] [--us-per-call 25]

``--us-per-call``: the host's time a call, to turn counts into milliseconds a group (25: the first
H200 run's machine, docs/cuda-runs.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import sys
from pathlib import Path
from typing import Any

os.environ["RUNAHEAD_QUANT_KERNEL"] = "off"  # before runahead loads the kernel: torch multiplies, as on a GPU

from runahead.backends.torch import TorchBackend
from runahead.jobs import RequestSpec
from runahead.sampling import SamplingParams
from runahead.torchbench import resolve_model, warm_resident

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from modelhelpers import TorchCalls


def count(path: str, requests: int, grouped: bool, tokens: int = 8) -> tuple[float, collections.Counter[str]]:
    """Torch calls a group (mean over a decode of ``tokens`` tokens for ``requests`` requests), and
    the calls by operator over all groups."""
    backend = TorchBackend.open(path, cache_fraction=1.0, store="host")
    backend.model.use_slot_pool(backend.slots.data, grouped=grouped)
    inner, totals, groups = backend._compute, collections.Counter[str](), [0]

    def counted(group: Any) -> Any:  # runs on the compute thread: the dispatch mode is that thread's
        with TorchCalls() as mode:
            out = inner(group)
        totals.update(mode.calls)
        groups[0] += 1
        return out

    async def run() -> None:
        runtime = await warm_resident(backend, "sync", warmup=2)
        backend._compute = counted  # type: ignore[method-assign]
        specs = [
            RequestSpec(10 + r, tokens, prompt=(5 + r,), sampling=SamplingParams(max_tokens=tokens))
            for r in range(requests)
        ]
        await runtime.run(specs)

    try:
        asyncio.run(run())
    finally:
        backend.close()
    return sum(totals.values()) / groups[0], totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", default="1,2,8,16")
    parser.add_argument("--us-per-call", type=float, default=25.0)
    parser.add_argument("--top", type=int, default=0, help="also list the most called operators")
    args = parser.parse_args()
    path = resolve_model(args.model)
    head = f"{'requests':>8} {'loop':>8} {'grouped':>8} {'grouped/loop':>12}"
    print(f"{head}   host ms a group at {args.us_per_call:g} us a call")
    for n in (int(r) for r in args.requests.split(",")):
        looped, _ = count(path, n, False)
        gc.collect()  # a model a count (its compute hook holds it in a cycle): free it before the next loads
        grouped, ops = count(path, n, True)
        gc.collect()
        ms = args.us_per_call / 1e3
        ratio = grouped / looped
        print(f"{n:>8} {looped:>8.1f} {grouped:>8.1f} {ratio:>12.2f}   {looped * ms:.1f} -> {grouped * ms:.1f}")
        for op, c in ops.most_common(args.top):
            print(f"{'':>10}{op:<40} {c / sum(ops.values()) * grouped:6.1f} a group")


if __name__ == "__main__":
    main()
