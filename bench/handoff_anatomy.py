"""Where a torch group's hand-offs go: the hop to the compute thread, the hop back, the loop between.

Runs one torch bench point with every group the compute thread runs timed at four moments: the loop
hands it over (``run_in_executor``), the thread starts it, the thread ends it, the loop resumes with
its results. Printed (medians, means, 90th percentiles, after the first fifth of the groups):

- *dispatch*: hand-over to the thread's start (its wake-up, then the GIL it waits for);
- *return*: the thread's end to the loop resuming (the loop's wake-up, its queue, the GIL);
- *loop gap*: the loop resuming to its next hand-over (handling the results, deciding the next group;
  long where nothing is ready: reads to land);
- *thread idle*: the compute thread's end of one group to its start of the next (all three);
- *loop CPU in a hand-off*: the event loop thread's CPU time from a hand-over to its resuming (read
  landings and submits it handled meanwhile, and its own part of the two hops).

``--pair`` (Linux) puts the event loop and the compute thread on the first core and every other
thread of the process (the store's readers) on the others, once the first group runs: a thread woken
on a core that was idle waits for that core to wake (~50-75 us on a 2-vCPU VM, against ~10 us for
one still polling), and paired threads wake each other on a core that is busy.

    python bench/handoff_anatomy.py --policy runahead/grouping=bottleneck --concurrency 4 \\
        --cache-fraction 0.7 [--pair] [--no-inline]

Groups computed on the loop's own thread (``compute_inline``, the link idle) have no hand-off and are
not counted; ``--no-inline`` sends every group to the compute thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from group_cost import point_arguments, point_of  # bench/ is this script's folder: its sys.path[0]
from idle_gaps import spread

from runahead.backends import common
from runahead.jobs import Group, JobResult
from runahead.torchbench import TorchPoint, run_torch_point

Marks = list[tuple[float, float, float, float, float]]
"""Per group: hand-over, thread start, thread end, loop resumed (perf_counter seconds), and the
loop's CPU seconds from hand-over to resuming."""


def _pair(compute_tid: int) -> None:
    """The loop (this thread) and the compute thread on the first core; the process's other threads
    on the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return
    mine = {threading.get_native_id(), compute_tid}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, {cores[0]} if tid in mine else set(cores[1:]))


def timed_handoffs(point: TorchPoint, pair: bool) -> tuple[dict[str, Any], Marks]:
    """Run ``point`` with its hand-offs timed; its bench row, and the marks of every group."""
    marks: Marks = []
    thread: dict[str, float] = {}
    paired: list[bool] = []
    timed_compute, compute = common.RequestLifecycle._timed_compute, common.RequestLifecycle.compute

    def timed(self: Any, group: Group, inline: bool = False) -> list[JobResult]:
        if inline:
            return timed_compute(self, group, inline)
        thread["tid"], thread["start"] = threading.get_native_id(), time.perf_counter()
        try:
            return timed_compute(self, group, inline)
        finally:
            thread["end"] = time.perf_counter()

    async def handed(self: Any, group: Group) -> Sequence[JobResult]:
        if pair and not paired and "tid" in thread:
            _pair(int(thread["tid"]))
            paired.append(True)
        loop = asyncio.get_running_loop()
        handed_at, cpu = time.perf_counter(), time.thread_time()
        results: Sequence[JobResult] = await loop.run_in_executor(
            self._compute_thread, self._timed_compute, group
        )
        resumed = time.perf_counter()
        marks.append((handed_at, thread["start"], thread["end"], resumed, time.thread_time() - cpu))
        return results

    common.RequestLifecycle._timed_compute = timed  # type: ignore[method-assign]
    common.RequestLifecycle.compute = handed  # type: ignore[method-assign]
    try:
        row = run_torch_point(point)
    finally:
        common.RequestLifecycle._timed_compute = timed_compute  # type: ignore[method-assign]
        common.RequestLifecycle.compute = compute  # type: ignore[method-assign]
    return row, marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    point_arguments(
        parser,
        model="medium",
        store="host",
        link_gbps=3.0,
        cache_fraction=0.7,
        concurrency=4,
        steps=32,
        warmup_steps=8,
    )
    parser.add_argument("--pair", action="store_true", help="loop and compute thread on one core (Linux)")
    parser.add_argument("--no-inline", action="store_true", help="every group on the compute thread")
    args = parser.parse_args()
    point = point_of(args, preload=args.cache_fraction >= 1.0, inline_compute=not args.no_inline)
    row, marks = timed_handoffs(point, args.pair)
    kept = marks[len(marks) // 5 :]
    if len(kept) < 2:
        raise SystemExit("too few groups went to the compute thread to time (try --no-inline)")
    pairs = list(itertools.pairwise(kept))
    print(
        f"{args.policy}, {args.concurrency} requests, cache {args.cache_fraction}: {row['tokens_per_s']:.2f} tok/s, "
        f"compute {row['compute_dtype']}, {len(kept)} groups timed, hand-offs {row['handoff_us_per_group']:.0f} us "
        f"a group (the bench's measure){', loop and compute thread paired' if args.pair else ''}"
    )
    print("dispatch              ", spread([start - handed for handed, start, _, _, _ in kept]))
    print("return                ", spread([resumed - end for _, _, end, resumed, _ in kept]))
    print("loop gap              ", spread([b[0] - a[3] for a, b in pairs]))
    idle = [b[1] - a[2] for a, b in pairs]
    print("thread idle           ", spread(idle), f"({sum(idle):.2f} s in all)")
    print("loop CPU in a hand-off", spread([cpu for *_, cpu in kept]))


if __name__ == "__main__":
    main()
