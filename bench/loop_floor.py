"""What one event costs on the sim's virtual-time loop, alone: the floor under a job's cost.

Every job of a run is a few loop events (issue 14's counts: ~4 handles a job at zero cost). This
times each kind of event with nothing else to do, N times in a row on a fresh
:class:`runahead.clock.VirtualTimeLoop`, and prints microseconds of CPU per event (the least of three
runs): a callback queued by ``call_soon``, a task woken by a future another callback resolves, a
timed ``Clock.sleep`` (a timer, a future and the wake-up: every read and group of a run with costs),
and ``asyncio.sleep(0)``.

    python bench/loop_floor.py [--events 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from runahead.clock import Clock, VirtualTimeLoop

Body = Callable[[asyncio.AbstractEventLoop, int], Coroutine[Any, Any, None]]


async def callbacks(loop: asyncio.AbstractEventLoop, events: int) -> None:
    """``events`` callbacks, each queueing the next."""
    done = loop.create_future()
    left = [events]

    def step() -> None:
        left[0] -= 1
        if left[0]:
            loop.call_soon(step)
        else:
            done.set_result(None)

    loop.call_soon(step)
    await done


async def wake_ups(loop: asyncio.AbstractEventLoop, events: int) -> None:
    """A task waiting ``events`` times on a future a callback resolves."""
    for _ in range(events):
        future = loop.create_future()
        loop.call_soon(future.set_result, None)
        await future


async def timed_sleeps(loop: asyncio.AbstractEventLoop, events: int) -> None:
    """``events`` timed sleeps of the sim's clock (a timer, a future, a wake-up each)."""
    clock = Clock()
    for _ in range(events):
        await clock.sleep(1e-6)


async def bare_yields(loop: asyncio.AbstractEventLoop, events: int) -> None:
    """``events`` times ``asyncio.sleep(0)``."""
    for _ in range(events):
        await asyncio.sleep(0)


def cost_us(body: Body, events: int) -> float:
    """CPU microseconds per event of ``body`` on a fresh virtual-time loop (least of three runs)."""
    costs = []
    for _ in range(3):
        loop = VirtualTimeLoop()
        try:
            start = time.process_time()
            loop.run_until_complete(body(loop, events))
            costs.append((time.process_time() - start) / events * 1e6)
        finally:
            loop.close()
    return min(costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    args = parser.parse_args()
    for name, body in (
        ("call_soon callback", callbacks),
        ("task woken by a future", wake_ups),
        ("timed Clock.sleep", timed_sleeps),
        ("asyncio.sleep(0)", bare_yields),
    ):
        print(f"{name:28s} {cost_us(body, args.events):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
