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

`--floor` (with `sync` among the policies, and `--out`): the overlap relaxation's floor
(:mod:`runahead.relaxation`) under this run, at its measured costs: every decode round's levels
(the jobs each request computed, with their experts) priced by a fit of every run's groups,
the link busy for sync's own measured link time per step. No grouping without prediction is
faster than the floor in that model; printed beside sync's overlap limit, as the share of the
limit's gain the floor leaves reachable (issue 11's bound for small cases, on a real backend).
Only where the fit prices sync's own groups within 10% of their measured compute: groups of sizes
the run did not compute, or computed while reads took CPU time, are priced off.

`--bound WINDOW CASES MAX_NODES` (with `sync` and `--out`): the small-case model itself on the run's
rounds, CASES cases of WINDOW rounds each, searched exactly up to MAX_NODES decisions
(:func:`report_bound`). On the medium model at 2 requests and 70% cache the runs' steps lie within
1-3% of the model's exact bound, 38-42% of its limit's gain (docs/results-torch.md, "The
small-case bound at measured costs").
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from grouping_bound import bound_row, summed_ms  # bench/ is this script's folder: its sys.path[0]

from runahead.actors.scheduler import ComputeScheduler
from runahead.bottleneck import ComputeFit
from runahead.bound import SmallCase
from runahead.cli import main
from runahead.jobs import ENTRY_LAYER, Group, Job, distinct_experts
from runahead.metrics import Recorder, intersection_total, overlap_limit, union
from runahead.relaxation import floor, level


@dataclass(frozen=True, slots=True)
class Computed:
    """One decode group as its scheduler computed it."""

    recorder: int  # its run's Recorder (id): runs of one command are told apart by it
    jobs: tuple[Job, ...]
    start: float
    end: float
    measured: bool  # the run's rule priced from a fit (bottleneck grouping, no cost model)


groups: list[Computed] = []
reads: dict[int, list[tuple[float, float]]] = {}  # recorder -> its landed reads' intervals
_compute, _fetch, _scheduler_compute = Recorder.compute, Recorder.fetch, ComputeScheduler._compute
_computing: dict[int, tuple[Group, bool]] = {}  # recorder -> the group its scheduler computes


async def recording_scheduler_compute(self, group):  # type: ignore[no-untyped-def]
    _computing[id(self.recorder)] = group, self._bottleneck and self._model is None
    try:
        return await _scheduler_compute(self, group)
    finally:
        _computing.pop(id(self.recorder), None)


def recording_compute(self, start, end, layer, requests):  # type: ignore[no-untyped-def]
    computing = _computing.get(id(self))  # the scheduler records its group after the compute
    if computing is not None and not any(job.prefill for job in computing[0].jobs):
        groups.append(Computed(id(self), computing[0].jobs, start, end, computing[1]))
    return _compute(self, start, end, layer, requests)


def recording_fetch(self, start, end, key, prefetch):  # type: ignore[no-untyped-def]
    reads.setdefault(id(self), []).append((start, end))
    return _fetch(self, start, end, key, prefetch)


ComputeScheduler._compute = recording_scheduler_compute  # type: ignore[method-assign]
Recorder.compute = recording_compute  # type: ignore[method-assign]
Recorder.fetch = recording_fetch  # type: ignore[method-assign]


def fitted() -> list[Computed]:
    """The groups a run's fit observed (those of runs whose rule measures), in order."""
    return [group for group in groups if group.measured]


def rows(computed: list[Computed]) -> list[tuple[int, int, int, float]]:
    """``(layer, jobs, distinct experts, seconds)`` of each group."""
    return [
        (group.jobs[0].layer, len(group.jobs), distinct_experts(group.jobs), group.end - group.start)
        for group in computed
    ]


def report_contention() -> None:
    """Middle-layer groups computed with no read in flight against groups of the same number of
    distinct experts computed with reads in flight all along (every policy of the command; sync's
    groups never overlap a read): on 2 cores the reads' threads take the compute's CPU time."""
    merged = {recorder: union(intervals) for recorder, intervals in reads.items()}
    last = max((group.jobs[0].layer for group in groups), default=0)
    alone: dict[int, list[float]] = {}
    overlapped: dict[int, list[float]] = {}
    for group, (layer, _, distinct, _) in zip(groups, rows(groups), strict=True):
        start, end = group.start, group.end
        if not 0 <= layer < last or end <= start:
            continue
        share = intersection_total(merged.get(group.recorder, []), [(start, end)]) / (end - start)
        if share < 0.1 or share > 0.9:
            (alone if share < 0.1 else overlapped).setdefault(distinct, []).append(end - start)
    sizes = [d for d in sorted(alone) if any(abs(d - o) <= 2 for o in overlapped)]
    if not sizes:
        print("  contention: no middle groups of like size computed both with and without reads in flight")
        return
    ratios = []
    for d in sizes:  # per distinct expert: groups within 2 experts of each other
        near = [t / o for o, times in overlapped.items() if abs(d - o) <= 2 for t in times]
        ratios.append(statistics.median(near) / (statistics.median(alone[d]) / d))
    print(
        f"  contention: middle groups with reads in flight all along take {statistics.median(ratios):.2f}x "
        f"(median over {len(sizes)} sizes, {min(ratios):.2f}-{max(ratios):.2f}) the time per distinct "
        f"expert of groups within 2 experts of their size and no read in flight "
        f"({sum(len(alone[d]) for d in sizes)} groups alone)"
    )


MODELS = {  # name: (a line per kind of layer?, over distinct experts rather than jobs?)
    "one line, jobs": (False, False),  # the runtime's fit before issue 11's fourth round
    "per layer kind, jobs": (True, False),
    "per layer kind, experts": (True, True),  # the runtime's fit now (jobs at the entry layer)
}


def kind(layer: int, last: int) -> str:
    return "entry" if layer == ENTRY_LAYER else "last" if layer == last else "middle"


def online_errors(
    observed: list[tuple[int, int, int, float]], per_kind: bool, experts: bool, last: int, skip: int = 32
) -> list[float]:
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
    observed = rows(fitted())
    if len(observed) < 40:
        print(f"only {len(observed)} decode groups observed: nothing to fit")
        return
    last = max(layer for layer, *_ in observed)
    sizes = [jobs for _, jobs, _, _ in observed]
    print(f"{len(observed)} decode groups, {min(sizes)}-{max(sizes)} jobs, last layer {last}")
    for name, (per_kind, experts) in MODELS.items():
        errors = online_errors(observed, per_kind, experts, last)
        median, mean = statistics.median(errors), statistics.fmean(errors)
        print(f"{name:>29}: online error median {median:.1%}, mean {mean:.1%}")
    for group in ("entry", "middle", "last", "all"):
        kind_rows = [(j, d, t) for layer, j, d, t in observed if group in ("all", kind(layer, last))]
        if len({j for j, _, _ in kind_rows}) < 2:
            continue
        x = np.array([[1.0, j] for j, _, _ in kind_rows])
        (shared, per_job), *_ = np.linalg.lstsq(x, np.array([t for *_, t in kind_rows]), rcond=None)
        shared_ms, per_job_ms = shared * 1e3, per_job * 1e3
        print(
            f"  {group:>6} ({len(kind_rows)} groups): {shared_ms:.2f} ms shared + {per_job_ms:.2f} ms per job"
        )
        if group in ("middle", "last"):
            x = np.array([[1.0, d] for _, d, _ in kind_rows])
            (shared, per_expert), *_ = np.linalg.lstsq(x, np.array([t for *_, t in kind_rows]), rcond=None)
            shared_ms, per_expert_ms = shared * 1e3, per_expert * 1e3
            print(f"  {group:>6}: {shared_ms:.2f} ms shared + {per_expert_ms:.2f} ms per distinct expert")


FIT_AGREES = 0.1
"""The floor is printed only if the fit prices sync's own compute within this share of what it measured."""


Rounds = dict[int, dict[int, list[Job]]]
"""A run's decode rounds: epoch -> layer -> the jobs computed there."""


def measured_rounds(
    computed: list[Computed], every: list[Computed], sync: dict[str, Any]
) -> tuple[ComputeFit, Rounds, list[int]]:
    """A fit of ``every`` run's decode groups (as the runtime fits its own; sync's groups included, so
    the sizes the rule seldom makes are measured), and the decode rounds' jobs by epoch and layer and
    the epochs of sync's measured steps' length at the end where every request computed every layer,
    of the command's first run whose rule measures (its rounds are not mixed with another run's).
    A fit of that run alone priced sync's two-job groups 7-16% under what sync measured."""
    first = computed[0].recorder
    computed = [group for group in computed if group.recorder == first]
    fit = ComputeFit(max(group.jobs[0].layer for group in computed))
    for group in every:
        fit.observe_group(group.jobs, group.end - group.start)
    rounds: Rounds = {}
    for group in computed:
        for job in group.jobs:
            rounds.setdefault(job.epoch, {}).setdefault(job.layer, []).append(job)
    whole = sorted(
        epoch
        for epoch, levels in rounds.items()
        if all(len(jobs) == sync["concurrency"] for jobs in levels.values())
    )
    return fit, rounds, whole[-sync["steps"] :]


def load_run(
    out: str, option: str
) -> tuple[list[dict[str, Any]], dict[str, Any], ComputeFit, Rounds, list[int]] | None:
    """The command's rows, its sync row and :func:`measured_rounds`; None (said why) without both."""
    rows = [json.loads(line) for line in Path(out, "results.jsonl").read_text().splitlines()]
    sync = next((row for row in rows if row["policy"] == "sync"), None)
    computed = fitted()
    if sync is None or not computed:
        print(f"{option} needs a sync row and a bottleneck grouping's groups in the same run")
        return None
    if len({(row["concurrency"], row["cache_fraction"]) for row in rows}) > 1:
        print(f"{option} reads one point a command (one concurrency, one cache fraction)")
        return None
    return rows, sync, *measured_rounds(computed, groups, sync)


def report_floor(out: str) -> None:
    """The relaxation's floor under the run's last rounds, at the run's measured costs."""
    run = load_run(out, "--floor")
    if run is None:
        return
    _, sync, fit, rounds, measured = run
    requests, last = sync["concurrency"], fit.last_layer
    levels = [
        level(jobs, fit, first=layer == ENTRY_LAYER, last=layer == last)
        for epoch in measured
        for layer, jobs in sorted(rounds[epoch].items())
    ]
    steps = len(measured)
    compute = sum(item.whole for item in levels) / steps  # sync's compute, at the fit's prices
    if abs(compute / sync["compute_s"] - 1) > FIT_AGREES:
        print(
            f"no floor: the fit prices sync's compute at {compute * 1e3:.1f} ms a step, measured "
            f"{sync['compute_s'] * 1e3:.1f}; it does not price sync's groups (sizes it did not see, or "
            f"compute slowed by reads sharing the cores)"
        )
        return
    fetch = sync["fetch_s"]
    limit = overlap_limit(compute, fetch)
    step = floor(levels, fetch * steps) / steps
    speedup = (compute + fetch) / step
    print(
        f"floor over {steps} rounds of {requests} requests: sync compute {compute * 1e3:.1f} ms a step "
        f"at the fit's prices (measured {sync['compute_s'] * 1e3:.1f}), link {fetch * 1e3:.1f} ms; "
        f"limit {limit:.2f}; floor {step * 1e3:.1f} ms a step, {speedup:.2f}x sync's compute + link: "
        f"{(speedup - 1) / (limit - 1):.0%} of the limit's gain"
    )


def report_bound(out: str, window: int, windows: int, max_nodes: int) -> None:
    """The small-case model (:mod:`runahead.bound`) on this run's own routing and measured costs.

    Each case is ``window`` consecutive measured rounds of the fitted run (every request's experts
    at every layer, as its gates chose them); a group costs what a fit of every run's groups says
    (``ComputeFit``'s form; sync's own groups in it, so the model's sync is priced as sync ran); a read
    holds the link for the time that keeps the model's sync as busy on the link a round as the run's
    sync was (the model reads fewer experts than the run, whose cache also misses by eviction);
    resident are the cache's size of the experts most used in the rounds before the case (what an
    LFU cache knows then; fixed within the case: the model reads a missing expert once and evicts
    nothing). Printed per case and summed over the cases: the shares of sync's limit's gain of the
    exact bound (where the search ends within ``max_nodes`` decisions), the best holds and pilot
    schedules, the floor, and the groupings played through the model; then each measured row's own
    share, beside them. The same figures go to ``OUT/bound.json``.
    """
    run = load_run(out, "--bound")
    if run is None:
        return
    rows, sync, fit, rounds, measured = run
    if len(measured) < window:
        print(f"--bound: {len(measured)} whole measured rounds, fewer than a window of {window}")
        return
    layers = fit.last_layer + 1
    starts = sorted({round(i * (len(measured) - window) / max(1, windows - 1)) for i in range(windows)})
    cases = []
    for start in starts:
        epochs = measured[start : start + window]
        used = Counter(  # what an LFU knows at the case's start: the rounds before it
            key
            for epoch, levels in rounds.items()
            if epoch < epochs[0]
            for jobs in levels.values()
            for job in jobs
            for key in job.keys
        )
        resident = frozenset(key for key, _ in used.most_common(sync["cache_slots"]))
        requests = sorted({job.request for job in rounds[epochs[0]][ENTRY_LAYER]})
        selections = [
            [[_experts(rounds[epoch][layer], request) for layer in range(layers)] for epoch in epochs]
            for request in requests
        ]
        needed = {
            key for epoch in epochs for jobs in rounds[epoch].values() for job in jobs for key in job.keys
        }
        cases.append((epochs, selections, resident, len(needed - resident)))
    # a read's link time such that the model's sync keeps the link as busy a round as the run's sync did
    fetch_s = sync["fetch_s"] * len(cases) * window / sum(reads for *_, reads in cases)
    print(
        f"bound at measured costs: {len(cases)} cases of {window} round(s) x {layers} layers, "
        f"{fetch_s * 1e3:.2f} ms a read (the run's sync: {sync['fetch_s'] / sync['fetches_per_step'] * 1e3:.2f}), "
        f"{sync['cache_slots']} slots"
    )
    case_rows = []
    for epochs, selections, resident, _ in cases:
        case = SmallCase(selections, resident, fetch_s, fit, measured=True)  # the rule as torch plays it
        row = bound_row(case, search=True, max_nodes=max_nodes)
        case_rows.append(row)
        shares = " ".join(f"{name} {_share(row, name)}" for name in BOUND_SCHEDULES[1:])
        print(f"  rounds {epochs[0]}-{epochs[-1]}: limit {row['limit']:.2f}; share of its gain: {shares}")
    totals = summed_ms(case_rows)  # milliseconds over the cases; the bound only if every search ended
    limit = overlap_limit(totals["sync_compute_ms"], totals["fetch_ms"])
    summed = {"limit": limit} | {
        f"{name}_share_of_limit": (totals["sync_ms"] / totals[f"{name}_ms"] - 1) / (limit - 1)
        for name in BOUND_SCHEDULES
        if f"{name}_ms" in totals
    }
    steps = len(cases) * window
    print(
        f"  summed: sync {totals['sync_compute_ms'] / steps:.1f} ms compute + {totals['fetch_ms'] / steps:.1f} "
        f"ms link a round in the model (measured {sync['compute_s'] * 1e3:.1f} + {sync['fetch_s'] * 1e3:.1f}); "
        f"limit {limit:.2f}; share of its gain: "
        + " ".join(f"{name} {_share(summed, name)}" for name in BOUND_SCHEDULES[1:])
    )
    priced = totals["sync_compute_ms"] / steps / 1e3
    if abs(priced / sync["compute_s"] - 1) > FIT_AGREES:
        print(
            f"  the fit prices sync's rounds {priced / sync['compute_s'] - 1:+.0%} off what sync measured: "
            f"these shares do not bound the run's (a model priced off the run it would bound)"
        )
    model = "; ".join(
        f"{name} {totals[f'{name}_ms'] / steps:.1f}"
        + (f" (compute {totals[f'{name}_compute_ms'] / steps:.1f})" if f"{name}_compute_ms" in totals else "")
        for name in ("sync", "bound", "bottleneck")
        if f"{name}_ms" in totals
    )
    print(f"  the model's round, ms: {model}")
    for row in rows:
        print(
            f"  measured {row['policy']}: step {row['step_time_s'] * 1e3:.1f} ms (compute "
            f"{row['compute_s'] * 1e3:.1f}, link {row['fetch_s'] * 1e3:.1f}, {row['fetches_per_step']:.1f} reads)"
        )
    measured_limit = overlap_limit(sync["compute_s"], sync["fetch_s"])
    best = next(name for name in ("bound", "holds", "pilot") if f"{name}_ms" in totals)
    best_round = totals[f"{best}_ms"] / steps / 1e3
    runs = []
    for row in rows:
        if row["policy"] != "sync":
            x = row["tokens_per_s"] / sync["tokens_per_s"]
            share, of_best = (x - 1) / (measured_limit - 1), row["step_time_s"] / best_round
            runs.append(
                {"policy": row["policy"], "x_sync": x, "share_of_limit": share, "step_of_best": of_best}
            )
            print(
                f"  measured {row['policy']}: {x:.2f}x sync, {share:.0%} of the measured limit's gain "
                f"({measured_limit:.2f}); its step {of_best:.2f}x the model's {best} round"
            )
    model_rounds = {key.removesuffix("_ms"): value / steps for key, value in totals.items()}
    summary = {"window": window, "cases": len(cases), "fetch_s": fetch_s, "best": best}
    summary |= {
        "model": summed,
        "model_round_ms": model_rounds,
        "measured_limit": measured_limit,
        "runs": runs,
    }
    Path(out, "bound.json").write_text(json.dumps(summary, indent=1) + "\n")


BOUND_SCHEDULES = ("sync", "bound", "holds", "pilot", "floor", "paper", "bottleneck")
"""What :func:`report_bound` prints: the model's schedules (``bound`` only where the search ended)."""


def _experts(jobs: list[Job], request: int) -> tuple[int, ...]:
    return next(job.experts for job in jobs if job.request == request)


def _share(row: dict[str, Any], name: str) -> str:
    value = row.get(f"{name}_share_of_limit")
    return f"{value:.0%}" if isinstance(value, float) else "-"


if __name__ == "__main__":
    args = sys.argv[1:]
    dump = None
    if "--groups" in args:  # also write the recorded groups (JSON lines) to this path
        at = args.index("--groups")
        dump = args[at + 1]
        del args[at : at + 2]
    with_floor = "--floor" in args
    if with_floor:
        args.remove("--floor")
    bound: tuple[int, int, int] | None = None
    if "--bound" in args:  # --bound WINDOW CASES MAX_NODES: the small-case model at measured costs
        at = args.index("--bound")
        try:
            bound = (int(args[at + 1]), int(args[at + 2]), int(args[at + 3]))
        except (IndexError, ValueError):
            raise SystemExit(
                "--bound takes WINDOW CASES MAX_NODES, three whole numbers (e.g. --bound 2 6 2000000)"
            ) from None
        if min(bound) < 1:
            raise SystemExit(f"--bound's WINDOW, CASES and MAX_NODES must each be at least 1, not {bound}")
        del args[at : at + 4]
    try:
        main(args)
    finally:
        report()
        report_contention()
        if with_floor:
            report_floor(args[args.index("--out") + 1])
        if bound is not None:
            report_bound(args[args.index("--out") + 1], *bound)
        if dump is not None:
            with open(dump, "w") as out:
                out.writelines(json.dumps(row) + "\n" for row in rows(fitted()))
