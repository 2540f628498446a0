"""Time for the actors: the event loop's clock, real or virtual.

The engine never reads the wall clock itself: actors ask a :class:`Clock`, which reads the running
loop's ``time()``. On a normal loop that is monotonic real time. On a *virtual-time* loop (from
``looptime``) time jumps to the next scheduled timer whenever every task waits, so the ``sim``
backend's modelled durations cost no wall time and every run is reproducible to the microsecond.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

RESOLUTION_S = 1e-6
"""Virtual time advances in whole microseconds (integer arithmetic: no float drift)."""


class Clock:
    """Reads and waits on the running loop's time."""

    def now(self) -> float:
        """Seconds on the loop's clock (virtual on a virtual-time loop)."""
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of loop time (yields once even for zero)."""
        await asyncio.sleep(max(0.0, seconds))

    async def sleep_until(self, deadline: float) -> None:
        """Wait until the loop's clock reads ``deadline``."""
        await asyncio.sleep(max(0.0, deadline - self.now()))


class SimulationStalled(RuntimeError):
    """Every task waited with nothing scheduled: a deadlock in virtual time."""


def virtual_loop_factory(stall_after_s: float = 0.5) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of virtual-time event loops (looptime) for :func:`asyncio.Runner`.

    If every task waits with no timer pending (nothing could ever happen again), the tasks get an
    error after ``stall_after_s`` real seconds instead of hanging.
    """
    import looptime

    def factory() -> asyncio.AbstractEventLoop:
        loop: asyncio.AbstractEventLoop = looptime.new_event_loop(
            start=0.0,
            noop_cycles=0,
            resolution=RESOLUTION_S,
            idle_step=stall_after_s / 5,
            idle_timeout=stall_after_s,
        )
        return loop

    return factory


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]], stall_after_s: float = 0.5) -> T:
    """Run ``main()`` on a fresh virtual-time loop starting at t=0 and return its result."""
    with asyncio.Runner(loop_factory=virtual_loop_factory(stall_after_s)) as runner:
        return runner.run(main())
