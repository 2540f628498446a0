"""Sampling parameters (pure) and the token sampler (torch, imported lazily).

``SamplingParams`` is plain data the engine validates when a request is made; ``Sampler`` turns one
row of logits into a token with a per-request generator, so a seeded request draws the same tokens
whatever else runs beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


MAX_LOGPROBS = 20
"""The most alternatives a request may ask to see per token (OpenAI's limit for chat)."""

GREEDY_BELOW = 1e-5
"""Temperatures this small sample greedily: dividing logits by them overflows to inf (as vLLM does)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens: greedy at ``temperature`` 0 (or below :data:`GREEDY_BELOW`); else
    temperature, then top-k, then top-p."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logprobs: int | None = None
    """Report each generated token's log-probability and this many likeliest alternatives (None: off)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first, given the tokens before it (None: off)."""

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and not 0 <= count <= MAX_LOGPROBS:
                raise ValueError(f"{name} must lie in [0, {MAX_LOGPROBS}], got {count}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must lie in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Draws tokens for one request."""

    def __init__(self, params: SamplingParams) -> None:
        import torch

        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def sample(self, logits: torch.Tensor) -> int:
        """One token from a ``[vocab]`` row of logits (float32)."""
        import torch

        params = self.params
        if params.greedy:
            return int(torch.argmax(logits).item())
        scores = logits.float() / params.temperature
        if params.top_k and params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            cut = before >= params.top_p
            cut[0] = False  # the likeliest token stays, whatever float32 makes of a tiny top_p
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator).item())


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model, with the ``top`` likeliest tokens (id, log-prob),
    likeliest first. Log-probs are the log-softmax of the raw logits: before temperature, top-k and
    top-p, as vLLM reports them by default."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """What a backend scored since a request's last token: its prompt tokens (once, with the first
    token) and the token just sampled."""

    prompt: tuple[TokenLogprob, ...]
    token: TokenLogprob | None


def token_logprobs(logprobs: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each row of ``logprobs`` (``[rows, vocab]`` log-softmax) scored at its token of ``tokens``.

    The chosen log-prob and the top ones are read from the same tensor, so a token that is the
    likeliest has exactly the first top value (lm-evaluation-harness compares them for ``is_greedy``).
    """
    import torch

    rows = torch.arange(len(tokens))
    chosen = logprobs[rows, torch.tensor(list(tokens), dtype=torch.long)].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if top:
        values, ids = torch.topk(logprobs, top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [TokenLogprob(t, c, k) for t, c, k in zip(tokens, chosen, tops, strict=True)]
