"""The paper's units of work: experts, jobs, groups, and what a computed job returns.

A *job* ``l -> l+1`` runs the MoE of layer ``l`` for one request's tokens, then the attention and
the gate (router) of layer ``l+1``; the gate's top-k are the experts of the request's next job.
Layer ``ENTRY_LAYER`` (-1) is the first job of a token: embedding, attention 0 and gate 0, which
needs no experts. The job at the last layer ends in the LM head and sampling.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any, NamedTuple, NewType

ENTRY_LAYER = -1
"""Layer index of a token's first job (embedding, attention 0, gate 0): it needs no experts."""


class ExpertKey(NamedTuple):
    """One routed expert of one MoE layer: the unit of caching and fetching, as every seam names it
    (inside the runtime's hot path an expert is an :data:`ExpertId`)."""

    layer: int
    expert: int


ExpertId = NewType("ExpertId", int)
"""An expert's number inside the runtime's hot path (the cache, the eviction policy, the fetcher's
queues and messages): its index in one process-wide table of :class:`ExpertKey`, dense from 0.

NOTE (why a second name for an expert): the cache looks up every expert of every job several
times; an int hashes as itself where an ``ExpertKey`` tuple hashes its two fields on every look-up.
Ids are made only here, from a layer and its experts (:func:`expert_ids`, once per job when the
:class:`Job` is built) or from a key (:func:`expert_id`), and turned back by :func:`expert_key` where
they leave the hot path (a backend's ``fetch``, the recorded reads, errors). Every seam outside
(stores, backends, timelines, rows, the cache's key-taking methods) still speaks ``ExpertKey``; an
id never equals a key, so the two are never mixed: mypy tells them apart. The table only grows
(an expert keeps its id for the life of the process), and no decision depends on an id's value.
"""

_ID_ROWS: dict[int, dict[int, ExpertId]] = {}  # layer -> expert -> its id
_KEY_OF: list[ExpertKey] = []  # id -> its key (one shared instance per expert)


_NUMBERING = threading.Lock()
"""Held while new ids are numbered (first sight of an expert only): two engines in two threads of
one process must not give one expert two ids."""


def expert_ids(layer: int, experts: Sequence[int]) -> tuple[ExpertId, ...]:
    """The ids of ``experts`` at ``layer``, in order (new ones are numbered as they are first seen)."""
    row = _ID_ROWS.get(layer)
    if row is None:
        with _NUMBERING:
            row = _ID_ROWS.setdefault(layer, {})
    try:
        return tuple(map(row.__getitem__, experts))
    except KeyError:
        with _NUMBERING:
            for e in experts:
                if e not in row:  # the key first: a reader never sees an id without its key
                    _KEY_OF.append(ExpertKey(layer, e))
                    row[e] = ExpertId(len(_KEY_OF) - 1)
        return tuple(map(row.__getitem__, experts))


def expert_id(key: ExpertKey) -> ExpertId:
    """The id of ``key`` (an ``ExpertKey``; anything else is an error, never a silent miss)."""
    try:
        return _ID_ROWS[key.layer][key.expert]
    except KeyError:
        return expert_ids(key.layer, (key.expert,))[0]


def expert_key(expert: ExpertId) -> ExpertKey:
    """The ``ExpertKey`` of an id made by :func:`expert_ids` (a shared instance)."""
    return _KEY_OF[expert]


def expert_keys(experts: Iterable[ExpertId]) -> tuple[ExpertKey, ...]:
    """The ``ExpertKey`` of each id, in order."""
    return tuple(map(_KEY_OF.__getitem__, experts))


def waves_needed(jobs: Iterable[Job], budget: int) -> bool:
    """Whether a job needs more than ``budget`` experts (it must be split into waves)."""
    return any(map(budget.__lt__, map(len, map(_experts_of, jobs))))


def job_ids(jobs: Iterable[Job]) -> list[ExpertId]:
    """Every job's expert ids, job after job (a group's, flattened once, without a loop per expert)."""
    return list(chain.from_iterable(map(_ids_of, jobs)))


@dataclass(slots=True, init=False)
class Job:
    """Job ``layer -> layer+1`` of request ``request`` at decode step ``step``.

    ``experts`` are the experts the gate of ``layer`` selected (empty for the entry job).
    ``predicted_next`` is what a speculative gate predicted for ``layer+1`` (prefetch hint; may be
    empty). A job needing more experts than one job may pin (a prefill chunk) runs in *waves*:
    ``experts`` are this wave's, ``remaining`` the later waves'; only the last wave (no
    ``remaining``) goes on to the next layer's attention and gate. ``num_tokens`` counts the
    tokens the job carries (a prefill chunk's length, or 1); ``prefill`` marks prompt chunks.
    ``lane`` is the request's batch slot, used by static grouping. ``epoch`` orders tokens across
    requests that joined at different times: the step counted from a common origin, so "least
    progress" compares like with like (with the step barrier on it is the round number).

    Never changed once built (a changed job is a new one, ``dataclasses.replace``), but not
    ``frozen``: one is built for every layer of every token, and a frozen dataclass's
    ``__init__`` (``object.__setattr__`` per field) cost six times this one's.
    """

    request: int
    step: int
    layer: int
    experts: tuple[int, ...]
    lane: int
    num_tokens: int
    predicted_next: tuple[int, ...]
    epoch: int
    remaining: tuple[int, ...]
    wave: int
    prefill: bool
    ids: tuple[ExpertId, ...] = field(init=False, repr=False, compare=False)
    """The ids of the experts this job needs resident before it can compute (built once: it is hot)."""

    def __init__(
        self,
        request: int,
        step: int,
        layer: int,
        experts: tuple[int, ...] = (),
        lane: int = 0,
        num_tokens: int = 1,
        predicted_next: tuple[int, ...] = (),
        epoch: int = 0,
        remaining: tuple[int, ...] = (),
        wave: int = 0,
        prefill: bool = False,
    ) -> None:
        self.request = request
        self.step = step
        self.layer = layer
        self.experts = experts
        self.lane = lane
        self.num_tokens = num_tokens
        self.predicted_next = predicted_next
        self.epoch = epoch
        self.remaining = remaining
        self.wave = wave
        self.prefill = prefill
        self.ids = expert_ids(layer, experts) if experts else ()

    @property
    def keys(self) -> tuple[ExpertKey, ...]:
        """The cache keys of the experts this job needs (``ids`` as keys)."""
        return expert_keys(self.ids)

    def fields(self) -> tuple[Any, ...]:
        """The constructor's arguments, in order (``ids`` are derived, not passed)."""
        return (
            self.request,
            self.step,
            self.layer,
            self.experts,
            self.lane,
            self.num_tokens,
            self.predicted_next,
            self.epoch,
            self.remaining,
            self.wave,
            self.prefill,
        )

    def __reduce__(self) -> tuple[type[Job], tuple[Any, ...]]:
        """Pickled by its fields: another process numbers experts its own way (``ids`` are rebuilt)."""
        return Job, self.fields()

    def at_epoch(self, epoch: int) -> Job:
        """This job with ``epoch`` (what ``dataclasses.replace`` makes, built directly: the step
        barrier releases every request's entry job at every step)."""
        request, step, layer, experts, lane, tokens, predicted, _, remaining, wave, prefill = self.fields()
        return Job(request, step, layer, experts, lane, tokens, predicted, epoch, remaining, wave, prefill)

    @property
    def progress(self) -> tuple[int, int]:
        """How far the request has come: ``(epoch, layer)``, compared lexicographically."""
        return (self.epoch, self.layer)


_ids_of = attrgetter("ids")
_experts_of = attrgetter("experts")


@dataclass(slots=True)
class JobResult:
    """What computing one job produced.

    For a job below the last layer: ``next_experts`` (the gate of ``layer+1``) and optionally
    ``predicted_next`` (a speculative gate's guess for ``layer+2``). At the last layer: ``token``.
    Not ``frozen``, as :class:`Job` (one per job); never changed once built.
    """

    job: Job
    next_experts: tuple[int, ...] = ()
    predicted_next: tuple[int, ...] = ()
    token: int | None = None


@dataclass(frozen=True, slots=True)
class Group:
    """Jobs computed together in one backend call: all at one layer, so shared weights are read once."""

    layer: int
    jobs: tuple[Job, ...]

    def distinct_experts(self) -> int:
        """How many distinct experts the group's tokens go through (each is read once)."""
        return distinct_experts(self.jobs)


def distinct_experts(jobs: Iterable[Job]) -> int:
    """How many distinct experts ``jobs`` (of one layer) go through, counted without a loop per expert."""
    return len(set(chain.from_iterable(map(_experts_of, jobs))))


@dataclass(slots=True)
class RequestSpec:
    """A generation to run: ``max_tokens`` generated tokens, stopping early at a stop token.

    ``prompt`` holds the token ids a real backend processes first, in chunks (prefill); the last
    chunk's pass yields the first generated token. A simulated backend has no token ids: it
    processes ``prefill_tokens`` prompt tokens instead, and ``prompt_tokens`` is context it assumes
    is already in the KV cache. ``trace_index`` selects the request's routing in a simulated
    backend's trace. ``sampling`` (a :class:`runahead.sampling.SamplingParams`) is for backends
    that sample.
    """

    request: int
    max_tokens: int
    prompt_tokens: int = 0
    trace_index: int | None = None
    stop_tokens: frozenset[int] = field(default_factory=frozenset)
    prompt: tuple[int, ...] = ()
    sampling: Any = None
    prefill_tokens: int = 0

    @property
    def prompt_length(self) -> int:
        """Prompt tokens to process before decoding."""
        return len(self.prompt) or self.prefill_tokens

    def chunk_sizes(self, chunk: int) -> list[int]:
        """Tokens of each prefill pass when prompts are processed ``chunk`` tokens at a time."""
        length = self.prompt_length
        return [min(chunk, length - start) for start in range(0, length, chunk)]

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.prompt_tokens < 0:
            raise ValueError(f"request {self.request}: prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.prefill_tokens < 0:
            raise ValueError(
                f"request {self.request}: prefill_tokens must be >= 0, got {self.prefill_tokens}"
            )
