"""The paper's units of work: experts, jobs, groups, and what a computed job returns.

A *job* ``l -> l+1`` runs the MoE of layer ``l`` for one request's tokens, then the attention and
the gate (router) of layer ``l+1``; the gate's top-k are the experts of the request's next job.
Layer ``ENTRY_LAYER`` (-1) is the first job of a token: embedding, attention 0 and gate 0, which
needs no experts. The job at the last layer ends in the LM head and sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

ENTRY_LAYER = -1
"""Layer index of a token's first job (embedding, attention 0, gate 0): it needs no experts."""


class ExpertKey(NamedTuple):
    """One routed expert of one MoE layer: the unit of caching and fetching.

    A NamedTuple rather than a dataclass because it is hashed on every cache look-up.
    """

    layer: int
    expert: int


_KEYS: dict[int, dict[int, ExpertKey]] = {}
"""One shared :class:`ExpertKey` per (layer, expert) seen: building a job's keys is then a look-up
per expert, not a tuple construction, and dict look-ups of a shared key compare by identity."""


def expert_keys(layer: int, experts: tuple[int, ...]) -> tuple[ExpertKey, ...]:
    """The cache keys of ``experts`` at ``layer`` (shared instances, equal to freshly built ones)."""
    row = _KEYS.get(layer)
    if row is None:
        row = _KEYS[layer] = {}
    try:
        return tuple(map(row.__getitem__, experts))
    except KeyError:
        for e in experts:
            if e not in row:
                row[e] = ExpertKey(layer, e)
        return tuple(map(row.__getitem__, experts))


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
    keys: tuple[ExpertKey, ...] = field(init=False, repr=False, compare=False)
    """The cache keys this job needs resident before it can compute (built once: it is hot)."""

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
        self.keys = expert_keys(layer, experts) if experts else ()

    @property
    def progress(self) -> tuple[int, int]:
        """How far the request has come: ``(epoch, layer)``, compared lexicographically."""
        return (self.epoch, self.layer)


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
        return len({e for job in self.jobs for e in job.experts})


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
