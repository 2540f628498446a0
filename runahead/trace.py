"""Routing traces: which experts every request's token selects at every layer, recorded or synthetic.

A :class:`RoutingTrace` holds ``experts[request, step, layer, k]`` (the gate's top-k, sorted) and
``predicted`` of the same shape: what a speculative gate applied one layer early (on the previous
layer's hidden state) would select for that layer, for the ``prefetch-gate`` policy. Requests may
have different lengths; steps past a request's length are padded with -1.

File format (``.npz``, written by :meth:`RoutingTrace.save`, read without pickle):

* ``experts``: int16 ``[requests, steps, layers, top_k]``; each selection sorted ascending, distinct,
  in ``[0, num_experts)``; -1 for every step at or past ``lengths[request]``.
* ``predicted``: int16, same shape; either a valid selection or all -1 (no prediction recorded).
* ``lengths``: int32 ``[requests]``, each in ``[1, steps]``.
* ``metadata``: a 0-d string array holding JSON: ``format`` (``"runahead-routing-trace"``),
  ``version`` (1), ``num_experts``, ``model``, ``seed``, ``generator`` (the parameters, or null) and,
  optionally, ``model_spec``: the recorded model's shape as the fields of
  :class:`~runahead.specs.ModelSpec` (what ``runahead generate --record-trace`` writes), so the trace
  replays on the sim without a hand-written spec.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from runahead.specs import ModelSpec

FORMAT_NAME = "runahead-routing-trace"
FORMAT_VERSION = 1

Selection = tuple[int, ...]
IntArray = npt.NDArray[np.int16]


class TraceFormatError(ValueError):
    """A trace file or array set that breaks the documented format."""


class RoutingTrace:
    """Per-request, per-step, per-layer expert selections plus a speculative gate's predictions."""

    def __init__(
        self,
        experts: npt.ArrayLike,
        predicted: npt.ArrayLike,
        num_experts: int,
        lengths: npt.ArrayLike | None = None,
        *,
        model: str = "",
        seed: int | None = None,
        generator: dict[str, Any] | None = None,
        spec: ModelSpec | None = None,
        origin: str = "trace",
    ) -> None:
        self.experts: IntArray = np.asarray(experts, dtype=np.int16)
        self.predicted: IntArray = np.asarray(predicted, dtype=np.int16)
        steps = self.experts.shape[1] if self.experts.ndim == 4 else 0
        full = np.full(self.experts.shape[0] if self.experts.ndim else 0, steps, dtype=np.int32)
        self.lengths: npt.NDArray[np.int32] = full if lengths is None else np.asarray(lengths, dtype=np.int32)
        self.model = model
        self.seed = seed
        self.generator = generator
        self.spec = spec
        """The recorded model's shape, when the trace carries one (replayed with it by ``bench --trace``)."""
        _validate(self.experts, self.predicted, self.lengths, num_experts, origin)
        if spec is not None and (spec.num_layers, spec.top_k, spec.num_experts) != (
            self.num_layers,
            self.top_k,
            num_experts,
        ):
            raise TraceFormatError(
                f"{origin}: model_spec has {spec.num_layers} layers x {spec.num_experts} experts, "
                f"top-{spec.top_k}; the selections {self.num_layers} layers x {num_experts} experts, "
                f"top-{self.top_k}"
            )
        self._num_experts = num_experts
        self._selections: dict[int, list[list[Selection]]] = {}
        self._predictions: dict[int, list[list[Selection]]] = {}

    # --- shape ------------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """How many requests the trace holds."""
        return int(self.experts.shape[0])

    @property
    def num_steps(self) -> int:
        """Steps of the longest request (the padded step dimension)."""
        return int(self.experts.shape[1])

    @property
    def num_layers(self) -> int:
        """MoE layers per token."""
        return int(self.experts.shape[2])

    @property
    def top_k(self) -> int:
        """Experts each token selects per layer."""
        return int(self.experts.shape[3])

    @property
    def num_experts(self) -> int:
        """Routed experts per layer."""
        return self._num_experts

    # --- access -----------------------------------------------------------------------------

    def selections(self, request: int) -> list[list[Selection]]:
        """``[step][layer]`` -> sorted expert ids of ``request``; built once, then shared (do not mutate)."""
        if request not in self._selections:
            self._selections[request] = self._tuples(self.experts, request)
        return self._selections[request]

    def predictions(self, request: int) -> list[list[Selection]]:
        """Like :meth:`selections`, for the speculative gate; an empty tuple where none was recorded."""
        if request not in self._predictions:
            self._predictions[request] = self._tuples(self.predicted, request)
        return self._predictions[request]

    def window(
        self, request: int, layer: int, start: int, count: int, *, predicted: bool = False
    ) -> Selection:
        """The distinct experts ``request`` selects at ``layer`` over ``count`` steps from ``start``
        (sorted), the steps taken round its length (past its last step, its first again): what a
        prefill chunk of ``count`` tokens at position ``start`` goes through in the sim. With
        ``predicted``, the speculative gate's. The union of those rows of :meth:`selections`
        (:meth:`predictions`), counted in numpy: a chunk is hundreds of rows, and a loop over them
        was the sim's busiest line in ``bench paper``.
        """
        self._check_request(request)
        length = int(self.lengths[request])
        rows = (self.predicted if predicted else self.experts)[request, :length, layer]
        if count < 1 or length < 1:
            return ()
        start %= length
        if count >= length:
            picked = rows.ravel()
        elif start + count <= length:
            picked = rows[start : start + count].ravel()
        else:
            picked = np.concatenate((rows[start:].ravel(), rows[: start + count - length].ravel()))
        counts = np.bincount(picked.astype(np.intp) + 1, minlength=self._num_experts + 1)  # -1: padding
        return tuple(np.flatnonzero(counts[1:]).tolist())

    def _check_request(self, request: int) -> None:
        if not 0 <= request < self.num_requests:
            raise IndexError(f"request {request} out of range [0, {self.num_requests})")

    def _tuples(self, array: IntArray, request: int) -> list[list[Selection]]:
        self._check_request(request)
        rows = array[request, : int(self.lengths[request])].tolist()
        return [[tuple(e for e in sel if e >= 0) for sel in step] for step in rows]

    # --- files ------------------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """The JSON metadata of the file: format, version, num_experts, model, seed, generator, model_spec."""
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "num_experts": self._num_experts,
            "model": self.model,
            "seed": self.seed,
            "generator": self.generator,
        }
        if self.spec is not None:
            meta["model_spec"] = asdict(self.spec)
        return meta

    def save(self, path: str | Path) -> None:
        """Write the trace as an ``.npz`` file in the format of the module docstring."""
        with open(path, "wb") as f:
            np.savez_compressed(
                f,
                experts=self.experts,
                predicted=self.predicted,
                lengths=self.lengths,
                metadata=np.array(json.dumps(self.metadata())),
            )

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read a trace written by :meth:`save`; raises :class:`TraceFormatError` naming file and problem."""
        origin = str(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:
            raise TraceFormatError(f"{origin}: not a readable .npz file ({exc})") from None
        missing = sorted({"experts", "predicted", "lengths", "metadata"} - set(arrays))
        if missing:
            raise TraceFormatError(f"{origin}: missing arrays {missing}")
        try:
            meta = json.loads(str(arrays["metadata"]))
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{origin}: metadata is not JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{origin}: metadata format is not {FORMAT_NAME!r}")
        if meta.get("version") != FORMAT_VERSION:
            raise TraceFormatError(
                f"{origin}: format version {meta.get('version')!r}, expected {FORMAT_VERSION}"
            )
        num_experts = meta.get("num_experts")
        if not isinstance(num_experts, int):
            raise TraceFormatError(f"{origin}: metadata num_experts must be an integer")
        for name in ("experts", "predicted", "lengths"):
            if arrays[name].dtype.kind not in "iu":
                raise TraceFormatError(f"{origin}: {name} must hold integers, got {arrays[name].dtype}")
        return cls(
            arrays["experts"],
            arrays["predicted"],
            num_experts,
            arrays["lengths"],
            model=str(meta.get("model", "")),
            seed=meta.get("seed"),
            generator=meta.get("generator"),
            spec=_spec(meta.get("model_spec"), origin),
            origin=origin,
        )

    @classmethod
    def from_selections(
        cls,
        selections: Sequence[Sequence[Sequence[Sequence[int]]]],
        num_experts: int,
        predictions: Sequence[Sequence[Sequence[Sequence[int]]]] | None = None,
        *,
        model: str = "",
        spec: ModelSpec | None = None,
    ) -> RoutingTrace:
        """Build a trace from a recorded run: ``selections[request][step][layer]`` -> expert ids.

        Requests may differ in length; ``predictions`` (same nesting) is optional and stays all -1
        (no prediction) where absent. Selections are sorted; all must have the same top-k.
        """
        if isinstance(selections, dict):
            raise TraceFormatError(
                "from_selections takes [request][step][layer] -> experts lists; for a runtime's "
                "recorder.selections use RoutingTrace.from_recorder"
            )
        if not selections or not selections[0] or not selections[0][0]:
            raise TraceFormatError("from_selections: need at least one request with one step")
        layers, top_k = len(selections[0][0]), len(selections[0][0][0])
        steps = max(len(request) for request in selections)
        experts = np.full((len(selections), steps, layers, top_k), -1, dtype=np.int16)
        predicted = np.full_like(experts, -1)
        lengths = np.array([len(request) for request in selections], dtype=np.int32)
        for r, request in enumerate(selections):
            experts[r, : len(request)] = _padded(request, layers, top_k, f"request {r}")
            if predictions is not None:
                predicted[r, : len(predictions[r])] = _padded(
                    predictions[r], layers, top_k, f"prediction {r}"
                )
        return cls(experts, predicted, num_experts, lengths, model=model, spec=spec, origin="from_selections")

    @classmethod
    def from_recorder(
        cls,
        recorded: dict[int, list[tuple[int, int, tuple[int, ...]]]],
        num_layers: int,
        num_experts: int,
        *,
        model: str = "",
        spec: ModelSpec | None = None,
    ) -> RoutingTrace:
        """Build a trace from ``runtime.recorder.selections`` (``request -> [(step, layer, experts)]``).

        The recorder holds decode steps only (a prompt's pass selects the union of its tokens' experts);
        a request that decoded no step is left out.
        """
        selections = []
        for request in sorted(recorded):
            steps: dict[int, list[tuple[int, ...]]] = {}
            for step, layer, experts in recorded[request]:
                steps.setdefault(step, [()] * num_layers)[layer] = experts
            if steps:
                selections.append([steps[s] for s in sorted(steps)])
        if not selections:
            raise TraceFormatError("no decode step was recorded: a trace needs at least two generated tokens")
        return cls.from_selections(selections, num_experts, model=model, spec=spec)


def _spec(fields: Any, origin: str) -> ModelSpec | None:
    if fields is None:
        return None
    try:
        return ModelSpec(**{**fields, "sources": tuple(fields.get("sources", ()))})
    except (TypeError, ValueError, AttributeError) as exc:
        raise TraceFormatError(f"{origin}: metadata model_spec is not a model spec ({exc})") from None


def _padded(request: Sequence[Sequence[Sequence[int]]], layers: int, top_k: int, what: str) -> IntArray:
    try:
        array = np.sort(np.asarray(request, dtype=np.int16), axis=-1)
    except ValueError:
        raise TraceFormatError(
            f"from_selections: {what} is ragged (every layer needs {top_k} experts)"
        ) from None
    if array.ndim != 3 or array.shape[1:] != (layers, top_k):
        raise TraceFormatError(
            f"from_selections: {what} has shape {array.shape}, expected (steps, {layers}, {top_k})"
        )
    return array


def _validate(
    experts: IntArray, predicted: IntArray, lengths: npt.NDArray[np.int32], num_experts: int, origin: str
) -> None:
    def fail(problem: str) -> None:
        raise TraceFormatError(f"{origin}: {problem}")

    if experts.ndim != 4 or min(experts.shape, default=0) < 1:
        fail(f"experts must be a non-empty [requests, steps, layers, top_k] array, got shape {experts.shape}")
    if predicted.shape != experts.shape:
        fail(f"predicted has shape {predicted.shape}, experts {experts.shape}")
    requests, steps, _, top_k = experts.shape
    if lengths.shape != (requests,):
        fail(f"lengths has shape {lengths.shape}, expected ({requests},)")
    if lengths.min() < 1 or lengths.max() > steps:
        fail(f"lengths must lie in [1, {steps}], got [{lengths.min()}, {lengths.max()}]")
    if not 1 <= top_k <= num_experts <= np.iinfo(np.int16).max:
        fail(f"num_experts {num_experts} must be >= top_k {top_k} and fit in int16")
    live = np.arange(steps)[None, :] < lengths[:, None]  # [requests, steps]
    if np.any(experts[~live] != -1):
        fail("steps past a request's length must be padded with -1")
    for name, array, optional in (("experts", experts, False), ("predicted", predicted, True)):
        rows = array[live]  # [n, layers, top_k]
        missing = np.all(rows == -1, axis=-1)
        if optional:
            rows = rows[~missing]
        elif np.any(missing):
            fail(f"{name}: a step within a request's length has no selection")
        if rows.size and (rows.min() < 0 or rows.max() >= num_experts):
            fail(f"{name}: expert ids must lie in [0, {num_experts})")
        if rows.size and np.any(np.diff(rows, axis=-1) <= 0):
            fail(f"{name}: each selection must hold {top_k} distinct experts in ascending order")
    if np.any(predicted[~live] != -1):
        fail("predicted: steps past a request's length must be padded with -1")
