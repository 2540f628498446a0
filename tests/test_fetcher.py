"""The ExpertFetcher's link workers: which idle worker a message wakes, and when none is woken."""

from __future__ import annotations

import asyncio

from runahead.actors.fetcher import ExpertFetcher
from runahead.cache import ExpertCache
from runahead.clock import Clock, run_virtual
from runahead.jobs import ExpertKey, Job
from runahead.mailbox import Mailbox
from runahead.messages import Blocked, FetchDone, FetcherMessage, Forget, IssuerMessage
from runahead.metrics import Recorder
from runahead.scheduling import FetchOrder


class _Link:
    """A backend's ``fetch``: each read takes a millisecond of loop time; the keys read, in order."""

    def __init__(self) -> None:
        self.read: list[ExpertKey] = []

    async def fetch(self, key: ExpertKey, slot: int) -> None:
        self.read.append(key)
        await Clock().sleep(0.001)


async def _wake_ups(messages: list[FetcherMessage]) -> tuple[list[int], list[ExpertKey], int]:
    """Send each message to a fetcher whose four workers are idle; after each, how many workers ran
    (were woken) before the loop settled; then the keys read and the notices the issuer got."""
    link, cache = _Link(), ExpertCache(8)
    inbox: Mailbox[FetcherMessage] = Mailbox()
    issuer: Mailbox[IssuerMessage] = Mailbox()
    fetcher = ExpertFetcher(
        backend=link,  # type: ignore[arg-type]  # only fetch is called
        cache=cache,
        fetch_order=FetchOrder.LOWEST_LAYER_SRTF,
        inbox=inbox,
        issuer=issuer,
        clock=Clock(),
        recorder=Recorder(),
    )
    picks = 0
    pick = fetcher._pick

    def counted() -> tuple[int, int, bool] | None:
        nonlocal picks
        picks += 1
        return pick()

    fetcher._pick = counted  # type: ignore[method-assign]  # counts the workers' looks at the queues
    running = asyncio.create_task(fetcher.run())
    await asyncio.sleep(0.01)
    assert picks == 4 and len(fetcher._idle) == 4  # every worker looked once, found nothing, parked
    woken = []
    for message in messages:
        if isinstance(message, Blocked):
            cache.pin_ids(message.missing)  # as the JobIssuer does before it tells the fetcher
        picks = 0
        inbox.put_nowait(message)
        await asyncio.sleep(0.01)
        woken.append(picks)
    inbox.put_nowait(None)
    await running
    return woken, link.read, sum(isinstance(notice, FetchDone) for notice in issuer)


def test_a_message_that_leaves_nothing_to_read_wakes_no_worker() -> None:
    job = Job(0, 0, 3, (5, 9))
    blocked = Blocked(job, job.ids)
    woken, read, notices = run_virtual(lambda: _wake_ups([Forget(7), blocked, Forget(0)]))
    # Forget with nothing queued: no worker looks. Blocked: one worker takes the first read and wakes
    # a second for the other; each looks again after its read lands and finds the queue empty. The
    # last Forget finds nothing queued either.
    assert woken == [0, 4, 0]
    assert read == [ExpertKey(3, 5), ExpertKey(3, 9)] and notices == 2
