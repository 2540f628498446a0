"""Calibration against the paper: the cost model's compute times, the synthetic router's fetches.

The paper (challenge C1): six requests cost 126.8 ms per decode step when each request is computed
separately and 56.5 ms when computed as one batch (compute time only). The summary names neither the
platform nor the model. Assumed: Qwen3.6-35B-A3B on the Mac mini (the paper's M6; our profile uses
M4 figures), 512-token contexts, routing from the default synthetic trace (6 requests, seed 0).
The Thor profile would need 33% bandwidth efficiency to reach 126.8 ms, which is implausible for a
decode kernel, so the numbers are read as Mac ones. The mac-mini profile's bandwidth_efficiency is
chosen (0.85); its group_overhead_s and job_overhead_s were fitted ONCE to these two numbers; this
test recomputes the fit and checks both.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runahead.bench import BenchPoint, run_point
from runahead.costs import CostModel
from runahead.replay import cache_hold_fraction, replay_fetches
from runahead.specs import load_model_spec, load_profile
from runahead.synthetic import default_trace
from runahead.trace import RoutingTrace

SEPARATE_S = 0.1268
BATCHED_S = 0.0565
REQUESTS = 6
CONTEXT = 512
STEPS = 64


def _mean_step(costs: CostModel, trace: RoutingTrace, separate: bool) -> float:
    grouping = [[i] for i in range(REQUESTS)] if separate else None
    times = [
        costs.step_compute_time(
            [trace.selections(r)[step] for r in range(REQUESTS)], [CONTEXT] * REQUESTS, grouping
        )
        for step in range(trace.num_steps)
    ]
    return float(np.mean(times))


def test_six_requests_separately_vs_batched() -> None:
    model = load_model_spec("qwen3.6-35b-a3b")
    profile = load_profile("mac-mini")
    trace = default_trace(model, REQUESTS, STEPS, seed=0)
    costs = CostModel(model, profile)
    separate, batched = _mean_step(costs, trace, True), _mean_step(costs, trace, False)
    print(
        f"mac-mini, Qwen3.6: separately {separate * 1e3:.1f} ms (paper 126.8), "
        f"batched {batched * 1e3:.1f} ms (56.5)"
    )
    assert separate == pytest.approx(SEPARATE_S, rel=0.1)
    assert batched == pytest.approx(BATCHED_S, rel=0.1)


def test_recorded_fit_matches_a_fresh_fit() -> None:
    """Solve ``time = bytes_time + groups * group_overhead + jobs * job_overhead`` for both figures."""
    model = load_model_spec("qwen3.6-35b-a3b")
    profile = load_profile("mac-mini")
    trace = default_trace(model, REQUESTS, STEPS, seed=0)
    unit = CostModel(model, dataclasses.replace(profile, group_overhead_s=0.0, job_overhead_s=0.0))
    bytes_time = [_mean_step(unit, trace, separate) for separate in (True, False)]
    groups = [REQUESTS * (model.num_layers + 1), model.num_layers + 1]
    jobs = [REQUESTS * (model.num_layers + 1)] * 2
    group_overhead, job_overhead = np.linalg.solve(
        np.array([[groups[0], jobs[0]], [groups[1], jobs[1]]]),
        [SEPARATE_S - bytes_time[0], BATCHED_S - bytes_time[1]],
    )
    print(
        f"fresh fit: group overhead {group_overhead * 1e6:.1f} us, job overhead {job_overhead * 1e6:.1f} us"
    )
    assert group_overhead >= 0 and job_overhead >= 0
    assert profile.group_overhead_s == pytest.approx(group_overhead, abs=2e-6)
    assert profile.job_overhead_s == pytest.approx(job_overhead, abs=2e-6)
    # Thor cannot be the platform of these figures without an implausible efficiency
    thor = load_profile("thor")
    thor_unit = CostModel(model, dataclasses.replace(thor, bandwidth_efficiency=1.0, group_overhead_s=0.0))
    assert _mean_step(thor_unit, trace, True) / SEPARATE_S < 0.4


def test_other_profiles_are_not_fitted_to_it() -> None:
    """Thor and the desktop keep their cited/estimated numbers; they must be faster than the Mac."""
    model = load_model_spec("qwen3.6-35b-a3b")
    trace = default_trace(model, REQUESTS, 8, seed=0)
    mac = _mean_step(CostModel(model, load_profile("mac-mini")), trace, False)
    for name in ("thor", "pcie4-desktop"):
        other = _mean_step(CostModel(model, load_profile(name)), trace, False)
        print(f"{name}: batched step {other * 1e3:.1f} ms")
        assert other < mac


# --- the synthetic router against the paper's fetch figures ------------------------------------
#
# Measured with runahead.replay.replay_fetches, the pure replay of the ``sync`` policy (llama.cpp +
# an expert cache) that the runtime matches fetch for fetch (test_replay_matches_the_runtime), on
# the default synthetic trace, seed 0, 30% LFU cache, 8 warm-up steps then 256 decode steps.

GEMMA = "gemma4-26b-a4b"
QWEN = "qwen3.6-35b-a3b"
WARMUP = 8
DECODE = 256


def _fetches(model_name: str, requests: int) -> list[int]:
    trace = default_trace(load_model_spec(model_name), requests, WARMUP + DECODE, seed=0)
    return replay_fetches(trace, 0.3, "lfu", warmup_steps=WARMUP)


def test_fetches_per_step_gemma4_eight_requests() -> None:
    """Paper (Fig. 10b): Bevy fetches ~235 experts per step, nearly as many as llama.cpp + LFU.

    Setting as the paper states it: Gemma4-26B-A4B, 8 agentic-coding requests, 30% cache; read as
    ``sync`` + LFU. Our workload is the synthetic trace (no agentic-coding traces here). +-10%.
    """
    per_step = _fetches(GEMMA, 8)
    mean = float(np.mean(per_step))
    print(f"Gemma4 x 8, sync + LFU, 30% cache: {mean:.1f} fetches per step (paper ~235)")
    assert mean == pytest.approx(235, rel=0.1)


def test_fetches_per_step_vary_like_the_paper() -> None:
    """Paper (challenge C1): per-step fetch time ranges 55.7-160.1 ms over 256 steps.

    The summary names no setting. Assumed: Qwen3.6-35B-A3B, 6 requests (the C1 example's), 30%
    LFU cache, llama.cpp-like ``sync``, mac-mini profile (5 GB/s link; 1.77 MB per Q4_0 expert),
    so 157-452 fetches per step. Min and max within 25% of those; the mean lies between them.
    """
    model, profile = load_model_spec(QWEN), load_profile("mac-mini")
    per_expert_s = CostModel(model, profile).fetch_transfer_time()
    low, high = round(0.0557 / per_expert_s), round(0.1601 / per_expert_s)
    assert (low, high) == (157, 452)
    per_step = _fetches(QWEN, 6)
    print(
        f"Qwen3.6 x 6, sync + LFU, 30% cache: fetches per step min {min(per_step)}, "
        f"mean {np.mean(per_step):.1f}, max {max(per_step)} (paper {low}-{high})"
    )
    assert min(per_step) == pytest.approx(low, rel=0.25)
    assert max(per_step) == pytest.approx(high, rel=0.25)
    assert min(per_step) < np.mean(per_step) < max(per_step)


def test_per_request_hold_fraction() -> None:
    """What a 30% LFU cache holds of ONE request's needs (Qwen3.6 shape, 256 steps, from empty).

    Pinned at what the fetch-calibrated router gives (0.885), not at the paper's 54.1%: see
    test_per_request_hold_fraction_matches_paper.
    """
    trace = default_trace(load_model_spec(QWEN), 1, DECODE, seed=0)
    held = cache_hold_fraction(trace, 0.3, "lfu")
    print(f"30% LFU cache holds {held:.3f} of one request's needed experts (paper: 0.541)")
    assert held == pytest.approx(0.885, abs=0.03)


@pytest.mark.xfail(
    strict=True,
    reason="not reachable together with the fetch figures: independent requests that each miss 46% "
    "alone fetch 3-4x the paper's ~235 per step together (see SyntheticRouting)",
)
def test_per_request_hold_fraction_matches_paper() -> None:
    """Paper: "a 30% cache holds 54.1% of needed experts", read per request (one request alone)."""
    trace = default_trace(load_model_spec(QWEN), 1, DECODE, seed=0)
    assert cache_hold_fraction(trace, 0.3, "lfu") == pytest.approx(0.541, abs=0.05)


def test_replay_matches_the_runtime() -> None:
    """The replay the figures above use counts exactly the fetches the runtime's ``sync`` makes."""
    for model_name, requests in ((GEMMA, 8), (QWEN, 6)):
        point = BenchPoint(model_name, "mac-mini", "sync", requests, 0.3, 16, warmup_steps=WARMUP)
        trace = default_trace(load_model_spec(model_name), requests, WARMUP + 16, seed=0)
        runtime = run_point(point, trace)["fetches"]
        replay = sum(replay_fetches(trace, 0.3, "lfu", warmup_steps=WARMUP))
        print(f"{model_name} x {requests}, 16 steps: runtime {runtime} fetches, replay {replay}")
        assert runtime == replay
