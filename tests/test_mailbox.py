"""The actors' Mailbox behaves as asyncio.Queue does, task step for step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runahead.clock import run_virtual
from runahead.mailbox import Handoff, Mailbox, serve


def _queue_script(make: Any, reader_kind: str = "pausing", bystander_turns: int = 0) -> list[str]:
    """Two producers and one reader interleaving puts and gets; the order in which steps ran.

    ``reader_kind``: a task that pauses after some items (``pausing``), one that does not
    (``task``), or a synchronous handler served from the mailbox (``served``). A bystander task
    takes ``bystander_turns`` turns meanwhile.
    """
    log: list[str] = []

    async def main() -> None:
        box = make()

        async def reader() -> None:
            if reader_kind == "served":
                await serve(box, lambda item: log.append(f"got {item}"))
                return
            while (item := await box.get()) is not None:
                log.append(f"got {item}")
                if reader_kind == "pausing" and item % 3 == 0:
                    await asyncio.sleep(0)
                    log.append(f"after {item}")

        async def producer(name: str, items: range) -> None:
            for item in items:
                box.put_nowait(item)
                log.append(f"{name} put {item}")
                if item % 2:
                    await asyncio.sleep(0)

        async def bystander() -> None:
            for turn in range(bystander_turns):
                log.append(f"turn {turn}")
                await asyncio.sleep(0)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(reader())
            tasks.create_task(bystander())
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


def test_a_served_mailbox_handles_items_when_a_reader_task_would() -> None:
    expected = _queue_script(lambda: asyncio.Queue(100), "task", bystander_turns=8)
    assert _queue_script(lambda: Mailbox(100), "served", bystander_turns=8) == expected
    assert sum(line.startswith("got") for line in expected) == 20


def test_a_served_mailbox_raises_the_handlers_error_and_has_one_reader() -> None:
    async def main() -> None:
        box: Mailbox[int | None] = Mailbox()

        def handle(item: int | None) -> None:
            if item == 2:
                raise ValueError("bad item 2")

        server = asyncio.create_task(box.serve(handle))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await box.get()
        box.put_nowait(1)
        box.put_nowait(2)
        with pytest.raises(ValueError, match="bad item 2"):
            await server

    asyncio.run(main())


def _handoff_script(hand: bool, bystander_turns: int) -> list[str]:
    """A sender hands requests to a served actor whose replies wake it; a bystander may run too."""
    log: list[str] = []

    async def main() -> None:
        loop: Any = asyncio.get_running_loop()
        requests: Mailbox[int | None] = Mailbox()
        replies: Mailbox[int] = Mailbox()
        side: Mailbox[int | None] = Mailbox()

        def answer(item: int | None) -> None:
            log.append(f"answer {item}")
            if item is not None and item % 3 == 0:
                side.put_nowait(item)  # starts something elsewhere: the sender must go behind it
            replies.put_nowait(-item if item is not None else 0)

        to_actor = Handoff(requests, answer, loop.quiet)

        async def sender() -> None:
            for item in range(1, 10):
                if hand and to_actor.hand(item):
                    log.append("handed")
                    if not loop.quiet():
                        await asyncio.sleep(0)
                elif not hand:
                    requests.put_nowait(item)
                log.append(f"reply {await replies.get()}")

        async def bystander() -> None:
            for turn in range(bystander_turns):
                log.append(f"turn {turn}")
                await asyncio.sleep(0)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(serve(requests, answer))
            tasks.create_task(serve(side, lambda item: log.append(f"side {item}")))
            tasks.create_task(bystander())
            await tasks.create_task(sender())
            requests.put_nowait(None)
            side.put_nowait(None)

    run_virtual(main)
    return log


@pytest.mark.parametrize("bystander_turns", [0, 3, 20])
def test_a_handoff_changes_no_order_of_events(bystander_turns: int) -> None:
    expected = _handoff_script(False, bystander_turns)
    handed = _handoff_script(True, bystander_turns)
    assert [line for line in handed if line != "handed"] == expected
    assert sum(line.startswith("answer") for line in expected) == 9
    # handed at quiet moments only: never while the bystander always has a turn to run
    assert (handed.count("handed") > 0) == (bystander_turns < 9)
