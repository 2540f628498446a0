"""The requests of one bench point: the ``chat`` and ``agentic`` workloads, synthetic or from a file.

``chat`` (decode-dominated): ``concurrency`` requests whose prompts are context already in the KV
cache (``prompt_tokens``); each decodes ``steps`` tokens over the trace. Prompts are drawn from
:data:`runahead.workloads.CHAT` (ShareGPT-shaped, mean ~161; its outputs, mean ~338, outlast the
measured window, so no request finishes early), or read from a ShareGPT file.

``agentic`` (long prompts): a closed loop at ``concurrency`` over agent turns: the history is cached
context, the turn's new tokens are prefilled through the pipeline in chunks of ``prefill_chunk``; a
finished request's lane takes the next turn at once. Turns are drawn from
:data:`runahead.workloads.AGENTIC`, or read from SWE-agent trajectories (one ``.traj`` file or a
folder of them).

A point's ``workload_file`` names the file; ``seed`` picks where in it the point starts (``seed *
concurrency`` requests in, wrapping around), so seeds give different slices of one file.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from runahead.jobs import RequestSpec
from runahead.workload_files import Turn, WorkloadFileError, load_sharegpt, load_trajectories
from runahead.workloads import AGENTIC, CHAT, RequestSample, sample_requests

if TYPE_CHECKING:
    from runahead.bench import BenchPoint

T = TypeVar("T")

WORKLOADS = {"chat": int(CHAT.mean_prompt_tokens), "agentic": 24_000}
"""Workloads by name -> their typical prompt tokens (the synthetic mix's; for display only)."""

AGENTIC_MAX_PREFILL = 4096
"""Cap on one agentic turn's new (prefilled) tokens: a long observation is truncated, as SWE-agent does."""


@functools.lru_cache(maxsize=8)
def _sharegpt(path: str) -> tuple[RequestSample, ...]:
    return tuple(load_sharegpt(path))


@functools.lru_cache(maxsize=8)
def _trajectories(path: str) -> tuple[Turn, ...]:
    return tuple(load_trajectories(path))


def check_workload_file(workload: str, path: str) -> int:
    """Read ``path`` as ``workload``'s file (ShareGPT for chat, SWE-agent for agentic); its request count.

    Raises :class:`runahead.workload_files.WorkloadFileError` naming the file when it cannot be used.
    """
    count = len(_trajectories(path) if workload == "agentic" else _sharegpt(path))
    if count == 0:
        raise WorkloadFileError(f"{workload} workload file {path} holds no request")
    return count


def _from(items: tuple[T, ...], start: int) -> Iterator[T]:
    """``items`` cycled from ``start`` (wrapping around)."""
    return itertools.islice(itertools.cycle(items), start % len(items), None)


def chat_specs(point: BenchPoint) -> list[RequestSpec]:
    """``chat``: one request per lane, its prompt as cached context, ``steps`` decode tokens each."""
    if point.workload_file is None:
        samples = sample_requests(CHAT, point.concurrency, point.seed)
    else:
        file = _sharegpt(point.workload_file)
        samples = list(itertools.islice(_from(file, point.seed * point.concurrency), point.concurrency))
    return [
        RequestSpec(r, point.steps, prompt_tokens=sample.prompt_tokens + point.warmup_steps)
        for r, sample in enumerate(samples)
    ]


def _synthetic_turns(point: BenchPoint) -> Iterator[Turn]:
    """Turns of :data:`AGENTIC` (seeded by ``point.seed``) with their new tokens.

    A turn's new tokens are one tool observation (lognormal, median 600, the workload's own
    observation model) plus the previous output (the workload's mean).
    """
    count = point.concurrency * point.steps // AGENTIC.min_output_tokens + point.concurrency + 1
    samples = sample_requests(AGENTIC, count, point.seed)  # enough whatever the draws
    rng = np.random.default_rng([point.seed, 0x5E1F])
    observations = rng.lognormal(
        math.log(AGENTIC.observation_tokens_median), AGENTIC.observation_sigma, count
    )
    for sample, observation in zip(samples, observations.tolist(), strict=True):
        yield Turn(sample, round(observation) + round(AGENTIC.mean_output_tokens))


def agentic_specs(point: BenchPoint) -> list[RequestSpec]:
    """``agentic``: the closed loop's requests in submission order; ``concurrency * steps`` decode tokens.

    Each request is one turn. Its prompt splits into context an earlier turn left in the KV cache
    (``prompt_tokens``; agents reuse their prefix) and the turn's new tokens, prefilled through the
    pipeline (``prefill_tokens``): at most :data:`AGENTIC_MAX_PREFILL` and at most the prompt. It
    decodes ``min(output, steps)`` tokens; the last request is cut to the token budget.
    """
    budget = point.concurrency * point.steps
    if point.workload_file is None:
        turns: Iterator[Turn] = _synthetic_turns(point)
    else:
        turns = _from(_trajectories(point.workload_file), point.seed * point.concurrency)
    specs = []
    for r, turn in enumerate(turns):
        if budget <= 0:
            break
        sample = turn.sample
        new = max(1, min(turn.new_tokens, AGENTIC_MAX_PREFILL, sample.prompt_tokens))
        tokens = min(sample.output_tokens, point.steps, budget)
        budget -= tokens
        cached = sample.prompt_tokens - new + point.warmup_steps
        specs.append(RequestSpec(r, tokens, prompt_tokens=cached, prefill_tokens=new))
    return specs


def request_specs(point: BenchPoint) -> list[RequestSpec]:
    """The point's requests (:func:`agentic_specs` or :func:`chat_specs`)."""
    return agentic_specs(point) if point.workload == "agentic" else chat_specs(point)
