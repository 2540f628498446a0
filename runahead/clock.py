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
import contextvars
import functools
import heapq
import math
import selectors
import time
import types
from asyncio import base_events, events, format_helpers, futures
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")

TICKS_PER_S = 1_000_000
"""Virtual time advances in whole microseconds (integer arithmetic: no float drift)."""


class Clock:
    """Reads and waits on the running loop's time."""

    def now(self) -> float:
        """Seconds on the loop's clock: virtual on a :class:`VirtualTimeLoop`, else the monotonic clock.

        NOTE (why not every loop's ``time()``): asyncio's is ``time.monotonic()``, but uvloop's (the
        real-time runs' loop where installed) counts whole milliseconds, libuv's loop time: an expert
        read of 3 ms, or a group of 6, measured to the millisecond is off by a third. Every real
        loop's timers run on the monotonic clock, so waits computed from these readings agree.
        """
        loop = asyncio.get_running_loop()  # reader()'s choice, inlined: the sim reads per event
        return loop.time() if isinstance(loop, VirtualTimeLoop) else time.monotonic()

    def reader(self) -> Callable[[], float]:
        """What :meth:`now` calls on the running loop, for an actor to hold for its run (a call
        fewer per reading on the hot path): the loop's ``time`` on a :class:`VirtualTimeLoop`,
        else ``time.monotonic``."""
        loop = asyncio.get_running_loop()
        return loop.time if isinstance(loop, VirtualTimeLoop) else time.monotonic

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of loop time.

        Yields once even for zero, unless the loop is a :class:`VirtualTimeLoop` with nothing else
        to run before this task would resume (:meth:`VirtualTimeLoop.quiet`): that yield would
        change nothing but cost a loop iteration and a task step.

        NOTE (why not ``asyncio.sleep`` on a virtual-time loop): a simulated run sleeps for every
        read and every compute. ``asyncio.sleep`` cancels its timer even after it ran, which goes
        through the loop's debug check; this is the same timer, due at the same time, with the
        same callback, cancelled only if the wait is.
        """
        loop = asyncio.get_running_loop()
        if not isinstance(loop, VirtualTimeLoop):
            await asyncio.sleep(max(0.0, seconds))
        elif seconds <= 0:
            if not loop.quiet():
                await _yield()
        else:
            future = loop.create_future()
            timer = loop.call_at(loop.time() + seconds, _set_result_unless_cancelled, future, None)
            try:
                await future
            except BaseException:
                timer.cancel()
                raise

    async def sleep_until(self, deadline: float) -> None:
        """Wait until the loop's clock reads ``deadline``."""
        await self.sleep(deadline - self.now())


@types.coroutine
def _yield() -> Generator[None, None, None]:
    """One bare yield to the loop (what ``asyncio.sleep(0)`` does)."""
    yield


_set_result_unless_cancelled: Callable[[asyncio.Future[None], None], None] = (
    futures._set_result_unless_cancelled  # type: ignore[attr-defined]
)


class SimulationStalled(RuntimeError):
    """Every task waited with nothing scheduled: in virtual time, nothing could ever happen again."""


def wait_ticks(timeout: float) -> int:
    """Whole ticks a wait of ``timeout`` seconds advances the virtual clock: rounded up (minus float
    noise), so the timer that set ``timeout`` is due; at least one unless the wait is zero."""
    return 0 if timeout == 0 else max(1, math.ceil(timeout * TICKS_PER_S - 1e-3))


class _VirtualSelector(selectors.DefaultSelector):
    """A wait for ``timeout`` advances the virtual clock instead; real I/O is polled (without
    waiting) only when nothing at all is scheduled, just before declaring the run stalled.

    With ``charge_cpu``, every poll first advances the clock by the CPU time this thread spent
    since the previous poll (the callbacks the loop just ran), so the runtime's own work takes
    virtual time, serially, as it does on a real machine's event loop thread; ``charge_scale``
    times it (a host whose cores run the runtime's Python that many times slower). The charge's own work
    is left out: each interval between two polls holds one poll's clock reading and arithmetic,
    ``poll_ns`` (measured once per process; ~2-3 us on a virtual machine where reading the thread's
    CPU clock is a system call), which a loop that does not charge never does.
    """

    def __init__(self, charge_cpu: bool = False, charge_scale: float = 1.0) -> None:
        super().__init__()
        self.ticks = 0
        self.charge_cpu = charge_cpu
        self.charge_scale = charge_scale
        self.charged_ticks = 0  # virtual time that was CPU time of the loop's callbacks
        self.poll_ns = _poll_cost_ns() if charge_cpu else 0
        self._cpu_ns: int | None = None
        self._carry_ns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        charged = self._charge() if self.charge_cpu else 0
        if timeout is not None:
            # Nothing in a simulation waits on real I/O (a thread's call_soon_threadsafe queues its
            # callback before it writes the wake-up pipe), so the clock moves without a syscall,
            # in whole ticks (wait_ticks); time already charged counts towards the wait.
            self.ticks += max(0, wait_ticks(timeout) - charged)
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
        self._carry_ns += round(max(0, now - self._cpu_ns - self.poll_ns) * self.charge_scale)
        self._cpu_ns = now
        ticks, self._carry_ns = divmod(self._carry_ns, 1_000_000_000 // TICKS_PER_S)
        self.ticks += ticks
        self.charged_ticks += ticks
        return ticks


def check_charge_scale(scale: float) -> None:
    """Raise ``ValueError`` unless ``scale`` is a finite factor above 0 for the charged CPU time."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the charged CPU time's scale must be a finite number above 0, got {scale}")


@functools.cache
def _poll_cost_ns(polls: int = 500, rounds: int = 5) -> int:
    """CPU time one charging poll (``select(0)``: a clock reading and the charge's arithmetic) costs
    this thread, with nothing charged for it: the least per poll of ``rounds`` rounds."""
    probe = _VirtualSelector()  # not charging itself: no calibration of its own
    probe.charge_cpu = True
    try:
        costs = []
        for _ in range(rounds):
            start = time.thread_time_ns()
            for _ in range(polls):
                probe.select(0)
            costs.append((time.thread_time_ns() - start) // polls)
    finally:
        probe.close()
    return min(costs)


_base: Any = base_events  # its constants are not in the type stubs
_MIN_SCHEDULED: int = _base._MIN_SCHEDULED_TIMER_HANDLES
_MIN_CANCELLED_FRACTION: float = _base._MIN_CANCELLED_TIMER_HANDLES_FRACTION
_MAX_TIMEOUT: float = _base.MAXIMUM_SELECT_TIMEOUT


class _Handle(events.Handle):
    """``asyncio.Handle`` built without asking the loop for its debug flag (debug loops use asyncio's)."""

    __slots__ = ()

    def __init__(
        self,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        context: contextvars.Context | None,
    ) -> None:
        self._context = contextvars.copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None


class _TimerHandle(events.TimerHandle):
    """``asyncio.TimerHandle`` built the same lean way (ordered by ``when`` as asyncio's)."""

    __slots__ = ()

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        context: contextvars.Context | None,
    ) -> None:
        _Handle.__init__(self, callback, args, loop, context)  # type: ignore[arg-type]
        self._when = when
        self._scheduled = False


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time starting at 0: waits take no wall time. No threads in it.

    ``charge_cpu``: the loop's own CPU time (times ``charge_scale``) also advances the clock (see
    :class:`_VirtualSelector`); runs are then no longer identical from one run to the next.

    NOTE (why it overrides asyncio's private loop methods): a simulated run is nothing but callbacks,
    several per job, so the loop's own bookkeeping per callback is a large part of a run's CPU.
    ``call_soon``, ``call_at`` and ``_run_once`` are asyncio's, minus what a loop without I/O
    or debugging does not need (a debug check per handle, a selector poll per iteration while
    callbacks are ready, one method call per callback run). They queue, order and run callbacks
    exactly as asyncio's do, so every run's events are the same; a loop in debug mode uses
    asyncio's own methods.

    Its timer heap (asyncio's ``_scheduled``) holds ``(when, timer)`` pairs instead of timers, so a
    heap step compares two floats in C instead of calling ``TimerHandle.__lt__`` in Python. Every
    comparison has the same outcome (a pair compares its timers only when their times are equal,
    and then, as the timers themselves would, says "not less"), so the heap holds the timers in the
    same places and pops them in the same order. In debug mode the heap holds timers, as asyncio's
    methods expect (:meth:`set_debug` converts it either way).
    """

    def __new__(cls, charge_cpu: bool = False, charge_scale: float = 1.0) -> VirtualTimeLoop:
        check_charge_scale(charge_scale)  # before a loop exists: a half-built one fails in __del__
        return super().__new__(cls)

    def __init__(self, charge_cpu: bool = False, charge_scale: float = 1.0) -> None:
        self._virtual = _VirtualSelector(charge_cpu, charge_scale)
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.ticks / TICKS_PER_S

    @property
    def charged_s(self) -> float:
        """Virtual seconds that were the loop's own CPU time (0 unless ``charge_cpu``)."""
        return self._virtual.charged_ticks / TICKS_PER_S

    def quiet(self) -> bool:
        """Whether a task yielding now would be the next thing to run: no callback is ready, no
        timer is due at this instant, the loop is not stopping (and not in debug mode).

        Then the yield changes no order of events (and no virtual time), so a caller may skip it.
        """
        loop: Any = self
        if loop._ready or loop._stopping or loop._debug:
            return False
        scheduled = loop._scheduled
        return not scheduled or scheduled[0][0] >= self.time() + loop._clock_resolution

    def set_debug(self, enabled: bool) -> None:
        super().set_debug(enabled)
        loop: Any = self
        if enabled:  # asyncio's methods from now on: a heap of timers
            loop._scheduled = [entry[1] if isinstance(entry, tuple) else entry for entry in loop._scheduled]
        else:
            loop._scheduled = [
                entry if isinstance(entry, tuple) else (entry._when, entry) for entry in loop._scheduled
            ]

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> events.Handle:
        if self._debug or self._closed:  # type: ignore[attr-defined]
            return super().call_soon(callback, *args, context=context)
        handle = _Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> events.TimerHandle:
        if self._debug or self._closed or when is None:  # type: ignore[attr-defined]
            return super().call_at(when, callback, *args, context=context)
        timer = _TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._scheduled, (when, timer))  # type: ignore[attr-defined]
        timer._scheduled = True
        return timer

    def call_later(  # type: ignore[override]
        self,
        delay: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> events.TimerHandle:
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self.time() + delay, callback, *args, context=context)

    def _run_once(self) -> None:
        """asyncio's ``_run_once``, repeated until the loop is stopping: drop cancelled timers, wait
        (advance the clock), move due timers to the ready queue, run the callbacks that were ready
        at the iteration's start; then the next iteration.

        ``run_forever`` calls ``_run_once`` again until ``_stopping`` is set after one; iterating
        here, with the same test after each iteration, runs the same iterations without a method
        call and this prologue per iteration. It returns to asyncio's own method when debug mode is
        turned on.
        """
        loop: Any = self  # asyncio's private attributes are not typed
        if loop._debug:
            super()._run_once()  # type: ignore[misc]
            return
        ready = loop._ready
        selector = self._virtual
        resolution = loop._clock_resolution
        heappop = heapq.heappop
        charging = selector.charge_cpu
        while True:
            scheduled: list[Any] = loop._scheduled
            count = len(scheduled)
            if count > _MIN_SCHEDULED and loop._timer_cancelled_count / count > _MIN_CANCELLED_FRACTION:
                kept = []
                for entry in scheduled:
                    if entry[1]._cancelled:
                        entry[1]._scheduled = False
                    else:
                        kept.append(entry)
                heapq.heapify(kept)
                scheduled = loop._scheduled = kept
                loop._timer_cancelled_count = 0
            else:
                while scheduled and scheduled[0][1]._cancelled:
                    loop._timer_cancelled_count -= 1
                    heappop(scheduled)[1]._scheduled = False
            if ready or loop._stopping:
                if charging:
                    selector.select(0)  # charges the CPU time; no I/O happens in a simulation
            elif scheduled:
                timeout = min(max(0, scheduled[0][0] - selector.ticks / TICKS_PER_S), _MAX_TIMEOUT)
                if charging:
                    selector.select(timeout)
                else:  # the selector's wait without its method call: nothing to charge
                    selector.ticks += wait_ticks(timeout)
            else:
                loop._process_events(selector.select(None))
            end_time = selector.ticks / TICKS_PER_S + resolution  # self.time(), inlined
            while scheduled:
                if scheduled[0][0] >= end_time:
                    break
                timer = heappop(scheduled)[1]
                timer._scheduled = False
                ready.append(timer)
            for _ in range(len(ready)):
                handle = ready.popleft()
                if handle._cancelled:
                    continue
                try:
                    handle._context.run(handle._callback, *handle._args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as error:  # as asyncio.Handle._run
                    callback = format_helpers._format_callback_source(handle._callback, handle._args)
                    message = f"Exception in callback {callback}"
                    context = {"message": message, "exception": error, "handle": handle}
                    if handle._source_traceback:
                        context["source_traceback"] = handle._source_traceback
                    self.call_exception_handler(context)
            handle = None  # break cycles when an exception occurs
            if loop._stopping or loop._debug:
                return


def run_virtual(
    main: Callable[[], Coroutine[Any, Any, T]], *, charge_cpu: bool = False, charge_scale: float = 1.0
) -> T:
    """Run ``main()`` on a fresh :class:`VirtualTimeLoop` and return its result.

    ``charge_cpu``: advance virtual time by the CPU time the loop's callbacks (the actors, the
    backend) spend, times ``charge_scale``, as :class:`VirtualTimeLoop` describes.
    """
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(charge_cpu, charge_scale)) as runner:
        return runner.run(main())
