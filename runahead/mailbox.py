"""The actors' mailboxes: asyncio's queue, minus what one consumer does not need.

Every actor message goes through a mailbox, so its cost is paid per job. ``asyncio.Queue`` keeps a
list of getters, a task counter for ``join`` and an ``Event`` for it, and checks which loop it
is bound to on every ``get``; an actor's inbox has exactly one reader and nobody joins it.
:class:`Mailbox` keeps only the items and the one waiting reader, and wakes that reader exactly
when ``asyncio.Queue`` would (on the first put after it started waiting, through the same future
callback), so the order in which tasks run, and every decision the actors make, is unchanged.

An actor whose handling is synchronous (the JobIssuer, the ExpertFetcher's inbox) does not need a
task step per wake-up at all: :func:`serve` runs its handler from a plain loop callback, queued
where the reader task's wake-up would have been queued, so it runs at the same moment, at a
fraction of the cost (no future, no task step, no coroutine frames resumed).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class Outbox(Protocol[T_contra]):
    """Where an actor sends messages: a mailbox, or a :class:`Handoff` to one."""

    def put_nowait(self, item: T_contra) -> None: ...


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
        self._parked = False  # a callback reader (:meth:`serve`) waits for the next item
        self._drain: Callable[[], None] | None = None
        self._serve_loop: asyncio.AbstractEventLoop | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return 0 < self._bound <= len(self._items)

    def __iter__(self) -> Iterator[T]:
        """The queued items, oldest first (a look, not a read)."""
        return iter(self._items)

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
        elif self._parked:
            self._parked = False
            self._serve_loop.call_soon(self._drain)  # type: ignore[union-attr,arg-type]  # set with _parked

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> T:
        """The oldest item, waiting for one if the mailbox is empty."""
        items = self._items
        while not items:
            if self._reader is not None or self._drain is not None:
                raise RuntimeError("a mailbox has one reader; a second one is waiting on it")
            reader = self._reader = asyncio.get_running_loop().create_future()
            try:
                await reader
            finally:
                if self._reader is reader:
                    self._reader = None
        return items.popleft()

    async def serve(self, handle: Callable[[T], object]) -> None:
        """``while (item := await self.get()) is not None: handle(item)``, without a task step per wake-up.

        The items are handled by a loop callback queued on the first put after the mailbox ran
        empty: where the reader task's wake-up would be queued, so every item is handled at the
        same moment, in the same order. Returns once ``None`` is read; an exception from
        ``handle`` is raised from here; cancelling this coroutine stops the handling.
        """
        if self._reader is not None or self._drain is not None:
            raise RuntimeError("a mailbox has one reader; a second one is waiting on it")
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        items = self._items

        def drain() -> None:
            if finished.done():  # cancelled, or ended by an error
                return
            try:
                while items:
                    item = items.popleft()
                    if item is None:
                        finished.set_result(None)
                        return
                    handle(item)
            except Exception as error:
                finished.set_exception(error)
                return
            self._parked = True

        self._serve_loop, self._drain = loop, drain
        try:
            drain()
            await finished
        finally:
            self._parked = False
            self._drain = None

    def task_done(self) -> None:
        raise NotImplementedError("mailboxes are not joined")

    async def join(self) -> None:
        raise NotImplementedError("mailboxes are not joined")


class Handoff(Generic[T]):
    """A sender's end of a served mailbox (:meth:`Mailbox.serve`) that may call its handler at once.

    When the receiving actor is idle (parked, nothing queued) and nothing else is ready to run at
    this instant (``quiet``: :meth:`runahead.clock.VirtualTimeLoop.quiet`), queueing a message
    would run the receiver's handler next, then the sender when the reply wakes it, with nothing
    in between: :meth:`hand` calls the handler now instead, saving the loop iterations, the
    receiver's callback and the sender's task step, and changing no order of events. Otherwise the
    message is queued as usual.
    """

    __slots__ = ("handle", "mailbox", "quiet")

    def __init__(self, mailbox: Mailbox[T], handle: Callable[[T], object], quiet: Callable[[], bool]) -> None:
        self.mailbox = mailbox
        self.handle = handle
        self.quiet = quiet

    def put_nowait(self, message: T) -> None:
        """Queue ``message`` as usual."""
        self.mailbox.put_nowait(message)

    def hand(self, message: T) -> bool:
        """Handle ``message`` now if that is exactly what would happen next, else queue it; True if handled.

        After True the caller must do nothing before its next wait but what the reply would have
        made it do, and must first yield once if the handler left anything else to run (``quiet()``
        false again): that puts it behind those callbacks, where the reply's wake-up would have been.
        """
        box = self.mailbox
        if box._parked and not box._items and self.quiet():
            self.handle(message)
            return True
        box.put_nowait(message)
        return False


async def serve(inbox: asyncio.Queue[T], handle: Callable[[T], object]) -> None:
    """Handle every item of ``inbox`` until ``None``: :meth:`Mailbox.serve`, or a plain queue's loop."""
    if isinstance(inbox, Mailbox):
        await inbox.serve(handle)
        return
    while (item := await inbox.get()) is not None:
        handle(item)
