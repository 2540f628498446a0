"""Figure 1: expert-prediction precision of a gate-based prefetcher vs the expert cache's size.

A pure replay over a synthetic routing trace (no runtime, no clock), like
:func:`runahead.replay.replay_fetches`. Each trace request is replayed alone (the paper's
precision analysis follows one request's next-layer needs), token by token, layer by layer:

* before layer ``l`` runs, the speculative gate's guess for ``l`` (``trace.predictions``, made one
  layer early) is prefetched: every predicted expert that is not resident. *Precision* is the
  fraction of those prefetched experts that layer ``l`` actually selects;
* then layer ``l``'s selection is served from the cache, missing experts inserted, evicting with
  LRU or LFU (experts in use at the layer are not evictable), exactly as
  :func:`runahead.replay.cache_hold_fraction` does. Prefetched experts are not inserted: the replay
  measures what a prefetcher would fetch beside a cache, not a particular prefetcher's pollution.

Caches: ``lru``, ``lfu``, ``random`` (at each layer, the LFU cache's number of resident experts and
of resident *needed* experts, but drawn uniformly at random, so residency says nothing about
predictability: the paper's randomized cache, which isolates "fewer needed candidates remain"
(region 1) from "the cache keeps the predictable experts" (region 2)), and ``none`` (no cache:
every prediction is prefetched). The first ``warmup_steps`` tokens fill the cache uncounted.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from runahead.eviction import make_eviction
from runahead.paper.settings import PrecisionPoint
from runahead.replay import use_in_replay
from runahead.specs import load_model_spec
from runahead.synthetic import default_trace
from runahead.trace import RoutingTrace


def replay_precision(
    trace: RoutingTrace,
    cache: str,
    cache_fraction: float,
    *,
    warmup_steps: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Replay every request of ``trace`` alone under ``cache``; return the precision counts.

    Returns ``prefetched`` (predicted, non-resident), ``useful`` (of those, selected),
    ``precision`` (useful / prefetched), ``needed`` and ``held`` (selections resident when needed),
    ``hold_fraction`` and ``candidates_needed`` (needed experts among the non-resident ones, per layer).
    """
    if cache not in ("none", "lru", "lfu", "random"):
        raise ValueError(f"unknown cache {cache!r}; choose none, lru, lfu or random")
    layers, experts = trace.num_layers, trace.num_experts
    capacity = round(cache_fraction * layers * experts) if cache != "none" else 0
    if cache != "none" and capacity < trace.top_k:
        raise ValueError(f"a cache of {capacity} entries cannot hold one layer's {trace.top_k} experts")
    rng = np.random.default_rng([seed, 0xCAC4E])
    every_expert = list(range(experts))
    prefetched = useful = needed_total = held = 0
    for request in range(trace.num_requests):
        selections, predictions = trace.selections(request), trace.predictions(request)
        policy = make_eviction("lfu" if cache in ("random", "none") else cache)
        resident: set[Hashable] = set()
        per_layer = [0] * layers  # resident experts per layer
        for step in range(len(selections)):
            counted = step >= warmup_steps
            for layer in range(layers):
                needed = selections[step][layer]
                keys = [(layer, e) for e in needed]
                held_now = sum(map(resident.__contains__, keys))
                predicted = predictions[step][layer]
                if counted and layer > 0 and predicted:
                    if cache == "random":
                        fetch = _random_view_misses(
                            rng, every_expert, needed, per_layer[layer], held_now, predicted
                        )
                    elif cache == "none":
                        fetch = list(predicted)
                    else:
                        fetch = [e for e in predicted if (layer, e) not in resident]
                    prefetched += len(fetch)
                    useful += sum(1 for e in fetch if e in needed)
                if counted:
                    needed_total += len(needed)
                    held += held_now
                if cache == "none":
                    continue
                for key in keys:
                    policy.touch(key)
                per_layer[layer] += len(keys) - held_now
                for victim in use_in_replay(policy, resident, capacity, keys):
                    per_layer[victim[0]] -= 1  # type: ignore[index]
    return {
        "prefetched": prefetched,
        "useful": useful,
        "precision": useful / prefetched if prefetched else float("nan"),
        "needed": needed_total,
        "held": held,
        "hold_fraction": held / needed_total if needed_total else float("nan"),
    }


def _random_view_misses(
    rng: np.random.Generator,
    every_expert: list[int],
    needed: Sequence[int],
    resident_here: int,
    held_here: int,
    predicted: Sequence[int],
) -> list[int]:
    """The predicted experts a randomized cache does not hold: one holding ``resident_here`` of the
    layer's experts, ``held_here`` of them needed, each drawn uniformly at random (in this order:
    the others, then the needed ones, so a seed gives the same draws as ever)."""
    others = every_expert.copy()
    for e in sorted(needed, reverse=True):  # the layer's experts but the needed (distinct) ones
        del others[e]
    count = resident_here - held_here
    picks: list[int] = rng.choice(len(others), size=count, replace=False).tolist() if count else []
    view = {others[i] for i in picks}
    view.update(rng.choice(needed, size=held_here, replace=False).tolist())
    return [e for e in predicted if e not in view]


def run_precision_point(point: PrecisionPoint) -> dict[str, Any]:
    """The result row of one precision point (a synthetic trace of the model's shape)."""
    model = load_model_spec(point.model)
    trace = default_trace(model, point.requests, point.warmup_steps + point.steps, point.seed)
    counts = replay_precision(
        trace, point.cache, point.cache_fraction, warmup_steps=point.warmup_steps, seed=point.seed
    )
    return {"kind": "precision", **_fields(point), **counts}


def _fields(point: PrecisionPoint) -> dict[str, Any]:
    return {name: getattr(point, name) for name in point.__dataclass_fields__}
