"""Prefetch predictors: guesses of the experts a request's *next* job will need.

Runahead needs none (it fetches only experts known to be needed); the baselines use them:

- ``GatePredictor`` (SpecMD / Mixtral-offloading style): the backend applies layer ``l+1``'s gate
  to the hidden state of layer ``l`` and reports the top experts with the job (``predicted_next``).
- ``HistoryPredictor`` (FineMoE style): matches the request's current token so far against the
  expert maps of its recent tokens and predicts what the most similar one used next.

Pure and deterministic: they see only the jobs the JobIssuer hands them.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from runahead.jobs import ENTRY_LAYER, Job


class Predictor(Protocol):
    """Called by the JobIssuer once per issued job, in issue order."""

    def predict(self, job: Job) -> tuple[int, ...]:
        """Experts of layer ``job.layer + 1`` worth prefetching for ``job.request`` (may be empty)."""
        ...

    def forget(self, request: int) -> None:
        """The request ended; drop its state."""
        ...


class GatePredictor:
    """Prefetch what the speculative next-layer gate reported for the job."""

    def predict(self, job: Job) -> tuple[int, ...]:
        return job.predicted_next

    def forget(self, request: int) -> None:
        pass


class HistoryPredictor:
    """Per-request expert maps of the last ``history`` tokens; predict from the most similar one.

    Similarity of a stored map to the current token is the overlap of their experts at the current
    layer and the one before (the trajectory so far); ties go to the most recent token.
    """

    def __init__(self, num_layers: int, history: int = 8) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.num_layers = num_layers
        self.history = history
        self._maps: dict[int, deque[dict[int, frozenset[int]]]] = {}
        self._current: dict[int, tuple[int, dict[int, frozenset[int]]]] = {}  # request -> (step, map)

    def predict(self, job: Job) -> tuple[int, ...]:
        if job.layer == ENTRY_LAYER:
            return self._best_next(job.request, {}, ENTRY_LAYER)
        current = self._observe(job)
        if job.layer + 1 >= self.num_layers:
            return ()
        return self._best_next(job.request, current, job.layer)

    def forget(self, request: int) -> None:
        self._maps.pop(request, None)
        self._current.pop(request, None)

    def _observe(self, job: Job) -> dict[int, frozenset[int]]:
        step, current = self._current.get(job.request, (job.step, {}))
        if step != job.step:  # a new token: file the finished map
            self._maps.setdefault(job.request, deque(maxlen=self.history)).append(current)
            current = {}
        current[job.layer] = frozenset(job.experts)
        self._current[job.request] = (job.step, current)
        return current

    def _best_next(self, request: int, current: dict[int, frozenset[int]], layer: int) -> tuple[int, ...]:
        maps = self._maps.get(request)
        if not maps:
            return ()
        best_score, best = -1, None
        before, now = layer - 1, layer
        seen_before, seen_now = current.get(before), current.get(now)
        empty: frozenset[int] = frozenset()
        for past in reversed(maps):  # most recent first, so ties keep the most recent
            score = 0
            if seen_before:
                score += len(past.get(before, empty) & seen_before)
            if seen_now:
                score += len(past.get(now, empty) & seen_now)
            if score > best_score:
                best_score, best = score, past
        assert best is not None
        return tuple(sorted(best.get(layer + 1, frozenset())))


def make_predictor(name: str | None, num_layers: int) -> Predictor | None:
    """Build the predictor a policy names (``gate``, ``history``) or None for no prefetching."""
    if name is None:
        return None
    if name == "gate":
        return GatePredictor()
    if name == "history":
        return HistoryPredictor(num_layers)
    raise ValueError(f"unknown prefetch predictor {name!r}; choose 'gate' or 'history'")
