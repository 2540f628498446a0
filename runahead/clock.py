"""Time for the actors: the event loop's clock, real or virtual.

The engine never reads the wall clock itself: actors ask a :class:`Clock`, which reads the running
loop's ``time()``. On a normal loop that is monotonic real time. On a :class:`VirtualTimeLoop`
time jumps to the next scheduled timer whenever every task waits, so the ``sim`` backend's
modelled durations cost no wall time and every run is reproducible to the microsecond.

Why not ``looptime`` (the library the issue pointed at): it works, and gave identical results,
but it is built for tests that mix fake and real time: every loop iteration scans its executor
futures and syncs real time, which cost a third of a simulated run's wall time, and a deadlock
makes it wait real time and then inject timeouts into every task. The simulation needs neither:
:class:`VirtualTimeLoop` is a selector loop whose selector advances an integer microsecond clock
instead of sleeping, and raises :class:`SimulationStalled` at once when nothing can ever happen.
"""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

TICKS_PER_S = 1_000_000
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
    """Every task waited with nothing scheduled: in virtual time, nothing could ever happen again."""


class _VirtualSelector(selectors.DefaultSelector):
    """Polls real I/O without waiting; a wait for ``timeout`` advances the virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout == 0:
            return []  # callbacks are ready: poll real I/O only when the clock would move
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise SimulationStalled(
                "every task is waiting and nothing is scheduled: the simulated run can never finish "
                "(a deadlock, or a wait on something that is not simulated)"
            )
        # Round up to whole ticks (minus float noise) so the timer that set ``timeout`` is due.
        self.ticks += max(1, math.ceil(timeout * TICKS_PER_S - 1e-3))
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time starting at 0: waits take no wall time. No threads in it."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.ticks / TICKS_PER_S


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` on a fresh :class:`VirtualTimeLoop` and return its result."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main())
