"""How well the scheduler's measured compute fit prices a real backend's groups.

Bottleneck grouping on a backend without a cost model (torch, MLX) prices candidate groups from a fit
of the groups it has computed (:class:`runahead.bottleneck.ComputeFit`). This runs any `runahead`
command, records every decode group's layer, jobs, distinct routed experts and measured seconds (at
the point the scheduler observes them), then replays the fit online, as the runtime does: each group
priced by the fit of every group before it. Models compared, each a least-squares fit:

- one line, shared + per job, over every layer (the runtime's fit before issue 11's fourth round);
- a line per kind of layer: the entry job (embedding, attention 0, no experts), the middle layers,
  the last (its LM head), over jobs;
- a line per kind over the group's distinct routed experts (jobs at the entry): the runtime's fit.

    python bench/compute_fit.py bench --backend torch --model medium --store disk \
        --policy runahead --concurrency 8 --cache-fraction 0.7 --steps 32 --warmup-steps 8 --out DIR

Prints each model's error over the run's groups (median and mean absolute, relative to the measured
time), skipping the first 32 groups of the replay (a fit of few points), and the whole run's
shared and per-job seconds of each layer kind. `--groups FILE` also writes the groups (JSON lines).
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np

from runahead.bottleneck import ComputeFit
from runahead.cli import main
from runahead.jobs import ENTRY_LAYER, distinct_experts

observed: list[tuple[int, int, int, float]] = []  # layer, jobs, distinct experts, seconds
_observe_group = ComputeFit.observe_group


def recording_observe_group(self, jobs, seconds):  # type: ignore[no-untyped-def]
    if not any(job.prefill for job in jobs):
        observed.append((jobs[0].layer, len(jobs), distinct_experts(jobs), seconds))
    return _observe_group(self, jobs, seconds)


ComputeFit.observe_group = recording_observe_group  # type: ignore[method-assign]


MODELS = {  # name: (a line per kind of layer?, over distinct experts rather than jobs?)
    "one line, jobs": (False, False),  # the runtime's fit before issue 11's fourth round
    "per layer kind, jobs": (True, False),
    "per layer kind, experts": (True, True),  # the runtime's fit now (jobs at the entry layer)
}


def kind(layer: int, last: int) -> str:
    return "entry" if layer == ENTRY_LAYER else "last" if layer == last else "middle"


def online_errors(per_kind: bool, experts: bool, last: int, skip: int = 32) -> list[float]:
    """Relative error of each group's price from the least-squares line of the groups before it (of
    its layer kind, with ``per_kind``; a kind not seen yet is priced by the middle layers' line)."""
    seen: dict[str, list[tuple[float, float]]] = {}
    errors = []
    for i, (layer, jobs, distinct, seconds) in enumerate(observed):
        size = float(distinct if experts and layer != ENTRY_LAYER else jobs)
        group = kind(layer, last) if per_kind else "all"
        history = seen.get(group) or seen.get("middle", [])
        if i >= skip and len({x for x, _ in history}) >= 2:
            x = np.array([[1.0, x] for x, _ in history])
            (shared, slope), *_ = np.linalg.lstsq(x, np.array([t for _, t in history]), rcond=None)
            errors.append(abs(shared + slope * size - seconds) / seconds)
        seen.setdefault(group, []).append((size, seconds))
    return errors


def report() -> None:
    if len(observed) < 40:
        print(f"only {len(observed)} decode groups observed: nothing to fit")
        return
    last = max(layer for layer, *_ in observed)
    sizes = [jobs for _, jobs, _, _ in observed]
    print(f"{len(observed)} decode groups, {min(sizes)}-{max(sizes)} jobs, last layer {last}")
    for name, (per_kind, experts) in MODELS.items():
        errors = online_errors(per_kind, experts, last)
        median, mean = statistics.median(errors), statistics.fmean(errors)
        print(f"{name:>29}: online error median {median:.1%}, mean {mean:.1%}")
    for group in ("entry", "middle", "last", "all"):
        rows = [(j, d, t) for layer, j, d, t in observed if group in ("all", kind(layer, last))]
        if len({j for j, _, _ in rows}) < 2:
            continue
        x = np.array([[1.0, j] for j, _, _ in rows])
        (shared, per_job), *_ = np.linalg.lstsq(x, np.array([t for *_, t in rows]), rcond=None)
        shared_ms, per_job_ms = shared * 1e3, per_job * 1e3
        print(f"  {group:>6} ({len(rows)} groups): {shared_ms:.2f} ms shared + {per_job_ms:.2f} ms per job")
        if group in ("middle", "last"):
            x = np.array([[1.0, d] for _, d, _ in rows])
            (shared, per_expert), *_ = np.linalg.lstsq(x, np.array([t for *_, t in rows]), rcond=None)
            shared_ms, per_expert_ms = shared * 1e3, per_expert * 1e3
            print(f"  {group:>6}: {shared_ms:.2f} ms shared + {per_expert_ms:.2f} ms per distinct expert")


if __name__ == "__main__":
    args = sys.argv[1:]
    dump = None
    if "--groups" in args:  # also write the recorded groups (JSON lines) to this path
        at = args.index("--groups")
        dump = args[at + 1]
        del args[at : at + 2]
    try:
        main(args)
    finally:
        report()
        if dump is not None:
            with open(dump, "w") as out:
                out.writelines(json.dumps(row) + "\n" for row in observed)
