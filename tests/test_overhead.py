"""The runtime's own cost: its CPU time charged to virtual time, and split per job, group and read."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

import runahead.runtime as runtime_module
from runahead.bench import BenchPoint, run_point
from runahead.clock import TICKS_PER_S, VirtualTimeLoop, _VirtualSelector, run_virtual
from runahead.overhead import fit_overhead


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _sleep_while_burning(sleep_s: float, burn_s: float) -> tuple[float, float]:
    """Sleep ``sleep_s`` of loop time in a task while the caller burns ``burn_s`` of CPU."""
    loop = asyncio.get_running_loop()
    sleeper = asyncio.create_task(asyncio.sleep(sleep_s))
    await asyncio.sleep(0)
    _burn(burn_s)
    await asyncio.sleep(0)
    after_burn = loop.time()
    await sleeper
    return after_burn, loop.time()


def test_charged_cpu_time_advances_the_virtual_clock_and_overlaps_waits() -> None:
    after_burn, end = run_virtual(lambda: _sleep_while_burning(1.0, 0.05), charge_cpu=True)
    assert 0.05 <= after_burn < 0.5  # the burn took virtual time
    assert 1.0 <= end < 1.01  # ... while the sleep ran, not after it
    after_burn, end = run_virtual(lambda: _sleep_while_burning(0.01, 0.05), charge_cpu=True)
    assert end >= 0.05  # a wait shorter than the CPU work ends when the work does


def test_uncharged_virtual_time_ignores_cpu_time() -> None:
    after_burn, end = run_virtual(lambda: _sleep_while_burning(1.0, 0.05))
    assert after_burn == 0.0
    assert end == 1.0


def test_charged_loop_reports_what_it_charged() -> None:
    loop = VirtualTimeLoop(charge_cpu=True)
    try:
        loop.run_until_complete(_sleep_while_burning(0.0, 0.02))
        assert loop.charged_s >= 0.02
    finally:
        loop.close()


def test_a_charge_scale_multiplies_the_charged_cpu_time() -> None:
    """A host whose cores run the runtime four times slower: the same burn takes four times the
    virtual time (each run's own burn measured by what it charged, so a loaded machine cannot fail
    it), and a sleep longer than the scaled burn still overlaps it."""
    for scale in (1.0, 4.0):
        loop = VirtualTimeLoop(charge_cpu=True, charge_scale=scale)
        try:
            burn_s = 0.02
            start = time.thread_time()
            after_burn, end = loop.run_until_complete(_sleep_while_burning(1.0, burn_s))
            spent = time.thread_time() - start  # the burn and the loop's few callbacks
            assert 0.99 * burn_s * scale <= after_burn <= spent * scale + 1e-3
            assert 0.99 * burn_s * scale <= loop.charged_s <= spent * scale + 1e-3
            assert 1.0 <= end < 1.01  # the sleep outlasts the scaled burn: it ran alongside
        finally:
            loop.close()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="charged CPU time's scale"):
            VirtualTimeLoop(charge_cpu=True, charge_scale=bad)


def test_a_bench_point_scales_its_charge_only_when_it_charges() -> None:
    from runahead.paper.runner import point_key

    point = BenchPoint("qwen3.6-35b-a3b", "thor", "sync", 2, 0.3, 3, warmup_steps=1, charge_overhead=True)
    assert "charge_scale" not in json.loads(point_key(point))  # rows stored before it keep their keys
    slow = replace(point, charge_scale=8.0)
    assert json.loads(point_key(slow))["charge_scale"] == 8.0
    assert run_point(slow)["makespan_s"] > run_point(point)["makespan_s"]
    with pytest.raises(ValueError, match="needs charge_overhead"):
        replace(point, charge_overhead=False, charge_scale=2.0)
    with pytest.raises(ValueError, match="finite number above 0"):
        replace(point, charge_scale=0.0)


def test_fit_recovers_per_job_group_and_read_costs() -> None:
    job, group, read = 4e-6, 30e-6, 12e-6
    shapes = [(5000, 600, 800), (5000, 1200, 800), (5000, 600, 4000), (10000, 700, 9000)]
    rows = [
        {"jobs": j, "groups_run": g, "reads": r, "cpu_s": j * job + g * group + r * read}
        for j, g, r in shapes
    ]
    fit = fit_overhead(rows)
    assert fit is not None
    assert fit["us_per_job"] == pytest.approx(4.0)
    assert fit["us_per_group"] == pytest.approx(30.0)
    assert fit["us_per_read"] == pytest.approx(12.0)
    assert fit["max_error"] < 1e-9
    assert fit_overhead(rows[:2]) is None  # three unknowns need three rows


def test_bench_rows_report_overhead_per_job_group_and_read() -> None:
    point = BenchPoint("qwen3.6-35b-a3b", "thor", "runahead", 2, 0.3, 2, warmup_steps=1, zero_cost=True)
    row = run_point(point)
    assert row["groups_run"] > 0 and row["reads"] > 0 and row["jobs"] >= row["groups_run"]
    assert row["overhead_us_per_job"] == pytest.approx(row["cpu_s"] / row["jobs"] * 1e6)
    assert row["overhead_us_per_group"] == pytest.approx(row["cpu_s"] / row["groups_run"] * 1e6)
    assert row["overhead_us_per_read"] == pytest.approx(row["cpu_s"] / row["reads"] * 1e6)
    assert isinstance(row["host_cpu"], str) and row["host_cpu"]  # the machine the times are from


def test_preload_leaves_nothing_to_read_when_every_expert_fits() -> None:
    """``--preload``: "every expert resident" measured with no cold reads; free slots are filled;
    a cache the warm-up already filled is left as it was (the same reads, the same throughput)."""
    whole = BenchPoint("qwen3.6-35b-a3b", "thor", "sync", 2, 1.0, 3, warmup_steps=1, zero_cost=True)
    cold, warm = run_point(whole), run_point(replace(whole, preload=True))
    assert cold["reads"] > 0 and warm["reads"] == 0 and warm["fetches"] == 0
    assert warm["jobs"] == cold["jobs"] and warm["groups_run"] == cold["groups_run"]
    part = replace(whole, cache_fraction=0.3)  # one warm-up step leaves most of it free: filled
    assert 0 < run_point(replace(part, preload=True))["reads"] < run_point(part)["reads"]
    full = BenchPoint("qwen3.6-35b-a3b", "thor", "sync", 8, 0.1, 2, warmup_steps=8)  # the warm-up fills it
    plain, preloaded = run_point(full), run_point(replace(full, preload=True))
    assert preloaded["reads"] == plain["reads"] > 0
    assert preloaded["tokens_per_s"] == plain["tokens_per_s"]


class _NoExpertCount:
    """Stands in for :class:`runahead.backend.ExpertCount` where no backend should pass as one."""

    num_experts: int


@pytest.mark.parametrize(
    ("policy", "workload"),
    [("sync", "chat"), ("runahead", "chat"), ("runahead+prefetch", "chat"), ("runahead", "agentic")],
)
def test_a_whole_resident_model_decides_as_with_every_pin_counted(
    policy: str, workload: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every expert resident the cache stops counting pins (``ExpertCache``'s ``experts``):
    with the Thor's costs the run computes the same groups at the same times, writes the same
    tokens and counts the same hits as with every pin counted."""
    point = BenchPoint("qwen3.6-35b-a3b", "thor", policy, 4, 1.0, 3, workload, warmup_steps=2, preload=True)

    def run() -> tuple[object, ...]:
        captured: list = []
        run_point(point, timeline=captured.append)
        runtime = captured[0]
        recorder = runtime.recorder
        return runtime.cache.whole_model_resident, recorder.computes, recorder.tokens, runtime.cache.stats

    fast = run()
    monkeypatch.setattr(runtime_module, "ExpertCount", _NoExpertCount)
    counted = run()
    assert fast[0] is True and counted[0] is False
    assert fast[1:] == counted[1:] and fast[3].hits > 0 and fast[3].misses == 0  # type: ignore[attr-defined]


def test_a_stored_rows_key_is_unchanged_by_the_preload_field() -> None:
    """Rows stored before ``preload`` existed keep their keys (``bench paper`` resumes from them)."""
    import json

    from runahead.paper.runner import point_key

    point = BenchPoint("qwen3.6-35b-a3b", "thor", "sync", 2, 0.3, 2)
    assert "preload" not in json.loads(point_key(point))
    assert json.loads(point_key(replace(point, preload=True)))["preload"] is True


def test_charging_overhead_slows_the_simulated_run_down() -> None:
    plain = BenchPoint("qwen3.6-35b-a3b", "thor", "sync", 2, 0.3, 3, warmup_steps=1)
    charged = BenchPoint("qwen3.6-35b-a3b", "thor", "sync", 2, 0.3, 3, warmup_steps=1, charge_overhead=True)
    base, slowed = run_point(plain), run_point(charged)
    assert slowed["makespan_s"] > base["makespan_s"]


def test_the_paper_runner_charges_every_bench_point_when_asked() -> None:
    from runahead.paper import run_paper
    from runahead.paper.runner import point_key
    from runahead.paper.settings import TINY, figure_points

    plain = [p for ps in figure_points(TINY).values() for p in ps if isinstance(p, BenchPoint)]
    charged = [
        p
        for ps in figure_points(replace(TINY, charge_overhead=True)).values()
        for p in ps
        if isinstance(p, BenchPoint)
    ]
    assert len(charged) == len(plain) > 50
    assert all(p.charge_overhead for p in charged) and not any(p.charge_overhead for p in plain)
    assert not {point_key(p) for p in plain} & {point_key(p) for p in charged}  # stored apart
    slower = [
        p
        for ps in figure_points(replace(TINY, charge_overhead=True, charge_scale=3.0)).values()
        for p in ps
        if isinstance(p, BenchPoint)
    ]
    assert len(slower) == len(plain) and all(p.charge_scale == 3.0 for p in slower)
    assert not {point_key(p) for p in charged} & {point_key(p) for p in slower}  # apart again
    with pytest.raises(ValueError, match="needs charge_overhead"):
        run_paper(Path("unused"), tiny=True, charge_scale=3.0)


def test_the_charge_leaves_out_its_own_polls() -> None:
    selector = _VirtualSelector(charge_cpu=True)
    assert selector.poll_ns > 0
    polls = 20_000
    start = time.thread_time_ns()
    for _ in range(polls):
        selector.select(0)  # a poll: the clock reading and the charge's arithmetic, nothing else
    spent_ns = time.thread_time_ns() - start
    charged_ns = selector.charged_ticks * (1_000_000_000 // TICKS_PER_S)
    assert charged_ns <= spent_ns // 2  # without leaving them out it would be all of it


def test_zero_cost_agentic_runs_count_the_whole_run() -> None:
    """No virtual time passes at zero cost, so the agentic window ``(first token, drain]`` is empty:
    the row counts every token and job of the run instead of refusing it."""
    point = BenchPoint(
        "qwen3.6-35b-a3b", "thor", "runahead", 2, 0.3, 3, warmup_steps=1, zero_cost=True, workload="agentic"
    )
    row = run_point(point)
    assert row["makespan_s"] == 0.0 and row["tokens_per_s"] == float("inf")
    assert row["tokens"] >= 2 * 3 and row["steps"] == row["tokens"] / 2
    assert row["jobs"] > 0 and row["overhead_us_per_job"] == pytest.approx(row["cpu_s"] / row["jobs"] * 1e6)
