"""Shared helpers: small random routings and one-call simulated runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runahead.backends.sim import FixedCosts, SimBackend, SimCosts
from runahead.clock import run_virtual
from runahead.jobs import RequestSpec
from runahead.runtime import Runtime, RuntimeConfig
from runahead.trace import RoutingTrace

POLICIES = [
    "runahead",
    "sync",
    "prefetch-gate",
    "prefetch-history",
    "runahead+prefetch",
    "runahead/compute=fifo",
    "runahead/fetch=global-srtf",
    "runahead/fetch=fifo",
    "runahead/grouping=static:2:1",
    "runahead/grouping=bottleneck",
]
"""Every policy and ablation: the exactness tests run each of them."""

COSTS = FixedCosts(group_s=0.001, per_expert_s=0.0002, transfer_s=0.0005, latency_s=0.0001)


def random_trace(
    requests: int, steps: int, layers: int, experts: int, top_k: int, seed: int = 0
) -> RoutingTrace:
    """Uniformly random routing; predictions are the true next-layer choices half the time."""
    rng = np.random.default_rng(seed)
    selections = [
        [[rng.choice(experts, top_k, replace=False).tolist() for _ in range(layers)] for _ in range(steps)]
        for _ in range(requests)
    ]
    predictions = [
        [
            [
                sel if rng.random() < 0.5 else rng.choice(experts, top_k, replace=False).tolist()
                for sel in step
            ]
            for step in request
        ]
        for request in selections
    ]
    return RoutingTrace.from_selections(selections, experts, predictions)


def simulate(
    trace: RoutingTrace,
    *,
    policy: str,
    slots: int,
    requests: Sequence[RequestSpec],
    costs: SimCosts = COSTS,
    **config: object,
) -> Runtime:
    """Run ``requests`` on the sim backend in virtual time; return the finished runtime."""
    runtime = Runtime(SimBackend(trace, costs), RuntimeConfig(cache_slots=slots, policy=policy, **config))  # type: ignore[arg-type]
    runtime.results = run_virtual(lambda: runtime.run(requests))  # type: ignore[attr-defined]
    return runtime
