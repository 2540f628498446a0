"""How exactly the store's link cap (``--link-gbps``) paces reads: landing time against link time.

One expert-sized copy from host memory at a time on an idle link (a gap of 0-0.8 ms before each,
so reads start at every point of a millisecond), then ``--depth`` reads kept in flight on a busy
link; on asyncio's loop and uvloop's, through the C readers and the Python read threads. Prints
each read's time from the call to its landing (percentiles, and how many landed before their link
time) and the busy link's rate against the cap.

    python bench/link_pacing.py                        # this tree
    PYTHONPATH=/tmp/before python -P bench/link_pacing.py   # another tree's runahead package
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import time
from typing import Any

from runahead.loops import loop_factory
from runahead.store import native
from runahead.store.base import _Executor


def _copy(dst: Any, src: Any, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


async def measure(nbytes: int, gbps: float, reads: int, depth: int, c_readers: bool) -> dict[str, float]:
    src = (ctypes.c_char * nbytes)()
    slots = [(ctypes.c_char * nbytes)() for _ in range(depth)]
    executor = _Executor(depth, "pacing", link_bandwidth=gbps * 1e9)
    pool = native.NativeReads(depth, {}, set(), native.ALIGNMENT, 0) if c_readers else None
    plan = native.memory_plan(ctypes.addressof(src), nbytes)

    async def one(k: int) -> None:
        slot = slots[k % depth]
        if pool is not None:
            await executor.run_native(pool, plan, ctypes.addressof(slot), carries=nbytes)
        else:
            await executor.run(_copy, slot, src, nbytes, carries=nbytes)

    took = []
    for i in range(reads):
        start = time.monotonic()
        await one(0)
        took.append(time.monotonic() - start)
        spin = time.perf_counter()
        while time.perf_counter() - spin < 0.0001 * (i % 9):
            pass
    took.sort()
    gate = asyncio.Semaphore(depth)

    async def kept(k: int) -> None:
        async with gate:
            await one(k)

    start = time.monotonic()
    await asyncio.gather(*(kept(k) for k in range(reads)))
    busy = time.monotonic() - start
    if pool is not None:
        pool.close()
    executor.shutdown()
    ideal = nbytes / (gbps * 1e9)
    return {
        "ideal_ms": ideal * 1e3,
        "p10_ms": took[len(took) // 10] * 1e3,
        "median_ms": took[len(took) // 2] * 1e3,
        "p90_ms": took[len(took) * 9 // 10] * 1e3,
        "early": sum(t < ideal for t in took),
        "busy_gbps": reads * nbytes / busy / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=3.0, help="bytes a read, in MB (the medium model's ~3)")
    parser.add_argument("--gbps", type=float, default=3.0, help="the link cap")
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--depth", type=int, default=4, help="reads in flight on the busy link")
    args = parser.parse_args()
    nbytes = int(args.mb * 1e6)
    loops = {"asyncio": None, **({"uvloop": loop_factory()} if loop_factory() is not None else {})}
    paths = [True, False] if native.available() else [False]
    print(f"{'loop':8} {'readers':15} {'ideal ms':>9} {'p10':>7} {'median':>7} {'p90':>7} {'early':>7} {'busy GB/s':>10}")
    for name, factory in loops.items():
        for c_readers in paths:
            with asyncio.Runner(loop_factory=factory) as runner:
                row = runner.run(measure(nbytes, args.gbps, args.reads, args.depth, c_readers))
            print(
                f"{name:8} {'C' if c_readers else 'Python threads':15} {row['ideal_ms']:9.3f} {row['p10_ms']:7.3f}"
                f" {row['median_ms']:7.3f} {row['p90_ms']:7.3f} {row['early']:4}/{args.reads:<3}"
                f" {row['busy_gbps']:9.2f}"
            )


if __name__ == "__main__":
    main()
