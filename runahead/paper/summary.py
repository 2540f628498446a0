"""Headline numbers from the figures' rows, each beside the paper's figure for the same point."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from runahead.metrics import overlap_limit
from runahead.paper.figures import single_job_fraction
from runahead.paper.settings import BOTTLENECK, PAPER, PAPER_PREFETCH

Row = dict[str, Any]
PREFETCHERS = ("prefetch-gate", "prefetch-history")


def _by(rows: Sequence[Row], *keys: str) -> dict[tuple[Any, ...], list[Row]]:
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for row in rows:
        groups[tuple(row[k] for k in keys)].append(row)
    return groups


def _span(values: Sequence[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)] if values else []


def speedups(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per point: runahead over sync and over the best prefetcher, and sync's own overlap limit."""
    out = []
    for key, group in _by(rows, "profile", "model", "workload", "concurrency", "cache_fraction").items():
        by = {r["policy"]: r for r in group}
        if not {"sync", PAPER, *PREFETCHERS} <= set(by):
            continue
        sync, runahead = by["sync"], by[PAPER]
        best = max(by[p]["tokens_per_s"] for p in PREFETCHERS)
        limit = overlap_limit(sync["compute_s"], sync["fetch_s"])
        out.append(
            {
                "point": dict(
                    zip(("profile", "model", "workload", "concurrency", "cache_fraction"), key, strict=True)
                ),
                "vs_sync": runahead["tokens_per_s"] / sync["tokens_per_s"],
                "vs_best_prefetch": runahead["tokens_per_s"] / best,
                "sync_overlap_limit": limit,
                "runahead_bound_ratio": runahead["bound_ratio"],
                **(
                    {"bottleneck_over_runahead": by[BOTTLENECK]["tokens_per_s"] / runahead["tokens_per_s"]}
                    if BOTTLENECK in by
                    else {}
                ),
            }
        )
    return out


def headline(figures: Mapping[str, Sequence[Row]]) -> dict[str, Any]:
    """The numbers ``docs/results.md`` quotes, computed from each figure's rows."""
    result: dict[str, Any] = {}
    precision = figures["fig1_precision"]
    result["fig1_precision"] = {
        f"{r['model']}/{r['cache']}/{r['cache_fraction']}": round(r["precision"], 3) for r in precision
    }
    for name in ("fig2_throughput_concurrency", "fig3_throughput_cache"):
        points = speedups(figures[name])
        result[name] = {
            "runahead_vs_sync": _span([p["vs_sync"] for p in points]),
            "runahead_vs_best_prefetch": _span([p["vs_best_prefetch"] for p in points]),
            "sync_overlap_limit": _span([p["sync_overlap_limit"] for p in points]),
            "vs_sync_over_limit": _span([p["vs_sync"] / p["sync_overlap_limit"] for p in points]),
            "bottleneck_over_runahead": _span(
                [p["bottleneck_over_runahead"] for p in points if "bottleneck_over_runahead" in p]
            ),
            "points": [
                {**p["point"], **{k: round(v, 3) for k, v in p.items() if k != "point"}} for p in points
            ],
        }
    breakdown = {}
    for key, group in _by(figures["fig4_breakdown"], "profile", "model", "workload").items():
        by = {r["policy"]: r for r in group}
        sync_fetches = by["sync"]["fetches_per_step"]
        breakdown["/".join(key)] = {
            policy: {
                "both_busy": round(r["overlap_fraction"], 3),
                "compute_waiting": round(r["compute_wait_fraction"], 3),
                "idle": round(r["idle_fraction"], 3),
                "fetches_per_step": round(r["fetches_per_step"], 1),
                "fetches_vs_sync": round(r["fetches_per_step"] / sync_fetches, 3)
                if sync_fetches
                else float("nan"),
                "wasted_share_of_prefetches": round(r["wasted_prefetches"] / r["prefetches"], 3)
                if r["prefetches"]
                else 0.0,
            }
            for policy, r in by.items()
        }
    result["fig4_breakdown"] = breakdown
    gaps = []
    for _, group in _by(figures["fig5_grouping"], "profile", "model", "workload", "cache_fraction").items():
        times: dict[str, float] = {r["policy"]: r["step_time_s"] for r in group}
        static = [v for k, v in times.items() if "grouping=static" in k]
        if PAPER in times and static:
            gaps.append((min(static) - times[PAPER]) * 1e3)
    result["fig5_grouping"] = {
        "best_static_minus_runahead_ms": _span(gaps),
        "runahead_best_everywhere": all(g >= 0 for g in gaps),
    }
    ordering = {}
    for key, group in _by(figures["fig6_ordering"], "profile", "model", "workload", "concurrency").items():
        by = {r["policy"]: r for r in group}
        base = by[PAPER]["step_time_s"]
        ordering["/".join(map(str, key))] = {
            policy: {
                "step_time_vs_runahead": round(r["step_time_s"] / base - 1, 4),
                "single_job_groups": round(single_job_fraction(r), 3),
                "compute_vs_runahead": round(r["compute_s"] / by[PAPER]["compute_s"] - 1, 4),
                "compute_waiting": round(r["compute_wait_fraction"], 3),
            }
            for policy, r in by.items()
        }
    result["fig6_ordering"] = ordering
    combo = {}
    for key, group in _by(
        figures["fig7_runahead_prefetch"], "profile", "model", "workload", "concurrency"
    ).items():
        by = {r["policy"]: r for r in group}
        both = by[PAPER_PREFETCH]
        combo["/".join(map(str, key))] = {
            "throughput_vs_runahead": round(both["tokens_per_s"] / by[PAPER]["tokens_per_s"] - 1, 4),
            "wasted_share_of_prefetches": round(both["wasted_prefetches"] / max(1, both["prefetches"]), 3),
        }
    result["fig7_runahead_prefetch"] = combo
    barrier = []
    for _, group in _by(figures["fig8_barrier"], "profile", "model", "workload", "concurrency").items():
        rate: dict[bool, float] = {r["step_barrier"]: r["tokens_per_s"] for r in group}
        barrier.append(rate[False] / rate[True])
    result["fig8_barrier"] = {"off_over_on": _span(barrier)}
    return result
