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
import time
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
    """A wait for ``timeout`` advances the virtual clock instead; real I/O is polled (without
    waiting) only when nothing at all is scheduled, just before declaring the run stalled.

    With ``charge_cpu``, every poll first advances the clock by the CPU time this thread spent
    since the previous poll (the callbacks the loop just ran), so the runtime's own work takes
    virtual time, serially, as it does on a real machine's event loop thread.
    """

    def __init__(self, charge_cpu: bool = False) -> None:
        super().__init__()
        self.ticks = 0
        self.charge_cpu = charge_cpu
        self.charged_ticks = 0  # virtual time that was CPU time of the loop's callbacks
        self._cpu_ns: int | None = None
        self._carry_ns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        charged = self._charge() if self.charge_cpu else 0
        if timeout is not None:
            # Nothing in a simulation waits on real I/O (a thread's call_soon_threadsafe queues its
            # callback before it writes the wake-up pipe), so the clock moves without a syscall,
            # rounded up to whole ticks (minus float noise) so the timer that set ``timeout`` is due.
            wait = 0 if timeout == 0 else max(1, math.ceil(timeout * TICKS_PER_S - 1e-3))
            self.ticks += max(0, wait - charged)  # time already charged counts towards the wait
            return []
        ready = super().select(0)  # about to stall: real I/O is the last thing that could happen
        if ready:
            return ready
        raise SimulationStalled(
            "every task is waiting and nothing is scheduled: the simulated run can never finish "
            "(a deadlock, or a wait on something that is not simulated)"
        )

    def _charge(self) -> int:
        """Advance the clock by the CPU time spent since the previous poll; return the ticks added."""
        now = time.thread_time_ns()
        if self._cpu_ns is None:
            self._cpu_ns = now
            return 0
        self._carry_ns += now - self._cpu_ns
        self._cpu_ns = now
        ticks, self._carry_ns = divmod(self._carry_ns, 1_000_000_000 // TICKS_PER_S)
        self.ticks += ticks
        self.charged_ticks += ticks
        return ticks


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time starting at 0: waits take no wall time. No threads in it.

    ``charge_cpu``: the loop's own CPU time also advances the clock (see :class:`_VirtualSelector`);
    runs are then no longer identical from one run to the next.
    """

    def __init__(self, charge_cpu: bool = False) -> None:
        self._virtual = _VirtualSelector(charge_cpu)
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.ticks / TICKS_PER_S

    @property
    def charged_s(self) -> float:
        """Virtual seconds that were the loop's own CPU time (0 unless ``charge_cpu``)."""
        return self._virtual.charged_ticks / TICKS_PER_S


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]], *, charge_cpu: bool = False) -> T:
    """Run ``main()`` on a fresh :class:`VirtualTimeLoop` and return its result.

    ``charge_cpu``: advance virtual time by the CPU time the loop's callbacks (the actors, the
    backend) spend, as :class:`VirtualTimeLoop` describes.
    """
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(charge_cpu)) as runner:
        return runner.run(main())
