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
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from runahead.eviction import EvictionPolicy, make_eviction
from runahead.jobs import ExpertKey
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

    def _tuples(self, array: IntArray, request: int) -> list[list[Selection]]:
        if not 0 <= request < self.num_requests:
            raise IndexError(f"request {request} out of range [0, {self.num_requests})")
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


# --- synthetic routing ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyntheticRouting:
    """Parameters of the synthetic router; :func:`synthetic_trace` gives the model, term by term.

    TUNED (the defaults, seed 0; checked in tests/test_calibration.py with :func:`replay_fetches`,
    which the bench's ``sync`` runtime matches fetch for fetch) to the paper's fetch figures:

    * about 235 experts fetched per decode step, Gemma4-26B-A4B, 8 requests, 30% LFU cache,
      llama.cpp + LFU (our ``sync``): 245 (mean of 256 steps after 8 warm-up steps);
    * per-step fetch time 55.7-160.1 ms over 256 steps, read as Qwen3.6-35B-A3B, 6 requests, 30%
      cache, ``sync`` + LFU on the mac-mini profile (5 GB/s link, 1.77 MB experts), i.e. about
      157-452 fetches per step: 141-346 (mean 181);
    * a speculative gate's precision without a cache within the literature's 60-80%: 0.67.

    NOT reached: the paper's "a 30% cache holds 54.1% of needed experts", read per request (one
    request alone, :func:`cache_hold_fraction`): 0.885 here. No setting of this model reaches both
    that and the fetch figures: with requests routed independently, the per-step fetches of N
    requests are at least roughly N times one request's misses less what the requests share,
    so a request that misses 46% of its experts alone gives 3-4x the paper's fetches in company
    (the first default did: 0.68 held alone, ~800 fetches per step). See the calibration tests.

    The knobs:

    * ``popularity_skew``: Zipf exponent of the per-layer expert popularity every request shares
      (a score of ``-skew * log(rank + 1)``); the dominant term, and what makes requests share.
    * ``topic_strength``: scale of a topic's Gaussian per-layer preference over experts.
    * ``num_topics``: topics come from a pool of this many shared by all requests (0: every topic
      is private to one request and one episode).
    * ``topic_switch_prob``: per request and step, the chance the request moves to a fresh topic
      (drawn from the pool); temporal reuse does not carry across a switch, so a switch is a burst
      of misses: the source of the step-to-step variation in fetches.
    * ``num_clusters``, ``cluster_boost``, ``cluster_stickiness``: cross-layer correlation (a
      latent cluster per token and layer that carries to the next layer with probability
      ``cluster_stickiness``; the cluster's experts get ``cluster_boost``).
    * ``reuse_boost``: bonus for the experts the request's previous token used at the same layer
      (per-request temporal reuse).
    * ``gate_correlation``: correlation of the speculative gate's noise with the real gate's; sets
      the prefetch precision (the structure above is what the early gate can predict).
    """

    popularity_skew: float = 1.25
    topic_strength: float = 1.0
    num_topics: int = 32
    topic_switch_prob: float = 0.03
    num_clusters: int = 16
    cluster_boost: float = 2.5
    cluster_stickiness: float = 0.7
    reuse_boost: float = 2.8
    gate_correlation: float = 0.3

    def __post_init__(self) -> None:
        for name in ("popularity_skew", "topic_strength", "cluster_boost", "reuse_boost"):
            if getattr(self, name) < 0:
                raise ValueError(f"SyntheticRouting: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("cluster_stickiness", "gate_correlation", "topic_switch_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"SyntheticRouting: {name} must lie in [0, 1], got {getattr(self, name)}")
        if self.num_clusters < 1:
            raise ValueError(f"SyntheticRouting: num_clusters must be >= 1, got {self.num_clusters}")
        if self.num_topics < 0:
            raise ValueError(f"SyntheticRouting: num_topics must be >= 0, got {self.num_topics}")


def synthetic_trace(
    num_layers: int,
    num_experts: int,
    top_k: int,
    num_requests: int,
    num_steps: int,
    seed: int,
    params: SyntheticRouting | None = None,
    *,
    model: str = "",
) -> RoutingTrace:
    """A seeded, deterministic synthetic trace; called by the bench and tests when no recorded trace is given.

    NOTE (the model). Token t of request r selects at layer l the top-k of ``score + gumbel``, which
    draws k distinct experts without replacement in proportion to ``exp(score)`` (a softmax gate's
    top-k under noise), where ``score`` adds:

    * popularity: ``-popularity_skew * log(rank + 1)`` over a random per-layer ranking (Zipf-like),
      shared by every request;
    * topic: the per-layer Gaussian preference (scale ``topic_strength``) of the request's current
      topic; a request starts on a random topic and moves to a new one with probability
      ``topic_switch_prob`` per step (topics drawn from a shared pool of ``num_topics``, or private);
    * cross-layer correlation: a latent cluster per (token, layer) that carries over to the next
      layer with probability ``cluster_stickiness``; the experts of the token's cluster (a random
      partition per layer) get ``cluster_boost``, so an expert at layer l makes its cluster's
      experts at l+1 likelier;
    * temporal reuse: the experts the request's previous token used at this layer get
      ``reuse_boost``, unless the request switched topic at this token.

    ``predicted`` is the speculative gate's top-k for the same layer, made one layer early: it sees
    the previous layer's cluster instead of this layer's, and noise ``rho * gumbel + sqrt(1 - rho^2)
    * gumbel'`` (``rho = gate_correlation``). Choices the structure explains (popular, reused,
    on-topic, same cluster) are predictable; noise-driven ones mostly are not.
    """
    p = params if params is not None else SyntheticRouting()
    if min(num_layers, num_experts, top_k, num_requests, num_steps) < 1 or top_k > num_experts:
        raise ValueError("synthetic_trace: sizes must be >= 1 and top_k <= num_experts")
    rng = np.random.default_rng(seed)
    shape = (num_requests, num_layers, num_experts)
    ranks = np.argsort(rng.random((num_layers, num_experts)), axis=1)  # rank of each expert per layer
    popularity = (-p.popularity_skew * np.log1p(ranks)).astype(np.float32)
    topic_of = _topic_paths(rng, num_requests, num_steps, p)  # [R, T] index into topics
    topics = np.float32(p.topic_strength) * rng.standard_normal(
        (int(topic_of.max()) + 1, num_layers, num_experts), dtype=np.float32
    )
    topics += popularity[None]
    clusters = _cluster_paths(rng, num_requests, num_steps, num_layers, p)  # [R, T, L]
    gate_view = np.concatenate([clusters[:, :, :1], clusters[:, :, :-1]], axis=2)  # one layer early
    cluster_of = (np.argsort(rng.random((num_layers, num_experts)), axis=1) % p.num_clusters)[None]
    cluster_boost, reuse_boost = np.float32(p.cluster_boost), np.float32(p.reuse_boost)
    rho = np.float32(p.gate_correlation)
    rho_other = np.float32(math.sqrt(1.0 - p.gate_correlation**2))

    experts = np.empty((num_requests, num_steps, num_layers, top_k), dtype=np.int16)
    predicted = np.empty_like(experts)
    previous: npt.NDArray[np.intp] | None = None
    for t in range(num_steps):
        base = topics[topic_of[:, t]]  # [R, L, E], a copy
        noise = _gumbel(rng, shape)
        gate = base + rho * noise
        gate += rho_other * _gumbel(rng, shape)
        gate += cluster_boost * (cluster_of == gate_view[:, t, :, None])
        score = base
        score += noise
        score += cluster_boost * (cluster_of == clusters[:, t, :, None])
        if previous is not None:
            same_topic = topic_of[:, t] == topic_of[:, t - 1]  # no reuse across a topic switch
            carry = (reuse_boost * same_topic)[:, None, None]
            for s in (score, gate):
                np.put_along_axis(s, previous, np.take_along_axis(s, previous, axis=2) + carry, axis=2)
        previous = np.argpartition(score, -top_k, axis=-1)[..., -top_k:]
        experts[:, t] = np.sort(previous, axis=-1)
        predicted[:, t] = np.sort(np.argpartition(gate, -top_k, axis=-1)[..., -top_k:], axis=-1)
    generator = {"kind": "synthetic", **asdict(p)}
    return RoutingTrace(experts, predicted, num_experts, model=model, seed=seed, generator=generator)


def default_trace(model: ModelSpec, num_requests: int, num_steps: int, seed: int) -> RoutingTrace:
    """The synthetic trace the bench uses for ``model``: default :class:`SyntheticRouting`, model's shape."""
    return synthetic_trace(
        model.num_layers, model.num_experts, model.top_k, num_requests, num_steps, seed, model=model.name
    )


def _topic_paths(
    rng: np.random.Generator, requests: int, steps: int, p: SyntheticRouting
) -> npt.NDArray[np.intp]:
    """``[request, step]`` -> topic index: a new topic at each switch, from the pool if ``num_topics``."""
    switches = rng.random((requests, steps)) < p.topic_switch_prob
    switches[:, 0] = True
    episode = np.cumsum(switches.ravel()).reshape(requests, steps) - 1  # distinct per (request, episode)
    if p.num_topics == 0:
        return episode.astype(np.intp)
    pool = rng.integers(0, p.num_topics, int(episode.max()) + 1)
    return np.asarray(pool[episode], dtype=np.intp)


def _cluster_paths(
    rng: np.random.Generator, requests: int, steps: int, layers: int, p: SyntheticRouting
) -> npt.NDArray[np.int64]:
    paths = np.empty((requests, steps, layers), dtype=np.int64)
    paths[:, :, 0] = rng.integers(0, p.num_clusters, (requests, steps))
    for layer in range(1, layers):
        fresh = rng.integers(0, p.num_clusters, (requests, steps))
        keep = rng.random((requests, steps)) < p.cluster_stickiness
        paths[:, :, layer] = np.where(keep, paths[:, :, layer - 1], fresh)
    return paths


def _gumbel(rng: np.random.Generator, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    uniform = rng.random(shape, dtype=np.float32)
    np.maximum(uniform, np.float32(1e-30), out=uniform)
    np.log(uniform, out=uniform)  # in place: this runs twice per step on [requests, layers, experts]
    np.negative(uniform, out=uniform)
    np.log(uniform, out=uniform)
    return np.negative(uniform, out=uniform)


# --- replay -----------------------------------------------------------------------------------


def cache_hold_fraction(trace: RoutingTrace, cache_fraction: float, eviction: str = "lfu") -> float:
    """Fraction of needed experts (one per request and selection) resident when needed, under a cache.

    Meant per request: on a ONE-request trace it is what a cache holds of that request's needs,
    the reading of the paper's "a 30% cache holds 54.1% of needed experts" (its prefetch-precision
    analysis follows one request's next-layer needs). On a trace of several requests it is the
    hold fraction of the batch as a whole.

    Replays the trace in decode order (step by step, layer by layer, all of the step's requests at
    each layer, as one batch would), with capacity ``round(cache_fraction * layers * experts)``,
    starting empty. An expert counts as held when it is resident as the layer starts; misses are
    inserted after use, evicting with ``runahead.eviction.make_eviction(eviction)``; experts in use
    at the current layer are not evictable. Used to tune and check the synthetic router.
    """
    capacity = round(cache_fraction * trace.num_layers * trace.num_experts)
    if capacity < trace.num_requests * trace.top_k:
        raise ValueError(f"cache of {capacity} entries cannot hold one layer's selections of every request")
    policy = make_eviction(eviction)
    resident: set[Hashable] = set()
    per_request = [trace.selections(r) for r in range(trace.num_requests)]
    held = needed = 0
    for step in range(trace.num_steps):
        active = [sel for sel in per_request if step < len(sel)]
        for layer in range(trace.num_layers):
            uses = [ExpertKey(layer, e) for sel in active for e in sel[step][layer]]
            in_use = set(uses)
            needed += len(uses)
            for key in uses:
                policy.touch(key)
                if key in resident:
                    held += 1
            use_in_replay(policy, resident, capacity, in_use)
    return held / needed


def use_in_replay(
    policy: EvictionPolicy, resident: set[Hashable], capacity: int, keys: Iterable[Hashable]
) -> list[Hashable]:
    """One layer's use of ``keys`` in a replayed cache of ``capacity`` entries; returns the evicted.

    The keys are in use (not evictable) while they are brought in; absent ones are inserted,
    evicting the policy's victims; afterwards all become eviction candidates again. Callers
    ``touch`` the keys themselves (they count uses differently).
    """
    keys = list(keys)
    evicted = []
    for key in keys:
        if key in resident:
            policy.remove(key)
            continue
        if len(resident) >= capacity:
            victim = policy.pop_victim()
            assert victim is not None, "capacity >= the keys in use leaves an evictable entry"
            resident.discard(victim)
            evicted.append(victim)
        resident.add(key)
    for key in keys:
        policy.add(key)
    return evicted


def replay_fetches(
    trace: RoutingTrace,
    cache_fraction: float,
    eviction: str = "lfu",
    warmup_steps: int = 8,
    num_requests: int | None = None,
) -> list[int]:
    """Experts fetched per decode step when the trace's requests decode together under ``sync``.

    A pure replay of what the runtime does with policy ``sync`` (one static group of every
    request, step barrier on, no prefetch) on the trace, without actors or clocks, for tuning the
    synthetic router and for per-step statistics (the runtime only reports totals). ``num_requests``
    requests (default: the trace's; request ``r`` follows trace request ``r % trace.num_requests``,
    as in the bench) share a cache of ``max(1, round(cache_fraction * layers * experts))`` entries
    (``runahead.bench.cache_slots``) evicting with ``runahead.eviction.make_eviction(eviction)``.

    * Warm-up: the first ``warmup_steps`` steps are loaded as ``ExpertCache.warm`` loads
      ``runahead.bench.warm_keys``: step by step, layer by layer, request by request, one touch per
      use, nothing protected, nothing counted.
    * Decode: every later step, layer by layer, each request pins its selection (one touch per
      use); the union's experts that are not resident are fetched (counted) into free slots or
      slots of evicted entries, never evicting an expert pinned at the current layer; after the
      layer's compute the pins are released, and an expert becomes an eviction candidate when its
      last pin goes.

    Only eviction ties depend on the order of releases, and to match the runtime exactly that
    order is the runtime's group order: requests whose experts were all resident first, then the
    blocked ones in the order their last missing expert landed (fetches start in blocking order,
    each job's missing experts in gate order, and land in the order they start). Returns one
    count per decode step; the bench's ``fetches`` for the same trace and point is their sum.
    """
    requests = trace.num_requests if num_requests is None else num_requests
    layers, experts = trace.num_layers, trace.num_experts
    capacity = max(1, round(cache_fraction * layers * experts))
    if requests < 1 or not 0 <= warmup_steps < trace.num_steps:
        raise ValueError(f"need >= 1 request and 0 <= warmup_steps < {trace.num_steps} steps")
    if capacity < requests * trace.top_k:
        raise ValueError(
            f"cache of {capacity} entries cannot hold one layer's selections of {requests} requests "
            "(the runtime would admit fewer at a time)"
        )
    if int(trace.lengths.min()) < trace.num_steps:
        raise ValueError("replay_fetches needs every request to run the trace's full length")
    policy = make_eviction(eviction)
    touch, add, pop_victim = policy.touch, policy.add, policy.pop_victim
    resident: set[Hashable] = set()
    # keys are layer * experts + expert: the policy only hashes them, ties break by sequence
    chosen = [
        (
            trace.experts[r % trace.num_requests].astype(np.int64) + np.arange(layers)[:, None] * experts
        ).tolist()
        for r in range(requests)
    ]  # [request][step][layer] -> keys
    for step in range(warmup_steps):
        for layer in range(layers):
            for r in range(requests):
                for key in chosen[r][step][layer]:
                    touch(key)
                    if key in resident:
                        add(key)
                        continue
                    if len(resident) >= capacity:
                        resident.discard(pop_victim(resident.__contains__))
                    resident.add(key)
                    add(key)
    pins: dict[Hashable, int] = {}  # the current layer's pinned experts -> pins

    def evictable(key: Hashable) -> bool:
        return key in resident and key not in pins

    order = list(range(requests))
    counts = []
    for step in range(warmup_steps, trace.num_steps):
        fetched = 0
        for layer in range(layers):
            pins.clear()
            ready: list[int] = []
            blocked: list[tuple[int, list[int]]] = []
            for r in order:
                missing = []
                for key in chosen[r][step][layer]:
                    touch(key)
                    pins[key] = pins.get(key, 0) + 1
                    if key not in resident:
                        missing.append(key)
                if missing:
                    blocked.append((r, missing))
                else:
                    ready.append(r)
            started: dict[int, int] = {}  # key -> position in fetch order
            for _, missing in blocked:
                for key in missing:
                    if key not in started:
                        started[key] = len(started)
            for key in started:
                if len(resident) >= capacity:
                    victim = pop_victim(evictable)
                    assert victim is not None, "the capacity check leaves an unpinned entry to evict"
                    resident.discard(victim)
                resident.add(key)
            fetched += len(started)
            landed = sorted(range(len(blocked)), key=lambda i: (max(started[k] for k in blocked[i][1]), i))
            order = ready + [blocked[i][0] for i in landed]
            for r in order:
                for key in chosen[r][step][layer]:
                    left = pins[key] - 1
                    pins[key] = left
                    if not left:
                        add(key)  # its last pin went: an eviction candidate again
        counts.append(fetched)
    return counts
