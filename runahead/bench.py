"""The bench runner: one row of measurements per (policy, concurrency, cache fraction, barrier).

Every point runs the same actors over the ``sim`` backend on virtual time: the model's shape and a
hardware profile give the costs, a seeded synthetic routing trace (or a recorded one) gives the
experts. Points are side by side in one run, so ratios between policies are exact, not noisy.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runahead.backends.sim import SimBackend
from runahead.bench_requests import WORKLOADS, request_specs
from runahead.clock import check_charge_scale, run_virtual
from runahead.costs import CostModel
from runahead.jobs import ExpertId, ExpertKey, RequestSpec, expert_ids, expert_key
from runahead.metrics import host_cpu, summarize, summarize_window
from runahead.overhead import overhead_row
from runahead.policy import check_concurrency
from runahead.runtime import Runtime, RuntimeConfig
from runahead.specs import ModelSpec, load_model_spec, load_profile
from runahead.synthetic import default_trace
from runahead.trace import RoutingTrace

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
    prefill_chunk: int = 512
    """Prompt tokens per prefill pass (``agentic`` only: ``chat`` prefills nothing)."""
    charge_overhead: bool = False
    """Advance virtual time by the CPU time the runtime (and the sim) spend on the event loop, as a
    real machine's loop thread would: the row then shows what that cost does to the schedule.
    Such runs differ slightly from one run (and machine) to the next."""
    workload_file: str | None = None
    """The workload's requests read from this file (:mod:`runahead.bench_requests`): ShareGPT JSON
    for ``chat``, a SWE-agent ``.traj`` file or a folder of them for ``agentic``; None: synthetic."""
    preload: bool = False
    """Every expert that fits in the cache is resident before the run (not counted as reads): an
    engine that loaded its model at start (``Runtime.preload``). Without it a cache of every expert
    still reads, once each, the experts the warm-up steps did not use."""
    charge_scale: float = 1.0
    """With ``charge_overhead``, the charged CPU time times this: what the runtime's own cost does on
    a host whose cores run its Python that many times slower than this one's (a Jetson's, say)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache fraction must lie in (0, 1], got {self.cache_fraction}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup steps must be >= 0, got {self.warmup_steps}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {self.prefill_chunk}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        check_charge_scale(self.charge_scale)
        if self.charge_scale != 1.0 and not self.charge_overhead:
            raise ValueError(
                f"a charge scale ({self.charge_scale}) needs charge_overhead: without it nothing is charged"
            )
        check_concurrency(self.policy, self.concurrency)


def cache_slots(model: ModelSpec, cache_fraction: float) -> int:
    """Slots for ``cache_fraction`` of all routed experts (at least one)."""
    return max(1, round(cache_fraction * model.num_layers * model.num_experts))


def warm_ids(trace: RoutingTrace, requests: int, steps: int) -> Iterator[ExpertId]:
    """The experts of the trace's first ``steps`` steps in decode order (step by step, layer by
    layer, request by request): what a prompt left cached, as ids."""
    for step in range(steps):
        for layer in range(trace.num_layers):
            for request in range(requests):
                yield from expert_ids(layer, trace.selections(request % trace.num_requests)[step][layer])


def warm_keys(trace: RoutingTrace, requests: int, steps: int) -> Iterator[ExpertKey]:
    """:func:`warm_ids` as keys."""
    return map(expert_key, warm_ids(trace, requests, steps))


def run_point(point: BenchPoint, trace: RoutingTrace | None = None, timeline: Any = None) -> dict[str, Any]:
    """Measure one point on the sim backend; return its result row.

    ``chat`` rows cover the whole run. ``agentic`` rows measure the closed loop's steady state:
    from the moment every initial request has finished its prefill (its first token) to the first
    finish that finds no request left to start (concurrency drops below ``concurrency``); prefills
    of requests that join in between run inside the window and are charged to it. Either way
    ``tokens_per_s`` counts generated tokens only (prompt tokens are never counted as throughput).
    """
    recorded = trace.spec if trace is not None else None
    use_recorded = recorded is not None and point.model == recorded.name
    model = recorded if recorded is not None and use_recorded else load_model_spec(point.model)
    profile = load_profile(point.profile)
    specs = request_specs(point)
    if trace is None:
        trace = default_trace(model, len(specs), point.warmup_steps + point.steps, point.seed)
    else:
        check_trace(trace, point)
    if (trace.num_layers, trace.top_k) != (model.num_layers, model.top_k):
        raise ValueError(
            f"trace has {trace.num_layers} layers x top-{trace.top_k}, model {model.name} has "
            f"{model.num_layers} x top-{model.top_k}"
        )
    slots = cache_slots(model, point.cache_fraction)
    for request in range(len(specs)):  # build the trace's tuples before the clock starts
        trace.selections(request % trace.num_requests)
        trace.predictions(request % trace.num_requests)
    backend = SimBackend(
        trace,
        CostModel(model, profile),
        step_offset=point.warmup_steps,
        zero_cost=point.zero_cost,
    )
    config = RuntimeConfig(
        cache_slots=slots,
        policy=point.policy,
        eviction=point.eviction,
        step_barrier=point.step_barrier,
        link_queue_depth=profile.link_queue_depth,
        prefill_chunk=point.prefill_chunk,
    )
    runtime = Runtime(backend, config)
    # the cache's bookkeeping as the prompts' prefill left it (the sim's slots hold no data; a real
    # backend reads its experts in: Runtime.preload)
    runtime.cache.warm_ids(warm_ids(trace, point.concurrency, point.warmup_steps))
    if point.preload:  # then the free slots, layer by layer: nothing the warm-up left is evicted
        resident = runtime.cache.resident_ids
        rest = (e for layer in range(trace.num_layers) for e in expert_ids(layer, range(trace.num_experts)))
        runtime.cache.warm_ids(
            list(itertools.islice((e for e in rest if e not in resident), slots - len(resident)))
        )
    charge, scale = point.charge_overhead, point.charge_scale
    wall, cpu = time.perf_counter(), time.process_time()
    if point.workload == "agentic":
        drain = run_virtual(
            lambda: closed_loop(runtime, specs, point.concurrency), charge_cpu=charge, charge_scale=scale
        )
    else:
        run_virtual(lambda: runtime.run(specs), charge_cpu=charge, charge_scale=scale)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall  # the run only, not its summary
    extra: dict[str, Any] = {}
    if point.workload == "agentic":
        initial = {spec.request for spec in specs[: point.concurrency]}
        first = max(t for r, step, t in runtime.recorder.tokens if step == 0 and r in initial)
        end = max(t for _, _, t in runtime.recorder.tokens) if drain is None else drain
        if point.zero_cost:  # no virtual time passes: no window to cut, the whole run counts
            steps = len(runtime.recorder.tokens) / point.concurrency
            metrics = summarize(runtime.recorder, runtime.cache.stats, steps=steps)
        else:
            metrics = summarize_window(runtime.recorder, runtime.cache.stats, first, end, point.concurrency)
        extra = {
            "requests": len(specs),
            "prefill_tokens": sum(spec.prefill_tokens for spec in specs),
            "window_start_s": first,
            "window_end_s": end,
        }
    else:
        metrics = summarize(runtime.recorder, runtime.cache.stats, steps=point.steps)
    recorder = runtime.recorder
    jobs, groups, reads = recorder.jobs, recorder.groups, recorder.reads
    row = {
        **asdict(point),
        "backend": "sim",
        "cache_slots": slots,
        "max_active": runtime.max_active,
        **metrics.as_row(),
        **extra,
        **overhead_row(cpu, jobs, groups, reads),
        "jobs": jobs,
        "groups_run": groups,
        "reads": reads,
        "cpu_s": cpu,
        "wall_s": wall,
        "host_cpu": host_cpu(),
    }
    if timeline is not None:
        timeline(runtime)
    return row


def check_trace(trace: RoutingTrace, point: BenchPoint) -> None:
    """Refuse a recorded trace with fewer requests than ``point.concurrency``, or too few steps.

    Reusing one recorded request for several concurrent ones would make them share every expert, a
    workload nobody ran. (The ``agentic`` workload's later turns do reuse the trace's requests in turn.)
    """
    if trace.num_requests < point.concurrency:
        raise ValueError(
            f"the trace holds {trace.num_requests} request(s), fewer than concurrency {point.concurrency}: "
            f"record as many (runahead generate ... --concurrency {point.concurrency} --record-trace) "
            "or lower --concurrency"
        )
    needed = point.warmup_steps + point.steps
    shortest = int(trace.lengths[: point.concurrency].min())
    if shortest < needed:
        raise ValueError(
            f"the trace's requests hold {shortest} decode steps, fewer than --warmup-steps "
            f"{point.warmup_steps} + --steps {point.steps}: lower them or record more tokens"
        )


async def closed_loop(runtime: Runtime, specs: Sequence[RequestSpec], concurrency: int) -> float | None:
    """Run ``specs`` keeping ``concurrency`` of them active; return when concurrency first dropped.

    The first ``concurrency`` start at once; each finish starts the next spec at that (virtual)
    instant. Returns the time of the first finish that found no spec left to start, or ``None``
    when every spec started at once.
    """
    queue = list(reversed(specs))
    waiting: dict[asyncio.Future[list[int]], int] = {}
    drained: float | None = None
    async with runtime:

        def start() -> None:
            spec = queue.pop()
            (handle,) = runtime.submit(spec)
            waiting[asyncio.ensure_future(handle.result())] = spec.request

        for _ in range(min(concurrency, len(queue))):
            start()
        started_all = not queue
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                waiting.pop(future)
                future.result()
                if queue:
                    start()
                elif drained is None and not started_all:
                    drained = runtime.clock.now()
    return drained


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
    prefill_chunk: int = 512,
    charge_overhead: bool = False,
    workload_file: str | None = None,
    preload: bool = False,
    charge_scale: float = 1.0,
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
            prefill_chunk,
            charge_overhead,
            workload_file,
            preload,
            charge_scale,
        )
        for concurrency, fraction, barrier, policy in itertools.product(
            concurrencies, cache_fractions, barriers, policies
        )
    ]


def run_sweep(
    points: Iterable[Any],
    out: Path | None,
    trace: RoutingTrace | None = None,
    progress: Any = None,
    timeline: Path | None = None,
    run: Callable[[Any, Path | None], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run ``points`` in order, appending each row to ``out/results.jsonl`` as it finishes.

    ``run(point, timeline_path)`` measures one point (default: :func:`run_point` on the sim with
    ``trace``). With ``timeline``, each run is also written as a Chrome trace (``timeline`` itself
    for one point, ``<stem>-<i>.json`` for several).
    """
    from runahead.timeline import numbered_paths

    points = list(points)
    paths: list[Path | None] = (
        list(numbered_paths(timeline, len(points))) if timeline else [None] * len(points)
    )
    measure = run or (lambda point, path: run_point(point, trace, timeline=_trace_writer(path)))
    rows = []
    sink = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        sink = (out / "results.jsonl").open("w")
    try:
        for point, path in zip(points, paths, strict=True):
            row = measure(point, path)
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


def _trace_writer(path: Path | None) -> Callable[[Runtime], None] | None:
    if path is None:
        return None
    from runahead.timeline import write_chrome_trace

    return lambda runtime: write_chrome_trace(runtime.recorder, path)


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
