"""Bottleneck-aware grouping's inputs and rule, as pure code (no clock, no I/O).

When the compute unit frees up, the scheduler actor builds an :class:`Outlook` (what it knows: the
blocked jobs, the cache's state of their experts, the link's and the compute unit's costs) and
:meth:`runahead.scheduling.ComputeQueue.plan` asks :func:`weigh_hold` whether to compute the
paper's opportunistic group now or :class:`Hold` it for jobs of the same layer whose reads are
landing (:func:`landing_times`). :class:`ComputeFit` estimates a group's compute time for backends
without a cost model; a backend with one prices candidate groups job by job (:class:`RunningGroup`).
Beyond the paper; plain ``runahead`` (or ``runahead/grouping=bottleneck``) uses it,
``runahead/grouping=opportunistic`` is the paper's rule.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import filterfalse
from typing import Protocol

from runahead.jobs import ENTRY_LAYER, ExpertId, Job, distinct_experts


class RunningGroup(Protocol):
    """A group's compute seconds as it grows by one job at a time.

    :meth:`seconds` must equal the plain ``group_s`` of the jobs added so far, in the order added,
    bit for bit (the rule compares candidates' costs: a last-bit difference could change a decision).
    """

    def add(self, job: Job) -> None: ...

    def seconds(self) -> float: ...


GroupPricer = Callable[[Iterable[Job]], RunningGroup]
"""A running group holding the given jobs (in order), to grow by :meth:`RunningGroup.add`."""


@dataclass(slots=True)
class Regrouped:
    """A :class:`RunningGroup` for a plain ``group_s``: it keeps the jobs and prices them all at each
    :meth:`seconds` (what :func:`weigh_hold` does without a pricer)."""

    group_s: Callable[[Sequence[Job]], float]
    jobs: list[Job]

    @classmethod
    def pricer(cls, group_s: Callable[[Sequence[Job]], float]) -> GroupPricer:
        """A :data:`GroupPricer` of ``group_s``."""
        return lambda jobs: cls(group_s, list(jobs))

    def add(self, job: Job) -> None:
        self.jobs.append(job)

    def seconds(self) -> float:
        return self.group_s(self.jobs)


def group_pricer(pricer: GroupPricer | None, group_s: Callable[[Sequence[Job]], float]) -> GroupPricer:
    """``pricer`` where there is one (a cost model's, job by job), else ``group_s`` on whole groups."""
    return pricer if pricer is not None else Regrouped.pricer(group_s)


class PricedGroup:
    """One decision's ready group, priced at most once (built on first use): its cost for
    :class:`runahead.landing.MergeSaving`, and its running group for :func:`weigh_hold` to grow."""

    __slots__ = ("_jobs", "_price", "_running", "_seconds")

    def __init__(self, jobs: Sequence[Job], price: GroupPricer) -> None:
        self._jobs, self._price = jobs, price
        self._running: RunningGroup | None = None
        self._seconds: float | None = None

    def seconds(self) -> float:
        """The group's compute seconds (``group_s`` of its jobs, bit for bit)."""
        if self._seconds is None:
            self._seconds = self._grown().seconds()
        return self._seconds

    def take(self) -> RunningGroup:
        """The running group of these jobs, for the caller to grow: asked for once (the last use)."""
        self.seconds()
        running = self._grown()
        self._running = None  # grown from now on: a later use prices the jobs anew
        return running

    def _grown(self) -> RunningGroup:
        if self._running is None:
            self._running = self._price(self._jobs)
        return self._running


@dataclass(slots=True)
class Outlook:
    """What the runtime knows when the compute unit frees up (``bottleneck`` grouping's inputs).

    ``blocked``: every job the JobIssuer holds for missing experts; ``resident`` and ``in_flight``:
    the ids of the experts the cache holds and of those being read (the cache's ``resident_ids`` and
    ``pending_ids``); ``fetch_s``: link seconds one expert's read holds the link;
    ``group_s``: compute seconds of one group of the given jobs (one backend call). Times come
    from the caller's clock; nothing here reads one. Read-only by use, not ``frozen``: one is built
    at every decision (and in every step of the small-case model's rollouts), and a frozen
    dataclass's ``__init__`` cost 1.3 us against 0.27.
    """

    now: float
    blocked: Sequence[Job]
    resident: Container[ExpertId]
    in_flight: Container[ExpertId]
    fetch_s: float
    group_s: Callable[[Sequence[Job]], float]
    compute_share: float = 1.0
    """Compute busy time over link busy time so far: above 1 the compute unit is the bottleneck."""
    tail_layer: int | None = None
    """The layer whose computed jobs reveal no read the link could start before the step barrier
    releases the next token (the last layer, with the barrier on); None without a barrier."""
    pricer: GroupPricer | None = None
    """``group_s`` job by job (a backend's cost model: :class:`runahead.costs.GroupCost`);
    None: the rule calls ``group_s`` on each whole candidate group."""
    measured: bool = False
    """Costs measured on a real backend (a fit, the link's own pace), not a model's: the rule holds
    more cautiously (:data:`HOLD_MIN_MEASURED_SHARE`, no link slack)."""
    lands: Mapping[ExpertId, float] | None = None
    """When each read in flight lands, where the link is a cost model (:class:`runahead.landing.
    LinkModel`: the sim); None elsewhere. With it the rule waits for a job about to be ready
    (:func:`runahead.landing.imminent`)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Compute nothing now: wait until a job becomes ready, or until ``deadline`` at the latest."""

    deadline: float


HOLD_MIN_COMPUTE_SHARE = 0.9
"""Groups below the tail layer are held only while compute busy time is at least this share of link
busy time so far: well short of that, the compute saved buys nothing (the link is the bottleneck,
and its own idle time at each step's start and end outweighs it), and the paper's rule keeps the
link fed. Near balance it still pays: a step's start and end run on the compute unit alone, so
compute saved there shortens the step even when the link is busier over the whole step (measured in
the small-case model, docs/results-core.md, "The gate at 0.9 and the link's slack"; 1.1 until then).
With measured costs the gate is :data:`HOLD_MIN_MEASURED_SHARE`.
"""

HOLD_MIN_MEASURED_SHARE = 1.1
"""The gate below the tail where the costs are measured (``Outlook.measured``: torch, MLX): a fit
prices groups 7-16% off and the link's pace drifts, so holds near balance are bets the rule cannot
price; the README's demo (small model, experts on disk) ran 1.08x sync (median of five) with them
against 1.32x without, alternating (docs/results-torch.md, "The gate at 0.9 on torch")."""

HOLD_MIN_TAIL_SHARE = 0.8
"""Tail groups are held only while compute busy time is at least this share of link busy time: far
from the compute bottleneck a held group's pins only crowd a small cache (more reads)."""


HOLD_LINK_SLACK = 0.5
"""Below the tail, a held group may end after the link runs out of revealed reads by up to this share
of the compute it saves: the link then idles that long at most, while the compute unit, near enough
the bottleneck to hold at all, is spared twice as much (measured with the gate above; 0 until then).
None with measured costs (the saving is an estimate there, the link's idle is not).
"""


def may_hold(compute_share: float) -> bool:
    """Whether a group may be held at all at this ``compute_share`` (the lower of the two gates):
    below it :meth:`runahead.scheduling.ComputeQueue.plan` computes the paper's group, so the caller
    need not build an :class:`Outlook` (it runs at every decision)."""
    return compute_share >= min(HOLD_MIN_COMPUTE_SHARE, HOLD_MIN_TAIL_SHARE)


def tail_waits(outlook: Outlook, members: Sequence[Job]) -> float | None:
    """When the ready tail group (``members``) should be held until, while a job of its step is
    behind it; None if none is, or if the group's output head is not worth the wait.

    NOTE (the tail waits for its step). Under the step barrier, a group at the last layer reveals
    nothing the link could start before the barrier releases the next token, and its shared work
    (the output head besides the layer's own weights: for Gemma4 most of a layer's time, 4.5 ms of
    5.1 for four requests on the Mac) is paid once however many requests it holds. Computed alone
    while other requests of the step are still at lower layers, it buys nothing and takes the
    compute unit from the jobs that will reveal reads; held, it joins the step's other tail jobs in
    one group once they arrive. The best holds schedules of the small-case model on the sim's link
    hold it so (docs/results-core.md, "The tail waits for its step"). It holds only where the head
    (the group's cost beyond the same jobs one layer down) exceeds that layer cost itself: a merge
    saves at least the head, and moves at most the group's own layer work to the step's end. So
    Qwen3.6 and Gemma4 wait at up to 8 ready jobs, gpt-oss and Qwen3-30B at up to 4, Mixtral and
    OLMoE (small heads beside their layers) never. The blocked jobs are the step's: the barrier
    holds every later token back. The hold lasts until the soonest of them should be ready
    (:func:`landing_times`), or a message; then the rule is asked again.
    """
    tail = outlook.tail_layer
    if tail is None or tail < 1:
        return None
    behind = [job for job in outlook.blocked if job.layer < tail]
    if not behind:
        return None
    below = outlook.group_s([replace(job, layer=tail - 1) for job in members])
    if outlook.group_s(members) - below <= below:
        return None  # a small head: the wait would move more to the step's end than it saves
    landing, _ = landing_times(
        outlook.now, outlook.blocked, outlook.resident, outlook.in_flight, outlook.fetch_s
    )
    return min(landing[job.request] for job in behind)


def landing_times(
    now: float,
    blocked: Iterable[Job],
    resident: Container[ExpertId],
    in_flight: Container[ExpertId],
    fetch_s: float,
) -> tuple[dict[int, float], float]:
    """When each blocked job should become ready, and when the link runs out of revealed work.

    NOTE (a model of the ExpertFetcher, not a copy of its state): the reads in flight (``in_flight``)
    land first, all of them by ``now + pending * fetch_s``; the other missing experts are read one
    after another in ``SELECT_FETCH_JOB`` order (lowest progress, then fewest missing), an expert
    two jobs need once; ``resident`` experts need no read. Returns ``{request: ready time}`` and the
    time the last read lands. Experts are ids (the cache's ``resident_ids`` and ``pending_ids``).
    """
    pending: set[ExpertId] = set()
    order = []
    is_resident, is_in_flight = resident.__contains__, in_flight.__contains__
    for job in blocked:  # each job's missing experts, and which are being read, found in C
        keys = list(filterfalse(is_resident, job.ids))
        pending.update(filter(is_in_flight, keys))
        order.append(((job.epoch, job.layer, len(keys), job.request), job, keys))
    cursor = now + len(pending) * fetch_s
    lands = dict.fromkeys(pending, cursor)
    ready_at = {}
    for _, job, keys in sorted(order, key=_first):
        placed = cursor
        for key in keys:
            if key not in lands:
                cursor += fetch_s
                lands[key] = cursor
        # the cursor only grows: a read placed just now lands after every one placed before it
        ready_at[job.request] = cursor if cursor != placed else max(map(lands.__getitem__, keys), default=now)
    return ready_at, cursor


@dataclass(frozen=True, slots=True)
class HoldVerdict:
    """What :func:`weigh_hold` decided, and why."""

    deadline: float | None
    """The time to hold the ready group until; None: compute it now."""
    top_gain: float
    """The most compute any wait would save net of the time it idles, before the link (or tail)
    test; 0 when no wait pays at all. Above 0 with no ``deadline``: the link test declined."""


def weigh_hold(
    now: float,
    ready: Sequence[Job],
    waiting: Sequence[tuple[float, Job]],
    link_free_at: float,
    group_s: Callable[[Sequence[Job]], float],
    *,
    tail: bool = False,
    pricer: GroupPricer | None = None,
    slack: float = HOLD_LINK_SLACK,
    priced: PricedGroup | None = None,
) -> HoldVerdict:
    """Whether to hold the ready group back, and why: a :class:`HoldVerdict`.

    NOTE (bottleneck-aware grouping, beyond the paper's opportunistic rule). ``ready`` are the
    ready jobs of the lowest ready layer; ``waiting`` the blocked jobs of that layer with the time
    each should become ready, soonest first. Option ``k`` waits for the first ``k`` of them and
    computes one group at ``t_k`` (the later of now and the k-th ready time). It is a candidate only
    if it pays for itself on both units:

    * compute: the shared work it saves, ``g(ready) + g(k jobs) - g(ready + k jobs)``, exceeds the
      time the compute unit idles waiting, ``t_k - now``;
    * link (below the tail): the held group ends, revealing its reads, no later than the link runs
      out of revealed reads (``link_free_at``) or than the ready group computed now would end, plus
      ``slack`` of the compute the wait saves (default :data:`HOLD_LINK_SLACK`):
      ``t_k + g(ready + k jobs) <= max(link_free_at, now + g(ready)) + slack * gain``. Reveals are
      paced to the link: hold while the queue of revealed reads covers the wait and the bigger
      group; when it would drain for longer than the hold is worth, compute now;
    * at the tail (``tail``: the last layer under the step barrier, whose reveals give the link
      nothing before the barrier releases), instead: the layer ends no later than computing now
      and the rest as one group once the last is ready would.

    Of the candidates, the one saving the most compute net of the wait; none: no deadline (the
    paper's rule). A wait saves at most ``g(ready)`` (adding jobs never makes a group cheaper), so
    once that, less the wait's idle, cannot beat the best candidate, later (longer) waits are not
    priced. Pure and deterministic. ``g`` is ``group_s``; with a ``pricer`` (the same costs job by
    job, bit for bit) the two groups of option ``k`` are option ``k - 1``'s grown by one job.
    ``priced``: ``ready`` as the caller priced it already (:class:`PricedGroup`, of ``pricer``).
    """
    price = group_pricer(pricer, group_s)
    if priced is None:
        priced = PricedGroup(ready, price)
    g_ready = priced.seconds()
    together = priced.take()  # the ready group, then grown by each waiting job in turn
    limit = _layer_done(now, g_ready, waiting, 0, price) if tail else max(link_free_at, now + g_ready)
    best, best_gain, top_gain = None, 0.0, 0.0
    held = price(())
    for k, (at, job) in enumerate(waiting, 1):
        start = max(now, at)
        idle = start - now
        if g_ready - idle < best_gain - 1e-9:
            break  # a wait saves at most g(ready) (no group costs less than one of its parts), less its idle
        together.add(job)
        held.add(job)
        g_together = together.seconds()
        gain = g_ready + held.seconds() - g_together - idle
        top_gain = max(top_gain, gain)
        if gain <= best_gain + 1e-12:
            continue
        end = _layer_done(start, g_together, waiting, k, price) if tail else start + g_together
        if end <= limit + (0.0 if tail else slack * gain) + 1e-12:
            best, best_gain = start, gain
    return HoldVerdict(best, top_gain)


def _layer_done(
    start: float, first_s: float, waiting: Sequence[tuple[float, Job]], k: int, price: GroupPricer
) -> float:
    """When the layer's last group ends: the ready jobs with the first ``k`` waiting ones as one group
    from ``start`` (when the k-th is ready), taking ``first_s`` (priced by the caller), then the
    others as one group once the last is ready."""
    done = start + first_s
    if k < len(waiting):
        done = max(done, waiting[-1][0]) + price([job for _, job in waiting[k:]]).seconds()
    return done


def landing_order(entry: tuple[float, Job]) -> tuple[float, int]:
    """Sort key of ``(ready time, job)`` pairs: soonest first, then by request."""
    return (entry[0], entry[1].request)


class LineFit:
    """Seconds of a group as ``shared + slope * size``, least squares over observed groups."""

    def __init__(self) -> None:
        self.observed = 0
        self._sums = [0.0, 0.0, 0.0, 0.0]  # sum x, sum y, sum x^2, sum xy

    def observe(self, size: int, seconds: float) -> None:
        self.observed += 1
        sums = self._sums
        sums[0] += size
        sums[1] += seconds
        sums[2] += size * size
        sums[3] += size * seconds

    def __call__(self, size: int) -> float:
        """Estimated seconds for a group of ``size`` (0 before anything was observed)."""
        n = self.observed
        if not n:
            return 0.0
        sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        if spread <= 1e-12:  # one size seen so far: scale its mean
            return sy / sx * size
        slope = max(0.0, (n * sxy - sx * sy) / spread)
        shared = max(0.0, (sy - slope * sx) / n)
        return shared + slope * size


class ComputeFit:
    """Compute seconds of a group, measured: a :class:`LineFit` for each kind of layer.

    For backends without a cost model: the scheduler observes every group it computes
    (:meth:`observe_group`). The kinds read different weights: the entry job (embedding rows,
    attention 0 and gate 0; no experts), the middle layers and the last (the output head besides).
    A group's size is its job count at the entry and its distinct routed experts elsewhere, as in the
    sim's cost model: each distinct expert's weights are read once per group, so what a hold saves is
    the shared part plus the experts the held jobs share with the ready ones. Measured on the medium
    torch model (``bench/compute_fit.py``): middle layers ~5 ms shared + 1.0 ms per distinct expert;
    entry groups of 8 jobs cost less than a middle layer's 1-job group, and one line over every layer
    put the shared part at 16.9 ms. On the sim, with its cost model hidden (``bench/fit_in_sim.py``),
    one line kept 0-64% of the rule's gain over the paper's grouping (mean 19%); these fits 93-100%.
    A kind not observed yet is priced by the middle layers' fit.

    Groups with a prefill chunk are left out: a chunk of hundreds of tokens counts as one job, and a
    few such points would turn the fit into one flat price per group, so the rule would see every
    wait as saving a whole group. Decode groups show what a hold saves.
    """

    def __init__(self, last_layer: int) -> None:
        self.last_layer = last_layer
        self.entry, self.middle, self.last = LineFit(), LineFit(), LineFit()

    @property
    def observed(self) -> int:
        """Groups observed, of every kind."""
        return self.entry.observed + self.middle.observed + self.last.observed

    def line(self, layer: int) -> LineFit:
        """The fit of ``layer``'s kind."""
        if layer == ENTRY_LAYER:
            return self.entry
        return self.last if layer == self.last_layer else self.middle

    def observe_group(self, jobs: Sequence[Job], seconds: float) -> None:
        """A group of ``jobs`` (of one layer) took ``seconds``: observed unless a job is a prefill chunk."""
        if not any(job.prefill for job in jobs):
            self.line(jobs[0].layer).observe(group_size(jobs), seconds)

    def __call__(self, jobs: Sequence[Job]) -> float:
        """Estimated seconds of one group of ``jobs`` (of one layer); 0 before anything was observed."""
        line = self.line(jobs[0].layer)
        return (line if line.observed else self.middle)(group_size(jobs))


def group_size(jobs: Sequence[Job]) -> int:
    """What a group's measured compute time scales with: its distinct routed experts, or at the
    entry layer (no experts) its jobs."""
    return len(jobs) if jobs[0].layer == ENTRY_LAYER else distinct_experts(jobs)


_first = operator.itemgetter(0)
