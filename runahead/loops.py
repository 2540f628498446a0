"""The event loop real-time runs use: uvloop where it is installed (the ``uvloop`` extra), else asyncio's.

The actors, the engine and the server run unchanged on either (the engine tests run both). uvloop
cuts the loop's own cost per callback, which the runtime pays for every message between actors.
The sim does not use it: virtual time needs its own loop (:mod:`runahead.clock`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory when uvloop is installed, else None (asyncio's default loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new loop (uvloop's when installed) and return its result."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
