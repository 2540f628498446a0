"""The one small protocol every backend (sim, torch, mlx) implements, and loading backends by name.

A backend owns device memory: the expert cache slots, the resident non-expert weights and each
request's KV cache. The runtime decides *which* expert goes in *which* slot and *when*; the
backend moves bytes and computes.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from runahead.jobs import ExpertId, ExpertKey, Group, JobResult, RequestSpec
from runahead.sampling import StepLogprobs

READS_IN_FLIGHT = 4
"""Expert reads kept in flight by default: a real backend's store workers (``queue_depth``) and the
runtime's link workers (``RuntimeConfig.link_queue_depth``), as the device profiles' links. Measured
with experts on this VM's disk (O_DIRECT), 8 requests, 30% cache, four rounds: the demo's small model
(786 KB experts) at 4 against 2 reads, runahead 46-63 tok/s against 30-56 and ahead of sync in every
round (at 2, behind in three of four: its reads come one layer's job at a time, and one read in
flight leaves the disk's latency bare), sync alike; the medium model (3 MB experts) sync 4.9-5.1
against 4.3-4.6, runahead 5.9-6.4 against 5.7-5.9 (docs/results-torch.md)."""

INLINE_READS_IN_FLIGHT = 4 * READS_IN_FLIGHT
"""The runtime's link workers by default where it computes groups on the event loop's thread
(:class:`InlineCompute`): a group is computed there only once every revealed read has started
(``ExpertFetcher.settled``), so the link needs room for every read a group reveals, and the reads
in flight are all it has while the loop computes. Measured on the medium model behind a 3 GB/s
cap, 70% cache (docs/results-torch.md, "Groups on the loop's thread while reads are in flight"):
with four, 4 requests ran 0.9x as fast as handing every group over (few groups found every read
started, and those left the link short); with eight, 4 requests gained 6% but 8 requests found
reads to start for half their groups and lost 5%; with sixteen, 90-96% of the groups ran on the
loop at both and 8 requests gained 4%. The store keeps :data:`READS_IN_FLIGHT` reader threads: a
read queued behind them waits its turn on the serial link anyway, but holds its slot: where the link
bounds the step (8 requests at 50% cache on a Zen 4) 2% more reads and a 2.7% slower step."""

if TYPE_CHECKING:
    from runahead.cache import ExpertCache


@runtime_checkable
class Backend(Protocol):
    """What the actors call. ``fetch`` and ``compute`` may run concurrently with each other."""

    num_layers: int
    """MoE layers of the model: jobs run at layers ``-1 .. num_layers - 1``."""

    experts_per_job: int
    """The most experts one decode job can need (the gate's top-k): the deadlock rule's unit."""

    def open_request(self, request: RequestSpec) -> None:
        """Allocate what a request needs (its KV cache). Called once when it is admitted."""

    def close_request(self, request: int) -> None:
        """Free the request's state. Idempotent."""

    async def fetch(self, key: ExpertKey, slot: int) -> float | None:
        """Move one expert from the store into cache slot ``slot`` over the link.

        Several fetches may be in flight at once; each returns when its bytes are in the slot, with
        the time they were on the runtime's clock where the backend knows it better than the moment
        its await resumes (a real store's reading thread notes it: ``ExpertStore.read_into``), else
        None. The ExpertFetcher records the read as ending then, so a landing the event loop takes
        late (after a group it computed itself) does not count as link time.
        """

    async def compute(self, group: Group) -> Sequence[JobResult]:
        """Run one layer job for every job of ``group`` as one batch; one result per job, in order.

        Every expert of every job is resident (and pinned) for the whole call.
        """
        ...


class BrokenPromise(AssertionError):
    """A backend found that the runtime broke the protocol's promise (a job computed before its
    experts were resident and pinned). A bug in the runtime: it stops the run, never isolated."""


@runtime_checkable
class CacheWatcher(Protocol):
    """A backend that checks the runtime keeps the cache's promises (the sim does, for the tests).

    The runtime hands such a backend its expert cache once, before any request runs; the backend
    may then verify, at every compute, that each expert of each job is resident and pinned.
    """

    def watch(self, cache: ExpertCache) -> None: ...


@runtime_checkable
class TokenScorer(Protocol):
    """A backend that reports log-probabilities (the torch backend does) for requests whose
    sampling asks (``SamplingParams.logprobs`` / ``prompt_logprobs``).

    The runtime calls :meth:`take_logprobs` as it delivers each token of such a request, while the
    request is still open; the backend hands over what it scored since the last call.
    """

    def take_logprobs(self, request: int) -> StepLogprobs | None: ...


@runtime_checkable
class SpeculativeGate(Protocol):
    """A backend that can apply layer ``l+1``'s gate to layer ``l``'s hidden state and report its
    guess with each job (``JobResult.predicted_next``; the torch and mlx backends can).

    Only a policy with the gate predictor (``prefetch-gate``, ``runahead+prefetch``) reads the
    guess, and it costs a norm, a router product and a top-k per job: the runtime turns it on for
    those policies and off for every other one, once, before any request runs.
    """

    def use_speculative_gate(self, on: bool) -> None: ...


@runtime_checkable
class ModelledLink(Protocol):
    """A backend whose reads take the time a model of its link says (the sim: a
    :class:`runahead.landing.LinkModel`), so it knows when each read in flight lands: bottleneck
    grouping then waits for a job about to be ready (:mod:`runahead.landing`). :meth:`landings` is
    that map, kept current by the backend (ids in flight to landing times on the runtime's clock),
    or None where reads take no time (the sim's ``zero_cost``)."""

    def landings(self) -> Mapping[ExpertId, float] | None: ...


@runtime_checkable
class InlineCompute(Protocol):
    """A backend whose ``compute`` hands each group to a compute thread and that can also compute a
    group on the caller's thread, the event loop's, returning its results at once (the torch
    backend; not mlx's, whose streams belong to the thread that made them).

    The runtime calls :meth:`compute_inline` instead of ``compute`` only where the thread buys
    nothing: the link has nothing to read (no read in flight or waiting to start, nothing left in
    the ExpertFetcher's inbox) and the group holds no prompt chunk, so the loop, blocked for one
    decode group, misses no work, and the two thread hand-offs of ``compute`` (a wake-up each way,
    ~250 us a group on the 2-vCPU VMs here) are saved (``RuntimeConfig.inline_compute``;
    docs/architecture.md, "The torch backend"). The results are ``compute``'s, bit for bit.
    """

    def compute_inline(self, group: Group) -> Sequence[JobResult]: ...


@runtime_checkable
class ExpertCount(Protocol):
    """A backend that says how many routed experts each of its ``num_layers`` layers has (all three
    built-in ones do): with it the runtime's cache knows when every expert of the model is resident,
    and stops counting pins from then on (:class:`runahead.cache.ExpertCache`, ``experts``)."""

    num_experts: int


BUILTIN_BACKENDS = {
    "sim": "runahead.backends.sim",
    "torch": "runahead.backends.torch",
    "mlx": "runahead.backends.mlx",
}
ENTRY_POINT_GROUP = "runahead.backends"


def backend_module(name: str) -> Any:
    """Import the module of backend ``name`` lazily: built-in names first, then entry points.

    Third-party backends register a module under the ``runahead.backends`` entry-point group.
    """
    if name in BUILTIN_BACKENDS:
        return importlib.import_module(BUILTIN_BACKENDS[name])
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name == name:
            return point.load()
    known = sorted({*BUILTIN_BACKENDS, *(p.name for p in entry_points(group=ENTRY_POINT_GROUP))})
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(known)}")
