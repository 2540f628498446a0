"""Pure replays of a routing trace under a cache, without actors or clocks.

:func:`cache_hold_fraction` (what a cache holds of one request's needs) and :func:`replay_fetches`
(the ``sync`` policy's fetches per decode step) tune and check the synthetic router;
:func:`use_in_replay` is one layer's use of a replayed cache, shared with the paper's precision
analysis.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from runahead.eviction import EvictionPolicy, make_eviction
from runahead.jobs import ExpertKey
from runahead.trace import RoutingTrace


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
