"""What the real backends (torch, mlx) share about requests and a group's rows; no tensor library.

A group is one batch of rows, one per token of each job, in job order (:func:`row_spans`); a job's
tokens are the next prompt chunk or the last sampled token (:func:`input_tokens`). A request is
checked once at admission (:func:`admit`), and what its sampling asked to score is handed over as
each token is delivered (:func:`take_logprobs`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from runahead.jobs import Job, RequestSpec
from runahead.sampling import SamplingParams, StepLogprobs, TokenLogprob


class Scored(Protocol):
    """A backend's per-request state that keeps what it scored until the runtime takes it."""

    prompt_logprobs: list[TokenLogprob]
    token_logprob: TokenLogprob | None


def admit(request: RequestSpec, vocab_size: int, backend: str) -> SamplingParams:
    """Check ``request``'s prompt (non-empty, every id in ``[0, vocab_size)``); return its sampling.

    Raises ``ValueError`` naming the request and the bad ids.
    """
    if not request.prompt:
        raise ValueError(f"request {request.request}: the {backend} backend needs a non-empty prompt")
    bad = [t for t in request.prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"request {request.request}: prompt token ids {bad[:5]} are outside [0, {vocab_size})"
        )
    params: SamplingParams = request.sampling or SamplingParams(max_tokens=request.max_tokens)
    return params


def take_logprobs(state: Scored | None) -> StepLogprobs | None:
    """What was scored for a request since the last call (and forget it), or None if nothing was."""
    if state is None or (not state.prompt_logprobs and state.token_logprob is None):
        return None
    step = StepLogprobs(tuple(state.prompt_logprobs), state.token_logprob)
    state.prompt_logprobs, state.token_logprob = [], None
    return step


def input_tokens(spec: RequestSpec, position: int, last_token: int | None, job: Job) -> list[int]:
    """The tokens a job embeds: the next prompt chunk (from ``position``), or the last sampled token."""
    if job.prefill:
        chunk = list(spec.prompt[position : position + job.num_tokens])
        if len(chunk) != job.num_tokens:
            raise RuntimeError(f"request {job.request}: prefill chunk past the end of the prompt")
        return chunk
    assert last_token is not None
    return [last_token]


def row_spans(jobs: Sequence[Job]) -> list[tuple[int, int]]:
    """Each job's rows ``[start, stop)`` in the group's batch (one row per token)."""
    spans, start = [], 0
    for job in jobs:
        spans.append((start, start + job.num_tokens))
        start += job.num_tokens
    return spans


def distinct_experts(rows: Iterable[Iterable[int]]) -> tuple[int, ...]:
    """The distinct experts in rows of routing, ascending."""
    return tuple(sorted({int(e) for row in rows for e in row}))
