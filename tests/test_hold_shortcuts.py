"""The hold rule's shortcut decides exactly what pricing every wait does.

``weigh_hold`` stops pricing longer waits once a wait's idle leaves less than the best saving found
(a wait saves at most the ready group's cost): checked against every wait priced, on random cases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from runahead.bottleneck import HoldVerdict, landing_order, weigh_hold
from runahead.costs import CostModel
from runahead.jobs import Job
from runahead.specs import load_model_spec, load_profile


def _weigh_every_wait(
    now: float,
    ready: Sequence[Job],
    waiting: Sequence[tuple[float, Job]],
    link_free_at: float,
    group_s: Callable[[Sequence[Job]], float],
    tail: bool,
) -> HoldVerdict:
    """``weigh_hold`` as the NOTE states it: every wait priced, no shortcut (the test's reference)."""
    g_ready = group_s(ready)
    best, best_gain, top_gain = None, 0.0, 0.0
    for k in range(1, len(waiting) + 1):
        held = [job for _, job in waiting[:k]]
        start = max(now, waiting[k - 1][0])
        together = group_s([*ready, *held])
        gain = g_ready + group_s(held) - together - (start - now)
        top_gain = max(top_gain, gain)
        if gain <= best_gain + 1e-12:
            continue
        if tail:
            rest = [job for _, job in waiting[k:]]
            end = start + together
            if rest:
                end = max(end, waiting[-1][0]) + group_s(rest)
            others = [job for _, job in waiting]
            limit = max(now + g_ready, waiting[-1][0]) + group_s(others)
        else:
            end, limit = start + together, max(link_free_at, now + g_ready)
        if end <= limit + 1e-12:
            best, best_gain = start, gain
    return HoldVerdict(best, top_gain)


@settings(max_examples=300, deadline=None)
@given(
    ready_n=st.integers(1, 4),
    gaps=st.lists(st.floats(0.0, 2e-3), min_size=1, max_size=7),
    link_ahead=st.floats(0.0, 3e-3),
    tail=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_hold_weighed_with_the_shortcut_is_the_one_every_wait_priced_finds(
    ready_n: int, gaps: list[float], link_ahead: float, tail: bool, seed: int
) -> None:
    import random

    rng = random.Random(seed)
    model = CostModel(load_model_spec("qwen3.6-35b-a3b"), load_profile("thor"))
    layer = 5

    def group_s(jobs: Sequence[Job]) -> float:
        experts = {e for job in jobs for e in job.experts}
        return float(model.compute_time(layer, [1] * len(jobs), [512] * len(jobs), len(experts)))

    def make(request: int) -> Job:
        return Job(request, 0, layer, tuple(rng.sample(range(32), 8)), lane=request)

    now = 1.0
    ready = [make(r) for r in range(ready_n)]
    at, waiting = now, []
    for i, gap in enumerate(gaps):
        at += gap
        waiting.append((at, make(ready_n + i)))
    waiting.sort(key=landing_order)
    expect = _weigh_every_wait(now, ready, waiting, now + link_ahead, group_s, tail)
    got = weigh_hold(now, ready, waiting, now + link_ahead, group_s, tail=tail)
    assert got == expect
