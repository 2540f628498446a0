"""The bench runner: one row of measurements per (policy, concurrency, cache fraction, barrier).

Every point runs the same actors over the ``sim`` backend on virtual time: the model's shape and a
hardware profile give the costs, a seeded synthetic routing trace (or a recorded one) gives the
experts. Points are side by side in one run, so ratios between policies are exact, not noisy.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runahead.backends.sim import SimBackend
from runahead.clock import run_virtual
from runahead.costs import CostModel
from runahead.jobs import ExpertKey, RequestSpec
from runahead.metrics import summarize
from runahead.runtime import Runtime, RuntimeConfig
from runahead.specs import ModelSpec, load_model_spec, load_profile
from runahead.trace import RoutingTrace, default_trace

WORKLOADS = {"chat": 161}
"""Decode-only workloads by name -> prompt tokens each request's KV cache starts with.

``chat``: ShareGPT's mean prompt of ~161 tokens. (Real request mixes, with prefill and arrivals,
belong to the paper-figures work.)"""

REQUIRED_FIELDS = (
    "policy",
    "concurrency",
    "cache_fraction",
    "tokens_per_s",
    "step_time_s",
    "compute_s",
    "fetch_s",
    "overlap_fraction",
    "lower_bound_s",
    "fetches",
    "hits",
    "misses",
    "wasted_prefetches",
    "overhead_us_per_job",
)


@dataclass(frozen=True, slots=True)
class BenchPoint:
    """One configuration to measure."""

    model: str
    profile: str
    policy: str
    concurrency: int
    cache_fraction: float
    steps: int
    workload: str = "chat"
    seed: int = 0
    step_barrier: bool = True
    eviction: str = "lfu"
    warmup_steps: int = 8
    zero_cost: bool = False
    """Charge no time for compute or reads: the row's ``overhead_us_per_job`` is then the runtime's own."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache fraction must lie in (0, 1], got {self.cache_fraction}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup steps must be >= 0, got {self.warmup_steps}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")


def cache_slots(model: ModelSpec, cache_fraction: float) -> int:
    """Slots for ``cache_fraction`` of all routed experts (at least one)."""
    return max(1, round(cache_fraction * model.num_layers * model.num_experts))


def warm_keys(trace: RoutingTrace, requests: int, steps: int) -> Iterator[ExpertKey]:
    """The experts of the trace's first ``steps`` steps in decode order: what a prompt left cached."""
    for step in range(steps):
        for layer in range(trace.num_layers):
            for request in range(requests):
                for expert in trace.selections(request % trace.num_requests)[step][layer]:
                    yield ExpertKey(layer, expert)


def run_point(point: BenchPoint, trace: RoutingTrace | None = None, timeline: Any = None) -> dict[str, Any]:
    """Measure one point on the sim backend; return its result row."""
    model = load_model_spec(point.model)
    profile = load_profile(point.profile)
    if trace is None:
        trace = default_trace(model, point.concurrency, point.warmup_steps + point.steps, point.seed)
    if (trace.num_layers, trace.top_k) != (model.num_layers, model.top_k):
        raise ValueError(
            f"trace has {trace.num_layers} layers x top-{trace.top_k}, model {model.name} has "
            f"{model.num_layers} x top-{model.top_k}"
        )
    slots = cache_slots(model, point.cache_fraction)
    for request in range(point.concurrency):  # build the trace's tuples before the clock starts
        trace.selections(request % trace.num_requests)
        trace.predictions(request % trace.num_requests)
    backend = SimBackend(
        trace, CostModel(model, profile), step_offset=point.warmup_steps, zero_cost=point.zero_cost
    )
    config = RuntimeConfig(
        cache_slots=slots,
        policy=point.policy,
        eviction=point.eviction,
        step_barrier=point.step_barrier,
        link_queue_depth=profile.link_queue_depth,
    )
    runtime = Runtime(backend, config)
    runtime.warm_cache(warm_keys(trace, point.concurrency, point.warmup_steps))
    prompt = WORKLOADS[point.workload]
    requests = [
        RequestSpec(r, point.steps, prompt_tokens=prompt + point.warmup_steps)
        for r in range(point.concurrency)
    ]
    wall, cpu = time.perf_counter(), time.process_time()
    run_virtual(lambda: runtime.run(requests))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    metrics = summarize(runtime.recorder, runtime.cache.stats, steps=point.steps)
    jobs = sum(record.size for record in runtime.recorder.computes)
    row = {
        **asdict(point),
        "backend": "sim",
        "cache_slots": slots,
        "max_active": runtime.max_active,
        **metrics.as_row(),
        "overhead_us_per_job": cpu / jobs * 1e6,
        "jobs": jobs,
        "wall_s": wall,
    }
    if timeline is not None:
        timeline(runtime)
    return row


def sweep(
    model: str,
    profile: str,
    policies: Sequence[str],
    concurrencies: Sequence[int],
    cache_fractions: Sequence[float],
    steps: int,
    *,
    workload: str = "chat",
    seed: int = 0,
    barriers: Sequence[bool] = (True,),
    eviction: str = "lfu",
    warmup_steps: int = 8,
    zero_cost: bool = False,
) -> list[BenchPoint]:
    """Every combination, concurrency-major so rows that compare policies sit together."""
    return [
        BenchPoint(
            model,
            profile,
            policy,
            concurrency,
            fraction,
            steps,
            workload,
            seed,
            barrier,
            eviction,
            warmup_steps,
            zero_cost,
        )
        for concurrency, fraction, barrier, policy in itertools.product(
            concurrencies, cache_fractions, barriers, policies
        )
    ]


def run_sweep(
    points: Iterable[BenchPoint], out: Path | None, trace: RoutingTrace | None = None, progress: Any = None
) -> list[dict[str, Any]]:
    """Run ``points`` in order, appending each row to ``out/results.jsonl`` as it finishes."""
    rows = []
    sink = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        sink = (out / "results.jsonl").open("w")
    try:
        for point in points:
            row = run_point(point, trace)
            rows.append(row)
            if sink is not None:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            if progress is not None:
                progress(row)
    finally:
        if sink is not None:
            sink.close()
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A text table of rows, with each policy's speedup over ``sync`` at the same point."""
    baseline = {_where(row): row["tokens_per_s"] for row in rows if row["policy"] == "sync"}
    header = (
        f"{'policy':<28} {'conc':>4} {'cache':>5} {'barrier':>7} {'tok/s':>8} {'vs sync':>7} {'step ms':>8} "
        f"{'compute':>8} {'fetch':>8} {'bound':>8} {'/bound':>6} {'overlap':>7} {'fetch/st':>8} "
        f"{'wasted':>6} {'group':>5} {'us/job':>6}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        sync = baseline.get(_where(row))
        speedup = f"{row['tokens_per_s'] / sync:7.2f}" if sync else f"{'-':>7}"
        lines.append(
            f"{row['policy']:<28} {row['concurrency']:>4} {row['cache_fraction']:>5.2f} "
            f"{'on' if row['step_barrier'] else 'off':>7} {row['tokens_per_s']:>8.1f} {speedup} "
            f"{row['step_time_s'] * 1e3:>8.2f} {row['compute_s'] * 1e3:>8.2f} {row['fetch_s'] * 1e3:>8.2f} "
            f"{row['lower_bound_s'] * 1e3:>8.2f} {row['bound_ratio']:>6.3f} {row['overlap_fraction']:>7.2f} "
            f"{row['fetches_per_step']:>8.1f} {row['wasted_prefetches']:>6} {row['mean_group_size']:>5.2f} "
            f"{row['overhead_us_per_job']:>6.1f}"
        )
    return "\n".join(lines)


def _where(row: dict[str, Any]) -> tuple[Any, ...]:
    return (
        row["model"],
        row.get("profile", row.get("device")),
        row["concurrency"],
        row["cache_fraction"],
        row["step_barrier"],
    )
