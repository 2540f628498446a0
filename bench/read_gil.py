"""How often real expert reads make a compute thread wait for the GIL, and what that costs its CPU.

A compute-like thread runs "groups" of 40 small torch products (``[1, 256] x [256, 1024]``, each a
call that gives the GIL up and takes it back) while the event loop reads experts through the real
``DiskStore`` (``O_DIRECT`` where the filesystem takes it, 4 reads in flight). Reported per mode: the
reads' wall time, how often the compute thread blocked (voluntary context switches from
``getrusage(RUSAGE_THREAD)``: waits for the GIL) per read, and its CPU time a group.

Modes: ``none`` (no reads: the group's own CPU), ``full`` (the store's reads on its Python reader
threads: ``preadv`` into the reader's aligned buffer, then the copies into the slot), ``preadv-only``
(the same reads without the copies: what the copies add), ``native`` (the same reads and copies on
the store's C threads, :mod:`runahead.store.native`: what the Python threads add).

    RUNAHEAD_CACHE=<dir> python bench/read_gil.py --mode none,full,preadv-only,native --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import threading
import time
from typing import Any

import torch

from runahead.models.loader import load_model
from runahead.store.disk import DiskStore
from runahead.torchbench import resolve_model

MODES = ("none", "full", "preadv-only", "native")


def _blocks() -> int:
    """This thread's voluntary context switches so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def measure(path: str, mode: str, reads: int, idle_s: float = 0.6) -> dict[str, Any]:
    """One round of ``mode``: the reads (or ``idle_s`` of none) beside the compute-like thread."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    _, layout = load_model(path)
    store = DiskStore(layout, native=mode == "native")
    if mode == "preadv-only":
        files = store._files

        def bare(key: tuple[int, int], slot: torch.Tensor, after: Any) -> None:
            for run in store._plans[key]:
                files.read(run)

        store._read_blocking = bare  # type: ignore[method-assign]
    keys = sorted(layout.ranges)
    stop = threading.Event()
    found: dict[str, float] = {}

    def compute() -> None:
        w, x = torch.randn(1024, 256), torch.randn(1, 256)
        blocks, cpu, groups = _blocks(), time.thread_time(), 0
        while not stop.is_set():
            for _ in range(40):
                x @ w.T
            groups += 1
        found.update(blocks=_blocks() - blocks, cpu=time.thread_time() - cpu, groups=groups)

    async def read_all() -> float:
        slots = [torch.empty(layout.slot_numel) for _ in range(4)]
        gate = asyncio.Semaphore(4)

        async def one(i: int) -> None:
            async with gate:
                await store.read_into(*keys[i % len(keys)], slots[i % 4])

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(reads)))
        return time.perf_counter() - start

    thread = threading.Thread(target=compute, name="compute-like")
    thread.start()
    time.sleep(0.2)
    try:
        if mode == "none":
            time.sleep(idle_s)
            wall, done = idle_s, 0
        else:
            wall, done = asyncio.run(read_all()), reads
    finally:
        stop.set()
        thread.join()
        store.close()
    return {
        "mode": mode,
        "reads": done,
        "wall_s": wall,
        "groups": int(found["groups"]),
        "blocks": int(found["blocks"]),
        "blocks_per_read": found["blocks"] / done if done else None,
        "cpu_us_per_group": found["cpu"] / max(1, found["groups"]) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mode", default=",".join(MODES), help="comma-separated, run in this order")
    parser.add_argument("--reads", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one compute thread, as the torch backend runs on two cores
    path = resolve_model(args.model)
    for _ in range(args.rounds):
        for mode in args.mode.split(","):
            row = measure(path, mode, args.reads)
            per_read = "-" if row["blocks_per_read"] is None else f"{row['blocks_per_read']:.2f}"
            print(
                f"{mode:<12} {row['reads']:>5} reads in {row['wall_s']:.2f} s; compute-like thread:"
                f" {row['blocks']} blocks ({per_read} a read), {row['cpu_us_per_group']:.0f} us CPU a group"
            )


if __name__ == "__main__":
    main()
