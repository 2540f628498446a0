"""Bench points on the torch backend: real compute, experts read from the model's files.

Same rows as the sim bench. Each request starts from one random prompt token and decodes
``steps`` tokens greedily; the first ``warmup_steps`` tokens (a cold cache filling up) are left out
of the measurement window.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runahead import loops
from runahead.backend import READS_IN_FLIGHT
from runahead.backends.common import compute_cpu_share, handoff_seconds
from runahead.jobs import ExpertKey, RequestSpec
from runahead.metrics import host_cpu, summarize
from runahead.models.layout import EXPERT_SLOTS
from runahead.policy import check_concurrency
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class TorchPoint:
    """One configuration of a real-model run."""

    model: str  # a Hugging Face folder, or "medium"
    policy: str
    concurrency: int
    cache_fraction: float
    steps: int
    store: str = "disk"
    device: str = "cpu"
    step_barrier: bool = True
    eviction: str = "lfu"
    warmup_steps: int = 8
    seed: int = 0
    queue_depth: int | None = None  # reads in flight; None: the store's and the runtime's defaults
    preload: bool = False  # read every expert that fits into the cache before the run
    dtype: str = "auto"  # compute and cache dtype: float32, bfloat16, float16 or auto (timed at start)
    backend: str = "torch"  # or "mlx" (the same measurement on MLX)
    expert_slots: str = "auto"  # torch: how the cache holds bf16/f16 experts (TorchBackend.open)
    link_gbps: float | None = None  # reads paced to a link of this many GB/s (store.LinkCap), or not
    threads: int | str = "auto"  # torch on CPU: intra-op compute threads (runahead.backends.threads)
    inline_compute: bool = True  # decode groups on the loop's thread while the link idles (RuntimeConfig)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache fraction must lie in (0, 1], got {self.cache_fraction}")
        check_concurrency(self.policy, self.concurrency)
        if self.expert_slots not in EXPERT_SLOTS:
            choices = f"{', '.join(EXPERT_SLOTS[:-1])} or {EXPERT_SLOTS[-1]}"
            raise ValueError(f"expert slots must be {choices}, got {self.expert_slots!r}")
        if self.backend != "torch" and self.expert_slots != "auto":
            raise ValueError("expert slots are chosen on the torch backend only")
        if self.backend != "torch" and self.threads != "auto":
            raise ValueError("compute threads are set on the torch backend only (MLX picks its own)")
        if self.link_gbps is not None and not 0 < self.link_gbps < float("inf"):
            raise ValueError(f"link cap must be a positive number of GB/s, got {self.link_gbps}")


BUILT_MODELS = ("small", "medium")
"""Model names the command line builds (once) instead of reading a folder: see :mod:`runahead.medium`."""


def resolve_model(name: str) -> str:
    """A model folder (or ``.gguf`` file): ``small`` (the demo's) and ``medium`` are built (once) under
    the cache directory."""
    if name in BUILT_MODELS:
        from runahead.medium import medium_model, small_model

        return str(small_model() if name == "small" else medium_model())
    if not Path(name).is_dir() and not (name.endswith(".gguf") and Path(name).is_file()):
        raise FileNotFoundError(
            f"model folder {name!r} does not exist (or name a built one: {', '.join(BUILT_MODELS)})"
        )
    return name


async def warm_resident(backend: Any, policy: str, prompt: Sequence[int] = (5,), warmup: int = 4) -> Runtime:
    """A runtime (``policy``) on an open backend with every expert preloaded into its cache and one
    warm-up request of ``warmup`` tokens decoded: what a one-request timing starts from."""
    runtime = Runtime(backend, RuntimeConfig(cache_slots=backend.num_slots, policy=policy))
    config = backend.model.config
    layers, experts = range(config.num_layers), range(config.num_experts)
    await runtime.preload(ExpertKey(layer, e) for layer in layers for e in experts)
    spec = RequestSpec(0, warmup, prompt=tuple(prompt), sampling=SamplingParams(max_tokens=warmup))
    await runtime.run([spec])
    return runtime


def run_torch_point(point: TorchPoint, timeline: Path | None = None) -> dict[str, Any]:
    """Measure one point with the torch (or mlx) backend; return its row (``timeline``: a Chrome trace)."""
    path = resolve_model(point.model)
    opener: Any
    if point.backend == "mlx":
        from runahead.backends.mlx import MLXBackend as opener
    else:
        from runahead.backends.torch import TorchBackend as opener
    torch_only = {"expert_slots": point.expert_slots, "threads": point.threads}
    backend = opener.open(
        path,
        cache_fraction=point.cache_fraction,
        device=point.device,
        store=point.store,
        queue_depth=READS_IN_FLIGHT if point.queue_depth is None else point.queue_depth,
        dtype=point.dtype,
        link_bandwidth=None if point.link_gbps is None else point.link_gbps * 1e9,
        **(torch_only if point.backend == "torch" else {}),
    )
    config = backend.model.config
    runtime = Runtime(
        backend,
        RuntimeConfig(
            cache_slots=backend.num_slots,
            policy=point.policy,
            eviction=point.eviction,
            step_barrier=point.step_barrier,
            link_queue_depth=point.queue_depth,
            inline_compute=point.inline_compute,
        ),
    )
    rng = random.Random(point.seed)
    total = point.warmup_steps + point.steps
    requests = [
        RequestSpec(
            r,
            total,
            prompt=(rng.randrange(3, config.vocab_size),),
            sampling=SamplingParams(max_tokens=total),
        )
        for r in range(point.concurrency)
    ]
    wall, cpu = time.perf_counter(), time.process_time()
    loop_cpu = 0.0

    async def main() -> dict[int, list[int]]:
        nonlocal loop_cpu
        if point.preload:
            everything = range(config.num_experts)
            await runtime.preload(
                ExpertKey(layer, e) for layer in range(config.num_layers) for e in everything
            )
        started = time.thread_time()  # the preload's reads are not the runtime's cost a job
        inline = backend.inline_cpu_seconds
        try:
            return await runtime.run(requests)
        finally:  # this thread ran the event loop: the runtime's own CPU, less the groups it computed
            loop_cpu = time.thread_time() - started - (backend.inline_cpu_seconds - inline)

    direct_io = getattr(backend.store, "direct", None)  # read before close() releases the files
    try:
        tokens = loops.run(main())
    finally:
        backend.close()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if timeline is not None:
        from runahead.timeline import write_chrome_trace

        write_chrome_trace(runtime.recorder, timeline)
    recorder = runtime.recorder
    metrics = summarize(recorder, runtime.cache.stats, steps=total, skip_steps=point.warmup_steps)
    jobs = sum(record.size for record in recorder.computes)
    return {
        **asdict(point),
        "backend": point.backend,
        "compute_dtype": backend.compute_dtype,
        "slot_dtype": slot_dtype(backend),
        "compute_threads": getattr(backend, "compute_threads", None),
        "compute_nice": getattr(backend, "compute_nice", None),  # the compute thread's priority (Linux)
        "cache_slots": backend.num_slots,
        "max_active": runtime.max_active,
        "reads_in_flight": runtime.link_queue_depth,  # the runtime's link workers (queue_depth: as given)
        **metrics.as_row(),
        "overhead_us_per_job": cpu / jobs * 1e6,  # includes torch compute on this CPU: not the runtime alone
        "loop_cpu_s": loop_cpu,
        "loop_us_per_job": loop_cpu / jobs * 1e6,
        **_handoffs(recorder.compute_seconds, recorder.groups, backend),
        # the compute thread's own CPU over its time inside groups (below 1: it waited for a core or the GIL)
        "compute_cpu_share": compute_cpu_share(backend),
        "cores_busy": cpu / wall if wall > 0 else None,  # the process's CPU over the run's wall time
        "jobs": jobs,
        "holds": recorder.holds,  # times bottleneck grouping held a ready group back
        # adaptive grouping (runahead.mode): share of the run's tokens, warm-up included, made batching
        "batched_share": recorder.batched_tokens / max(1, recorder.token_count),
        "mode_switches": recorder.mode_switches,
        # share of the run's groups, warm-up included, computed on the loop's thread (every read started)
        "inline_share": recorder.inline_groups / max(1, recorder.groups),
        "wall_s": wall,
        "host_cpu": host_cpu(),
        "direct_io": direct_io,
        "token_digest": hashlib.sha1(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:12],
        "prompt_0": list(requests[0].prompt),
        "tokens_0": tokens[0],  # request 0's tokens, warm-up included (to compare with a peer)
    }


def format_handoffs(rows: Sequence[dict[str, Any]]) -> str:
    """Each row's event loop CPU time per job (the runtime's own work, on a real backend), and its
    hand-offs to the compute thread, per group and as a share of the runtime's compute time; then
    how much of its time inside groups the compute thread ran, and how many cores the process kept
    busy (rows of an earlier version without these are left out)."""
    lines = ["", "the event loop: its CPU a job; its hand-offs to the compute thread (which waits then):"]
    for row in rows:
        handoff, share = row.get("handoff_us_per_group"), row.get("handoff_share")
        if handoff is not None and share is not None and "loop_us_per_job" in row:
            ran, cores = row.get("compute_cpu_share"), row.get("cores_busy")
            cpu = "" if ran is None or cores is None else f"; thread ran {ran:.0%}, {cores:.2f} cores busy"
            lines.append(
                f"{row['policy']:<28} {row['concurrency']:>4} {row['cache_fraction']:>5.2f} "
                f"{row['loop_us_per_job']:>6.0f} us of loop CPU a job; hand-offs {handoff:>4.0f} us a group, "
                f"{share:>4.0%} of compute{cpu}"
            )
    return "\n".join(lines)


def _handoffs(compute_seconds: float, groups: int, backend: Any) -> dict[str, float | None]:
    """The row's hand-off fields: per group in microseconds, and as a share of the compute time."""
    per_group = handoff_seconds(compute_seconds, groups, backend)
    if per_group is None:
        return {"handoff_us_per_group": None, "handoff_share": None}
    return {
        "handoff_us_per_group": per_group * 1e6,
        "handoff_share": per_group * groups / compute_seconds if compute_seconds else None,
    }


def slot_dtype(backend: Any) -> str:
    """What a cache slot holds: a dtype, or a stored layout's expert types (``BF16``, ``Q4_0``)."""
    formats = getattr(backend.model, "slot_formats", None)
    if formats:
        return "/".join(sorted({part.kind for fmt in formats.values() for part in fmt.parts}))
    return str(backend.compute_dtype)
