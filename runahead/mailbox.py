"""The actors' mailboxes: asyncio's queue, minus what one consumer does not need.

Every actor message goes through a mailbox, so its cost is paid per job. ``asyncio.Queue`` keeps a
list of getters, a task counter for ``join`` and an ``Event`` for it, and checks which loop it
is bound to on every ``get``; an actor's inbox has exactly one reader and nobody joins it.
:class:`Mailbox` keeps only the items and the one waiting reader, and wakes that reader exactly
when ``asyncio.Queue`` would (on the first put after it started waiting, through the same future
callback), so the order in which tasks run, and every decision the actors make, is unchanged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(asyncio.Queue[T], Generic[T]):
    """A bounded FIFO with one reader: ``put_nowait``, ``get``, ``get_nowait``, ``empty``, ``qsize``.

    A subclass of ``asyncio.Queue`` so code typed for one takes it; ``put`` works (it never waits
    on a mailbox that is not full), ``join`` and ``task_done`` are not supported. A second reader
    waiting at the same time is an error, not a silent stall.
    """

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self._bound = maxsize
        self._items: deque[T] = deque()
        self._reader: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return 0 < self._bound <= len(self._items)

    def put_nowait(self, item: T) -> None:
        """Append ``item`` (``asyncio.QueueFull`` if the mailbox is full) and wake the reader."""
        items = self._items
        if 0 < self._bound <= len(items):
            raise asyncio.QueueFull
        items.append(item)
        reader = self._reader
        if reader is not None:
            self._reader = None
            if not reader.done():
                reader.set_result(None)

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> T:
        """The oldest item, waiting for one if the mailbox is empty."""
        items = self._items
        while not items:
            if self._reader is not None:
                raise RuntimeError("a mailbox has one reader; a second one is waiting on it")
            reader = self._reader = asyncio.get_running_loop().create_future()
            try:
                await reader
            finally:
                if self._reader is reader:
                    self._reader = None
        return items.popleft()

    def task_done(self) -> None:
        raise NotImplementedError("mailboxes are not joined")

    async def join(self) -> None:
        raise NotImplementedError("mailboxes are not joined")
