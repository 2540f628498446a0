"""The virtual-time loop's timer heap: the same timers in the same order as asyncio's own."""

from __future__ import annotations

import asyncio
import heapq
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from runahead.clock import Clock, VirtualTimeLoop, run_virtual
from runahead.loops import loop_factory


def _noop(*args: object) -> None:
    pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.none()), max_size=60))
def test_a_heap_of_when_timer_pairs_pops_what_a_heap_of_timers_pops(ops: list[int | None]) -> None:
    """Pushes at a few times (many ties, some timers equal as asyncio compares them) and pops, at
    random: both heaps hold the same timers in the same places and pop them in the same order."""
    loop = asyncio.new_event_loop()
    try:
        timers: list[asyncio.TimerHandle] = []
        pairs: list[tuple[float, asyncio.TimerHandle]] = []
        for index, op in enumerate(ops):
            if op is None:
                if timers:
                    assert heapq.heappop(timers) is heapq.heappop(pairs)[1]
                continue
            args = (index % 3,) if index % 2 else ()  # equal callbacks and args: timers that compare equal
            timer = asyncio.TimerHandle(op * 0.25, _noop, args, loop)
            heapq.heappush(timers, timer)
            heapq.heappush(pairs, (timer.when(), timer))
            assert all(a is b for a, (_, b) in zip(timers, pairs, strict=True))
    finally:
        loop.close()


def _order_of_callbacks(
    debug: bool, debug_from: int | None = None, debug_until: int | None = None
) -> list[tuple[float, int]]:
    """Timers at colliding times, some cancelled, some set from callbacks; debug mode (asyncio's own
    loop methods) on from the start, or switched on and off by callbacks ``debug_from`` and
    ``debug_until``."""
    loop = VirtualTimeLoop()
    loop.set_debug(debug)
    order: list[tuple[float, int]] = []

    def fire(index: int) -> None:
        order.append((loop.time(), index))
        if index == debug_from:
            loop.set_debug(True)
        if index == debug_until:
            loop.set_debug(False)
        if index % 4 == 0 and index < 40:
            loop.call_later(0.001 * (index % 3), fire, 100 + index)
            loop.call_soon(fire, 200 + index)

    async def main() -> None:
        timers = [loop.call_at(0.001 * (i % 5), fire, i) for i in range(30)]
        for timer in timers[3::7]:
            timer.cancel()
        await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return order


def test_the_virtual_loop_runs_timers_in_asyncios_order_with_debug_on_off_or_switched() -> None:
    asyncio_order = _order_of_callbacks(debug=True)  # asyncio's methods all along
    assert len(asyncio_order) > 30 and len({time for time, _ in asyncio_order}) < len(asyncio_order) / 3
    assert _order_of_callbacks(debug=False) == asyncio_order  # the loop's own methods
    assert _order_of_callbacks(debug=False, debug_from=8, debug_until=16) == asyncio_order  # switched


def test_the_clock_reads_below_a_millisecond_on_every_real_loop_and_virtual_time_on_the_sim() -> None:
    """uvloop's ``time()`` counts whole milliseconds; the clock must not (reads and groups take a few)."""

    async def readings() -> list[float]:
        clock, values = Clock(), []
        for i in range(20):
            values.append(clock.now() if i % 2 else clock.reader()())  # the same clock, two ways
            spin = time.monotonic() + 0.0001
            while time.monotonic() < spin:
                pass
        return values

    for factory in {loop_factory(), None}:  # uvloop's (where installed) and asyncio's
        with asyncio.Runner(loop_factory=factory) as runner:
            values = runner.run(readings())
        assert len(set(values)) >= 15, factory
        assert values == sorted(values)
    assert set(run_virtual(readings)) == {0.0}  # busy work takes no virtual time
