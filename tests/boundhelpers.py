"""Small cases for the bound's tests (tests/test_bound.py, tests/test_relaxation.py)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from runahead.backends.sim import SimCosts
from runahead.bound import SmallCase
from runahead.jobs import ExpertKey, Job, distinct_experts
from runahead.trace import RoutingTrace


def one_layer_case(fetch_s: float) -> SmallCase:
    """Two requests, one step, one MoE layer; request 0's expert is resident, request 1's is read.

    A group costs 1 s + 0.5 s per job. Both entry jobs compute together (0-2 s); then request 0
    is ready and request 1's read runs 2 s -> 2 + fetch_s.
    """

    def group_s(jobs: Sequence[Job]) -> float:
        return 1.0 + 0.5 * len(jobs)

    return SmallCase([[[(0,)]], [[(1,)]]], frozenset({ExpertKey(0, 0)}), fetch_s, group_s)


def three_request_case() -> SmallCase:
    """Three requests, four layers, half the experts resident: big enough to have choices."""
    layers, experts = 4, 6
    picks = list(itertools.combinations(range(experts), 2))
    selections = [
        [[picks[(7 * r + 5 * layer + 3) % len(picks)] for layer in range(layers)]] for r in range(3)
    ]
    resident = frozenset(ExpertKey(layer, e) for layer in range(layers) for e in range(0, experts, 2))

    def group_s(jobs: Sequence[Job]) -> float:
        return 0.3 + 0.05 * len({e for job in jobs for e in job.experts})

    return SmallCase(selections, resident, 0.2, group_s)


def traced_case(
    trace: RoutingTrace, costs: SimCosts, *, latency_s: float = 0.0, queue_depth: int = 1
) -> SmallCase:
    """The case of a whole routing trace (every request, step and layer; nothing resident) at the sim
    backend's ``costs``: what :func:`simhelpers.simulate` runs on the same trace."""
    steps, layers = trace.num_steps, trace.num_layers
    selections = [
        [[tuple(trace.selections(r)[s][layer]) for layer in range(layers)] for s in range(steps)]
        for r in range(trace.num_requests)
    ]

    def group_s(jobs: Sequence[Job]) -> float:
        return costs.compute_time(jobs[0].layer, [1] * len(jobs), [1] * len(jobs), distinct_experts(jobs))

    transfer_s = costs.fetch_transfer_time()
    return SmallCase(
        selections, frozenset(), transfer_s, group_s, latency_s=latency_s, queue_depth=queue_depth
    )


SHAPES = ((2, 2, 3), (3, 1, 3), (3, 2, 2), (2, 1, 5))
"""(requests, steps, layers) of :func:`random_case`'s cases: small enough to try every decision of."""


def random_case(
    seed: int, linked: bool = False, shapes: Sequence[tuple[int, int, int]] = SHAPES
) -> SmallCase:
    """A random case of one of ``shapes``, 6 experts a layer, top-2; ``linked``: on the sim's link (a
    read latency, several reads in flight) instead of one read at a time."""
    rng = random.Random(seed)
    requests, steps, layers = rng.choice(list(shapes))
    selections = [
        [[tuple(rng.sample(range(6), 2)) for _ in range(layers)] for _ in range(steps)]
        for _ in range(requests)
    ]
    keys = [ExpertKey(layer, e) for layer in range(layers) for e in range(6)]
    resident = frozenset(key for key in keys if rng.random() < 0.4)
    shared, per_expert = rng.uniform(0.2, 1.0), rng.uniform(0.02, 0.2)

    def group_s(jobs: Sequence[Job]) -> float:
        return shared + per_expert * len({e for job in jobs for e in job.experts}) + 0.01 * len(jobs)

    fetch_s = rng.uniform(0.05, 0.6)
    if not linked:
        return SmallCase(selections, resident, fetch_s, group_s)
    latency, depth = rng.uniform(0.0, 1.0) * fetch_s, rng.choice([2, 3, 4])
    return SmallCase(selections, resident, fetch_s, group_s, latency_s=latency, queue_depth=depth)
