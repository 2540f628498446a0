"""Where a torch group's time goes: per group size, the compute thread's time inside the group, its own
CPU time, and (Linux) its wait for a core.

Runs one torch bench point (the small model unless ``--model``) with every group of the backend's
compute timed on the compute thread: wall time (``perf_counter``), the thread's CPU time
(``thread_time``) and, where ``/proc/thread-self/schedstat`` exists, the time the thread was ready
but not running (the scheduler's run-queue wait). What is left of the wall time after the CPU and
the run-queue wait is time the thread slept inside the group: waiting for the GIL, or a hypervisor
that took the core. Also per group (means), where ``getrusage(RUSAGE_THREAD)`` counts them: how
often the thread blocked (voluntary context switches: nearly all waits for the GIL, which every
torch call gives up and takes back) and how often it was preempted (involuntary ones). Groups of
the entry layer (embedding) are apart from the MoE layers'. The medians per group size, then a
least-squares line of CPU time over jobs (a group's fixed cost and its cost a job) over the MoE
layers' medians.

    RUNAHEAD_CACHE=<dir> python bench/group_cost.py --store disk --cache-fraction 0.3 --concurrency 8 \\
        --policy runahead/grouping=bottleneck
    RUNAHEAD_CACHE=<dir> python bench/group_cost.py --store host --cache-fraction 1.0 --concurrency 1 \\
        --policy sync
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from runahead.backends import torch as torch_backend
from runahead.jobs import ENTRY_LAYER, Group
from runahead.torchbench import TorchPoint, resolve_model, run_torch_point

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _waited_s() -> float:
    """Seconds this thread has waited on a run queue, or 0 where the OS does not say."""
    try:
        return int(SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _switches() -> tuple[int, int]:
    """This thread's voluntary and involuntary context switches so far (0, 0 where not counted)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return 0, 0
    usage = resource.getrusage(who)
    return usage.ru_nvcsw, usage.ru_nivcsw


Times = dict[tuple[bool, int], list[tuple[float, float, float, int, int]]]
"""Per (entry layer?, jobs in the group): each group's wall, CPU and run-queue wait (seconds), and
the compute thread's voluntary and involuntary context switches inside it."""


def timed_groups(point: TorchPoint) -> tuple[dict[str, Any], Times]:
    """Run ``point``; its bench row, and every group's times."""
    groups: Times = defaultdict(list)
    compute = torch_backend.TorchBackend._compute

    def timed(self: torch_backend.TorchBackend, group: Group) -> Any:
        wall, cpu, waited, (blocked, preempted) = (
            time.perf_counter(),
            time.thread_time(),
            _waited_s(),
            _switches(),
        )
        try:
            return compute(self, group)
        finally:
            wall, cpu, waited = time.perf_counter() - wall, time.thread_time() - cpu, _waited_s() - waited
            now = _switches()
            times = (wall, cpu, waited, now[0] - blocked, now[1] - preempted)
            groups[(group.layer == ENTRY_LAYER, len(group.jobs))].append(times)

    torch_backend.TorchBackend._compute = timed  # type: ignore[method-assign]
    try:
        row = run_torch_point(point)
    finally:
        torch_backend.TorchBackend._compute = compute  # type: ignore[method-assign]
    return row, groups


def fixed_and_per_job(medians: dict[int, float]) -> tuple[float, float] | None:
    """Least squares ``cpu = fixed + per_job * jobs`` over the group sizes' medians (None under two sizes)."""
    if len(medians) < 2:
        return None
    sizes = list(medians)
    mean_n, mean_t = statistics.fmean(sizes), statistics.fmean(medians.values())
    spread = sum((n - mean_n) ** 2 for n in sizes)
    per_job = sum((n - mean_n) * (medians[n] - mean_t) for n in sizes) / spread
    return mean_t - per_job * mean_n, per_job


POINT_DEFAULTS: dict[str, Any] = {
    "model": "small",
    "store": "disk",
    "cache_fraction": 0.3,
    "concurrency": 8,
    "policy": "runahead/grouping=bottleneck",
    "steps": 48,
    "warmup_steps": 4,
    "link_gbps": None,
    "dtype": "auto",
}


def point_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """A torch bench point's options (:data:`POINT_DEFAULTS`, ``defaults`` overriding them); read
    back by :func:`point_of`. Shared by the bench scripts that time one point's groups."""
    d = {**POINT_DEFAULTS, **defaults}
    parser.add_argument("--model", default=d["model"])
    parser.add_argument("--store", default=d["store"], choices=["disk", "host"])
    parser.add_argument("--cache-fraction", type=float, default=d["cache_fraction"])
    parser.add_argument("--concurrency", type=int, default=d["concurrency"])
    parser.add_argument("--policy", default=d["policy"])
    parser.add_argument("--steps", type=int, default=d["steps"])
    parser.add_argument("--warmup-steps", type=int, default=d["warmup_steps"])
    parser.add_argument("--link-gbps", type=float, default=d["link_gbps"])
    parser.add_argument("--dtype", default=d["dtype"])


def point_of(args: argparse.Namespace, **extra: Any) -> TorchPoint:
    """The point :func:`point_arguments`' options name (``extra``: further ``TorchPoint`` fields)."""
    return TorchPoint(
        resolve_model(args.model),
        args.policy,
        args.concurrency,
        args.cache_fraction,
        args.steps,
        store=args.store,
        warmup_steps=args.warmup_steps,
        link_gbps=args.link_gbps,
        dtype=args.dtype,
        **extra,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    point_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args()
    point = point_of(args)
    row, groups = timed_groups(point)
    ran = row["compute_cpu_share"]
    print(f"{args.policy}: {row['tokens_per_s']:.1f} tok/s, compute thread ran {ran:.0%}")
    print("layer  jobs groups  wall ms   CPU ms  queue ms  other ms  blocked preempted")
    out, moe_cpu = [], {}
    for (entry, jobs), times in sorted(groups.items()):
        wall, cpu, queued = (statistics.median(t[i] for t in times) * 1e3 for i in range(3))
        other = max(0.0, wall - cpu - queued)
        blocked, preempted = (statistics.fmean(t[i] for t in times) for i in (3, 4))
        layer = "entry" if entry else "MoE"
        print(
            f"{layer:<6} {jobs:>4} {len(times):>6} {wall:>8.3f} {cpu:>8.3f} {queued:>9.3f} {other:>9.3f}"
            f" {blocked:>8.1f} {preempted:>9.1f}"
        )
        out.append(
            {"entry": entry, "jobs": jobs, "groups": len(times), "wall_ms": wall, "cpu_ms": cpu,
             "queue_ms": queued, "other_ms": other, "blocked": blocked, "preempted": preempted}
        )  # fmt: skip
        if not entry:
            moe_cpu[jobs] = cpu
    fit = fixed_and_per_job(moe_cpu)
    if fit is not None:
        print(f"MoE layers' CPU a group: {fit[0]:.3f} ms + {fit[1]:.3f} ms a job (least squares, medians)")
    if args.json is not None:
        summary = {"policy": args.policy, "tokens_per_s": row["tokens_per_s"], "compute_cpu_share": ran}
        args.json.write_text(json.dumps({"row": summary, "groups": out}, indent=1))


if __name__ == "__main__":
    main()
