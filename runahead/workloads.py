"""Request workloads: how long prompts and outputs are, and when requests arrive.

The paper evaluates two workloads (see ``shared/seeds/bevy-paper-summary.md``): *Chat* (ShareGPT)
and *Agentic Coding* (SWE-agent trajectories). This module gives each a seeded synthetic model
(:data:`CHAT`, :data:`AGENTIC`, by name in :data:`WORKLOADS`); :mod:`runahead.workload_files` reads
the real files a user may have offline (ShareGPT, SWE-agent trajectories). Everything here is pure Python and
numpy and deterministic: the same seed gives the same samples.

Arrival patterns:

* ``closed``: a fixed concurrency kept busy: every request is ready at once and the next one starts
  as soon as a slot frees. Samples carry ``arrival_s=None`` ("as soon as a slot frees").
* ``poisson``: open-loop arrivals at ``rate`` requests per second; exponential gaps, sorted times
  starting after t=0.

:func:`to_request_specs` turns samples into :class:`runahead.jobs.RequestSpec` for the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from runahead.jobs import RequestSpec

__all__ = [
    "AGENTIC",
    "CHAT",
    "WORKLOADS",
    "AgenticWorkload",
    "ChatWorkload",
    "RequestSample",
    "WorkloadSpec",
    "get_workload",
    "sample_requests",
    "summary",
    "to_request_specs",
]

Arrival = Literal["closed", "poisson"]


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One request of a workload.

    ``prompt_tokens`` is the context the request starts with, ``output_tokens`` how many tokens it
    generates. ``arrival_s`` is when it arrives (seconds from the start of the run), or ``None`` for
    a closed loop: it starts as soon as a slot frees.
    """

    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None


# --------------------------------------------------------------------------------------------------
# Synthetic workloads


def _norm_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """``E[clip(X, low, high)]`` for ``X ~ LogNormal(mu, sigma)``, in closed form."""
    a, b = math.log(low), math.log(high)
    below = _norm_cdf((a - mu) / sigma)
    above = 1.0 - _norm_cdf((b - mu) / sigma)
    inside = math.exp(mu + sigma**2 / 2) * (
        _norm_cdf((b - mu - sigma**2) / sigma) - _norm_cdf((a - mu - sigma**2) / sigma)
    )
    return low * below + high * above + inside


def _mu_for_mean(mean: float, sigma: float, low: float, high: float) -> float:
    """The log-mean ``mu`` whose lognormal, clipped to ``[low, high]``, has mean ``mean``."""
    if not low < mean < high:
        raise ValueError(f"mean {mean} must lie strictly inside the clip range [{low}, {high}]")
    lo, hi = math.log(low) - 10 * sigma, math.log(high) + 10 * sigma
    for _ in range(200):  # the clipped mean increases with mu: bisect
        mid = (lo + hi) / 2
        if _clipped_lognormal_mean(mid, sigma, low, high) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _lognormal_ints(
    rng: np.random.Generator, n: int, mean: float, sigma: float, low: int, high: int
) -> np.ndarray:
    """``n`` integers from a lognormal with the given clipped mean, clipped to ``[low, high]``."""
    mu = _mu_for_mean(mean, sigma, low, high)
    values = rng.lognormal(mu, sigma, size=n)
    return np.clip(np.rint(values), low, high).astype(np.int64)


def _stream(seed: int, key: int) -> np.random.Generator:
    """Generator ``key`` of ``seed``: one independent stream per drawn quantity.

    Separate streams mean one quantity's draws never shift another's, so lengths do not depend on the
    arrival pattern, and each quantity being drawn in order makes the first ``k`` of ``n`` samples
    equal the ``k`` samples drawn with the same seed.
    """
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(key,)))


_ARRIVAL_STREAM = 99
"""Stream key of arrival gaps (workloads use small keys for their lengths)."""


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Chat: single-turn requests shaped like ShareGPT (the paper's *Chat* workload).

    Fitted to: ShareGPT (the ShareGPT-V3 "unfiltered, cleaned split" conversations used by
    vLLM/Orca-style serving evaluations), whose mean prompt of ~161 tokens and mean output of ~338
    tokens are the figures commonly reported for it; they are quoted, not re-measured here.
    Prompt and output lengths are independent lognormals (long right tail), each clipped to
    ``[min_tokens, max_tokens]`` with its log-mean solved so that the *clipped* mean hits the target.

    Estimates (not fitted to the dataset): the log-space spreads ``prompt_sigma`` and
    ``output_sigma`` (chosen for a long prompt tail, median ~half the mean, and a tighter output
    distribution), the clip range, and the independence of prompt and output.
    """

    name: str = "chat"
    mean_prompt_tokens: float = 161.0
    mean_output_tokens: float = 338.0
    prompt_sigma: float = 1.2
    output_sigma: float = 0.9
    min_tokens: int = 4
    max_tokens: int = 4096

    def draw(self, seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, output) token counts as two int64 arrays."""
        prompt_rng, output_rng = _stream(seed, 0), _stream(seed, 1)
        prompts = _lognormal_ints(
            prompt_rng, n, self.mean_prompt_tokens, self.prompt_sigma, self.min_tokens, self.max_tokens
        )
        outputs = _lognormal_ints(
            output_rng, n, self.mean_output_tokens, self.output_sigma, self.min_tokens, self.max_tokens
        )
        return prompts, outputs


@dataclass(frozen=True, slots=True)
class AgenticWorkload:
    """Agentic coding: turns of SWE-agent-style trajectories (the paper's *Agentic Coding* workload).

    Fitted to: SWE-agent trajectories, qualitatively. Each request is one agent turn: its prompt is
    the whole history so far (system prompt, demonstration, issue text, then every earlier
    thought/action and the tool observation it got back), so prompts grow along a trajectory to
    tens of thousands of tokens; its output is one short thought + action.

    The model: a trajectory has ``turns`` turns (lognormal, median ``median_turns``, clipped to
    ``[min_turns, max_turns]``); a request is a uniformly random turn ``k`` of a freshly drawn
    trajectory, with prompt ``initial + sum over the k earlier turns of (observation + output)``,
    clipped so that prompt + output fits ``context_tokens`` (SWE-agent likewise elides old
    observations to stay within the model's window).

    Every number here is an estimate, not a fit to a released dataset: the initial context (median
    ~10k tokens: system prompt, demonstration, issue), observations (median ~600 tokens: a file view
    or a command's output), outputs (mean ~150 tokens, clipped to ``[8, 1024]``), trajectory lengths
    (median ~28 turns, at most 80) and a 32k context. They are chosen so that prompts have a median
    of ~20-30k tokens (:data:`AGENTIC_MEDIAN_PROMPT_RANGE`; ~24k with these defaults) and outputs
    stay short. About 30% of requests hit the context limit: late turns of long trajectories.
    """

    name: str = "agentic"
    initial_tokens_median: float = 10000.0
    initial_sigma: float = 0.3
    observation_tokens_median: float = 600.0
    observation_sigma: float = 1.0
    mean_output_tokens: float = 150.0
    output_sigma: float = 0.6
    min_output_tokens: int = 8
    max_output_tokens: int = 1024
    median_turns: float = 28.0
    turns_sigma: float = 0.5
    min_turns: int = 4
    max_turns: int = 80
    context_tokens: int = 32768

    def draw(self, seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, output) token counts as two int64 arrays."""
        turns_rng, pick_rng, initial_rng, observation_rng, history_rng, output_rng = (
            _stream(seed, key) for key in range(6)
        )
        turns = np.clip(
            np.rint(turns_rng.lognormal(math.log(self.median_turns), self.turns_sigma, size=n)),
            self.min_turns,
            self.max_turns,
        ).astype(np.int64)
        turn = np.minimum((pick_rng.random(n) * turns).astype(np.int64), turns - 1)  # 0-based
        initial = initial_rng.lognormal(math.log(self.initial_tokens_median), self.initial_sigma, size=n)
        # The history of each sample: one row of (observation, output) per possible earlier turn.
        width = self.max_turns - 1
        observations = observation_rng.lognormal(
            math.log(self.observation_tokens_median), self.observation_sigma, size=(n, width)
        )
        earlier_outputs = _lognormal_ints(
            history_rng,
            n * width,
            self.mean_output_tokens,
            self.output_sigma,
            self.min_output_tokens,
            self.max_output_tokens,
        ).reshape(n, width)
        per_turn = np.rint(observations) + earlier_outputs
        grown = np.concatenate([np.zeros((n, 1)), np.cumsum(per_turn, axis=1)], axis=1)
        history = grown[np.arange(n), turn]
        outputs = _lognormal_ints(
            output_rng,
            n,
            self.mean_output_tokens,
            self.output_sigma,
            self.min_output_tokens,
            self.max_output_tokens,
        )
        outputs = np.minimum(outputs, self.context_tokens - 1)
        prompts = np.clip(np.rint(initial + history), 1, self.context_tokens - outputs).astype(np.int64)
        return prompts, outputs


WorkloadSpec = ChatWorkload | AgenticWorkload
"""A workload's distribution parameters."""

CHAT = ChatWorkload()
"""The paper's *Chat* workload: ShareGPT-shaped prompts (mean ~161) and outputs (mean ~338)."""

AGENTIC = AgenticWorkload()
"""The paper's *Agentic Coding* workload: SWE-agent-style turns, long growing prompts, short outputs."""

AGENTIC_MEDIAN_PROMPT_RANGE = (20_000, 30_000)
"""Where :data:`AGENTIC`'s median prompt is meant to lie (an estimate for SWE-agent turns)."""

WORKLOADS: dict[str, WorkloadSpec] = {CHAT.name: CHAT, AGENTIC.name: AGENTIC}
"""Synthetic workloads by name."""


def get_workload(workload: str | WorkloadSpec) -> WorkloadSpec:
    """The workload named ``workload`` (or ``workload`` itself when it already is one)."""
    if isinstance(workload, ChatWorkload | AgenticWorkload):
        return workload
    try:
        return WORKLOADS[workload]
    except KeyError:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}") from None


def sample_requests(
    workload: str | WorkloadSpec,
    n: int,
    seed: int,
    *,
    arrival: Arrival = "closed",
    rate: float | None = None,
) -> list[RequestSample]:
    """``n`` requests of ``workload``, deterministic in ``seed``.

    ``arrival="closed"`` gives ``arrival_s=None`` for all (start as soon as a slot frees);
    ``arrival="poisson"`` gives open-loop arrivals at ``rate`` requests per second (exponential
    gaps, so arrival times are sorted and their mean gap is ``1 / rate``). Lengths do not depend on
    the arrival pattern, and the first ``k`` of ``n`` samples equal the ``k`` drawn with the same seed.
    """
    spec = get_workload(workload)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    arrivals: list[float | None]
    if arrival == "closed":
        if rate is not None:
            raise ValueError("a closed loop takes no rate; use arrival='poisson' for open-loop arrivals")
        arrivals = [None] * n
    elif arrival == "poisson":
        if rate is None or not rate > 0 or not math.isfinite(rate):
            raise ValueError(f"poisson arrivals need a finite rate > 0 (requests/s), got {rate}")
        arrival_rng = _stream(seed, _ARRIVAL_STREAM)
        arrivals = [float(t) for t in np.cumsum(arrival_rng.exponential(1.0 / rate, size=n))]
    else:
        raise ValueError(f"unknown arrival pattern {arrival!r}; choose 'closed' or 'poisson'")
    prompts, outputs = spec.draw(seed, n)
    return [
        RequestSample(int(p), int(o), a)
        for p, o, a in zip(prompts.tolist(), outputs.tolist(), arrivals, strict=True)
    ]


def summary(samples: Sequence[RequestSample]) -> dict[str, float]:
    """Mean, median and p90 of prompt and output tokens (plus ``n``, and arrival stats if any).

    Keys: ``n``, ``prompt_mean``, ``prompt_median``, ``prompt_p90``, ``output_mean``,
    ``output_median``, ``output_p90``; with timed arrivals also ``duration_s`` (last arrival) and
    ``mean_interarrival_s``.
    """
    if not samples:
        raise ValueError("summary of no samples")
    prompts = np.array([s.prompt_tokens for s in samples], dtype=np.float64)
    outputs = np.array([s.output_tokens for s in samples], dtype=np.float64)
    result = {"n": float(len(samples))}
    for label, values in (("prompt", prompts), ("output", outputs)):
        result[f"{label}_mean"] = float(values.mean())
        result[f"{label}_median"] = float(np.median(values))
        result[f"{label}_p90"] = float(np.percentile(values, 90))
    times = [s.arrival_s for s in samples if s.arrival_s is not None]
    if times:
        result["duration_s"] = float(max(times))
        result["mean_interarrival_s"] = float(max(times) / len(times))
    return result


def to_request_specs(samples: Iterable[RequestSample], *, start_id: int = 0) -> list[RequestSpec]:
    """One :class:`RequestSpec` per sample, ids from ``start_id``: ``max_tokens`` is the output length.

    Arrival times are not part of a ``RequestSpec``; a caller replaying poisson arrivals submits each
    spec at its sample's ``arrival_s``.
    """
    return [
        RequestSpec(request=start_id + i, max_tokens=s.output_tokens, prompt_tokens=s.prompt_tokens)
        for i, s in enumerate(samples)
    ]
