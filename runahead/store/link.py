"""The link cap: every read of a store paced to a serial link of a given bandwidth.

:class:`LinkCap` is the arithmetic (when may a read complete); :func:`link_clock` the clock it is
kept on, which the reader threads sleep on (:class:`runahead.store.base._Executor`, the C readers
of :mod:`runahead.store.native`). Backends check a cap with :func:`check_link_bandwidth` before
they load a model.
"""

from __future__ import annotations

import math
import time


def check_link_bandwidth(bandwidth: object) -> float:
    """``bandwidth`` (bytes per second) as a float, or ValueError naming it: a link cap must be a
    positive finite number. Backends call it before loading a model, so a bad cap fails at once."""
    number = isinstance(bandwidth, (int, float)) and not isinstance(bandwidth, bool)
    if number and math.isfinite(bandwidth) and bandwidth > 0:  # type: ignore[arg-type, operator]
        return float(bandwidth)  # type: ignore[arg-type]
    raise ValueError(f"link bandwidth must be a positive number of bytes per second, got {bandwidth!r}")


class LinkCap:
    """A serial link of ``bandwidth`` bytes per second that every read of a store crosses.

    A read of ``nbytes`` occupies the link for ``nbytes / bandwidth`` seconds, after the reads
    reserved before it (a link moves one transfer at a time, in the order they start), and it
    completes no earlier than its transfer ends, however fast the store itself was. So a store read
    from a fast disk or host memory behaves like one behind a slower link (a device's NVMe or PCIe
    link; a steady yardstick where this machine's disk moves between minutes) while every byte
    still goes through the real read path. Pure arithmetic: the caller passes the time (on
    :func:`link_clock`).
    """

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = check_link_bandwidth(bandwidth)
        self._free_at = -math.inf

    def reserve(self, nbytes: int, now: float) -> float:
        """Reserve the link for a read of ``nbytes`` starting at ``now``; return when it may complete."""
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bandwidth
        return self._free_at


def link_clock() -> float:
    """Seconds on the clock the link cap keeps: ``CLOCK_MONOTONIC``, the clock the C readers sleep on
    (:mod:`runahead.store.native`), where the platform has it; else ``time.monotonic``.

    NOTE (why not the event loop's time and timers): uvloop's loop counts whole milliseconds and
    rounds a timer's delay to whole milliseconds, asyncio's selector waits at least one; an
    expert's read at a few GB/s is about a millisecond, so a read paced by the loop landed anywhere
    from 0.3 to 1.4 times its link time (``bench/link_pacing.py``). The reader thread that made the
    read holds it back instead, until the link's reservation ends, on this clock.
    """
    return time.clock_gettime(time.CLOCK_MONOTONIC) if _HAS_MONOTONIC else time.monotonic()


_HAS_MONOTONIC = hasattr(time, "CLOCK_MONOTONIC")
