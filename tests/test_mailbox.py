"""The actors' Mailbox behaves as asyncio.Queue does, task step for step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runahead.mailbox import Mailbox


def _queue_script(make: Any) -> list[str]:
    """Two producers and one reader interleaving puts and gets; the order in which steps ran."""
    log: list[str] = []

    async def main() -> None:
        box = make()

        async def reader() -> None:
            while (item := await box.get()) is not None:
                log.append(f"got {item}")
                if item % 3 == 0:
                    await asyncio.sleep(0)
                    log.append(f"after {item}")

        async def producer(name: str, items: range) -> None:
            for item in items:
                box.put_nowait(item)
                log.append(f"{name} put {item}")
                if item % 2:
                    await asyncio.sleep(0)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(reader())
            await asyncio.sleep(0)
            tasks.create_task(producer("a", range(0, 10)))
            tasks.create_task(producer("b", range(10, 20)))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            log.append("main")
            for _ in range(12):
                await asyncio.sleep(0)
            box.put_nowait(None)

    asyncio.run(main())
    return log


def test_mailbox_runs_tasks_in_the_order_asyncio_queue_does() -> None:
    expected = _queue_script(lambda: asyncio.Queue(100))
    assert _queue_script(lambda: Mailbox(100)) == expected
    assert sum(line.startswith("got") for line in expected) == 20


def test_mailbox_is_bounded_fifo_with_one_reader() -> None:
    async def main() -> None:
        box: Mailbox[int] = Mailbox(2)
        box.put_nowait(1)
        box.put_nowait(2)
        assert box.full() and box.qsize() == 2
        with pytest.raises(asyncio.QueueFull):
            box.put_nowait(3)
        assert [box.get_nowait(), await box.get()] == [1, 2]
        assert box.empty()
        with pytest.raises(asyncio.QueueEmpty):
            box.get_nowait()
        first = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await box.get()
        box.put_nowait(7)
        assert await first == 7
        cancelled = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        box.put_nowait(8)  # a cancelled reader leaves no stale waiter behind
        assert await box.get() == 8

    asyncio.run(main())
