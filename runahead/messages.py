"""Messages between the three actors. Small slotted dataclasses, never changed once sent (not ``frozen``:
one is built per read and per group, and a frozen dataclass costs several times as much to build);
``None`` on a queue means "close"."""

from __future__ import annotations

from dataclasses import dataclass

from runahead.jobs import ExpertId, Job, RequestSpec

# -- to the JobIssuer ----------------------------------------------------------------------------


@dataclass(slots=True)
class Submit:
    """New requests to admit (from the runtime)."""

    requests: tuple[RequestSpec, ...]


@dataclass(slots=True)
class NextJobs:
    """Jobs revealed by a computed group (from the ComputeScheduler); answered by one :class:`Ready`."""

    jobs: tuple[Job, ...]


@dataclass(slots=True)
class FetchDone:
    """An expert landed in its slot (from the ExpertFetcher)."""

    expert: ExpertId


@dataclass(slots=True)
class FetchFailed:
    """A read of ``expert`` failed after its retries (from the ExpertFetcher); ``error`` says why."""

    expert: ExpertId
    error: str


@dataclass(slots=True)
class Finished:
    """A request produced its last token (from the ComputeScheduler)."""

    request: int


@dataclass(slots=True)
class Cancel:
    """Stop a request now, releasing its pins and KV cache (runtime -> issuer -> scheduler).

    With ``error`` the request failed (a read it needed failed): its caller gets that error.
    """

    request: int
    error: str | None = None


# -- to the ComputeScheduler ---------------------------------------------------------------------


@dataclass(slots=True)
class Started:
    """Admitted requests with their lanes; the scheduler creates their entry jobs."""

    requests: tuple[tuple[RequestSpec, int], ...]


@dataclass(slots=True)
class Ready:
    """Jobs whose experts are all resident and pinned. ``reply`` marks the answer to a NextJobs."""

    jobs: tuple[Job, ...]
    reply: bool = False


# -- to the ExpertFetcher ------------------------------------------------------------------------


@dataclass(slots=True)
class Blocked:
    """``job`` waits for ``missing`` experts."""

    job: Job
    missing: tuple[ExpertId, ...]


@dataclass(slots=True)
class Prefetch:
    """A predictor's guess of experts ``request`` will need at ``progress``."""

    request: int
    progress: tuple[int, int]
    experts: tuple[ExpertId, ...]


@dataclass(slots=True)
class Forget:
    """Drop a request's blocked job and hints (it ended or was cancelled)."""

    request: int


IssuerMessage = Submit | NextJobs | FetchDone | FetchFailed | Finished | Cancel | None
SchedulerMessage = Started | Ready | Cancel | None
FetcherMessage = Blocked | Prefetch | Forget | None
