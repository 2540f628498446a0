"""Draw the paper figures from result rows (matplotlib's Agg canvas; no pyplot, no global state)."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runahead.paper.settings import BOTTLENECK, PAPER, PAPER_PREFETCH

Row = dict[str, Any]

POLICY_STYLE = {
    "sync": ("llama.cpp + LFU (sync)", "#7f7f7f", "s"),
    "prefetch-gate": ("SpecMD-like (prefetch-gate)", "#1f77b4", "^"),
    "prefetch-history": ("FineMoE-like (prefetch-history)", "#2ca02c", "v"),
    PAPER: ("Bevy (runahead, the paper's grouping)", "#d62728", "o"),
    BOTTLENECK: ("runahead, bottleneck-aware grouping", "#ff7f0e", "*"),
    PAPER_PREFETCH: ("Bevy + prefetching (the paper's grouping)", "#9467bd", "D"),
}
BREAKDOWN = (
    ("overlap_fraction", "both busy", "#d62728"),
    ("compute_only_fraction", "compute only", "#ff9896"),
    ("link_only_fraction", "link only", "#1f77b4"),
    ("idle_fraction", "idle", "#dddddd"),
)
DPI = 72


def _figure(rows: int, cols: int, width: float = 4.2, height: float = 3.0) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * cols, height * rows + 0.6), dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False)
    return figure, axes


def _save(figure: Any, path: Path, title: str) -> None:
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)


def _panels(rows: Sequence[Row], cols_key: str = "workload") -> tuple[list[tuple[str, str]], list[str]]:
    combos = sorted({(r["profile"], r["model"]) for r in rows})
    cols = sorted({r[cols_key] for r in rows})
    return combos, cols


def _lines(
    ax: Any,
    rows: Sequence[Row],
    x: str | Callable[[Row], float],
    y: Callable[[Row], float],
    series: Callable[[Row], str],
    style: Callable[[str], tuple[str, str | None, str]] | None = None,
) -> None:
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        xv = row[x] if isinstance(x, str) else x(row)
        groups[series(row)].append((xv, y(row)))
    for name in sorted(groups, key=lambda n: list(POLICY_STYLE).index(n) if n in POLICY_STYLE else 99):
        data = sorted(groups[name])
        label, color, marker = style(name) if style else (name, None, "o")
        ax.plot([d[0] for d in data], [d[1] for d in data], marker=marker, label=label, color=color, ms=4)


def _policy_style(name: str) -> tuple[str, str | None, str]:
    return POLICY_STYLE.get(name, (name, None, "o"))


def _grid_lines(
    rows: Sequence[Row], path: Path, title: str, x: str, xlabel: str, ylabel: str, y: Callable[[Row], float]
) -> None:
    combos, cols = _panels(rows)
    figure, axes = _figure(len(combos), len(cols))
    for (i, combo), (j, workload) in itertools.product(enumerate(combos), enumerate(cols)):
        ax = axes[i][j]
        subset = [r for r in rows if (r["profile"], r["model"]) == combo and r["workload"] == workload]
        _lines(ax, subset, x, y, lambda r: r["policy"], _policy_style)
        ax.set_title(f"{combo[0]} / {combo[1]} / {workload}", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=7)
    _save(figure, path, title)


def fig1_precision(rows: Sequence[Row], path: Path) -> None:
    """Precision of gate-based prefetching vs cache size, LRU / LFU / randomized cache; no cache dashed."""
    models = sorted({r["model"] for r in rows})
    figure, axes = _figure(1, len(models), 5.0, 3.6)
    colors = {"lru": "#1f77b4", "lfu": "#d62728", "random": "#2ca02c"}
    for ax, model in zip(axes[0], models, strict=True):
        subset = [r for r in rows if r["model"] == model]
        for cache, color in colors.items():
            data = sorted((r["cache_fraction"], r["precision"]) for r in subset if r["cache"] == cache)
            ax.plot([d[0] * 100 for d in data], [d[1] for d in data], marker="o", color=color, label=cache)
        for r in subset:
            if r["cache"] == "none":
                ax.axhline(r["precision"], ls="--", color="k", lw=1, label="no cache")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("cache size (% of experts)")
        ax.set_ylabel("prefetch precision")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(
        figure, path, "Fig. 1: gate-prefetch precision vs cache size (random = region 1, real cache = 1 + 2)"
    )


def fig2_throughput_concurrency(rows: Sequence[Row], path: Path) -> None:
    """Decode throughput vs concurrency at a 30% cache."""
    _grid_lines(
        rows,
        path,
        "Fig. 2: decode throughput vs concurrency (30% cache)",
        "concurrency",
        "requests",
        "decode tokens/s",
        lambda r: r["tokens_per_s"],
    )


def fig3_throughput_cache(rows: Sequence[Row], path: Path) -> None:
    """Decode throughput vs cache size at 8 requests."""
    _grid_lines(
        [{**r, "cache_pct": r["cache_fraction"] * 100} for r in rows],
        path,
        "Fig. 3: decode throughput vs cache size (8 requests)",
        "cache_pct",
        "cache size (% of experts)",
        "decode tokens/s",
        lambda r: r["tokens_per_s"],
    )


def fig4_breakdown(rows: Sequence[Row], path: Path) -> None:
    """Step-time breakdown (stacked fractions) and experts fetched per step (wasted prefetches hatched)."""
    combos, cols = _panels(rows)
    figure, axes = _figure(len(combos), 2 * len(cols), 3.4, 2.8)
    for (i, combo), (j, workload) in itertools.product(enumerate(combos), enumerate(cols)):
        subset = sorted(
            (r for r in rows if (r["profile"], r["model"]) == combo and r["workload"] == workload),
            key=lambda r: list(POLICY_STYLE).index(r["policy"]),
        )
        names = [r["policy"].replace("prefetch-", "pf-").replace("runahead/grouping=", "") for r in subset]
        ax = axes[i][2 * j]
        bottom = [0.0] * len(subset)
        for field, label, color in BREAKDOWN:
            values = [max(0.0, r[field]) for r in subset]
            ax.bar(names, values, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_title(f"{combo[0]}/{combo[1]}/{workload}", fontsize=8)
        ax.set_ylabel("fraction of step")
        ax.tick_params(axis="x", labelsize=7, rotation=20)
        ax = axes[i][2 * j + 1]
        per_step = [r["fetches_per_step"] for r in subset]
        wasted = [wasted_per_step(r) for r in subset]
        ax.bar(names, per_step, color="#1f77b4", label="fetched")
        ax.bar(names, wasted, color="none", edgecolor="k", hatch="//", label="wasted prefetches")
        ax.set_ylabel("experts / step")
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    axes[0][0].legend(fontsize=6, loc="lower left")
    axes[0][1].legend(fontsize=6)
    _save(figure, path, "Fig. 4: step-time breakdown and experts fetched per step (8 requests, 30% cache)")


def fig5_grouping(rows: Sequence[Row], path: Path) -> None:
    """Step time vs fetches per step: opportunistic and bottleneck-aware grouping against every static one."""

    def series(row: Row) -> str:
        policy: str = row["policy"]
        return policy.split("grouping=")[1] if "grouping=" in policy else "opportunistic (runahead)"

    def style(name: str) -> tuple[str, str | None, str]:
        if name.startswith("opportunistic"):
            return (name, "#d62728", "o")
        return (name, "#ff7f0e", "*") if name == "bottleneck" else (name, None, ".")

    combos, cols = _panels(rows)
    figure, axes = _figure(len(combos), len(cols), 5.0, 3.2)
    for (i, combo), (j, workload) in itertools.product(enumerate(combos), enumerate(cols)):
        ax = axes[i][j]
        subset = [r for r in rows if (r["profile"], r["model"]) == combo and r["workload"] == workload]
        _lines(ax, subset, "fetches_per_step", lambda r: r["step_time_s"] * 1e3, series, style)
        ax.set_title(f"{combo[0]} / {combo[1]} / {workload}", fontsize=9)
        ax.set_xlabel("experts fetched per step (cache 10-70%)")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    _save(figure, path, "Fig. 5: self-balancing vs static grouping (8 requests)")


def fig6_ordering(rows: Sequence[Row], path: Path) -> None:
    """Step time relative to runahead under FIFO compute / global-SRTF fetch / both; single-job groups."""
    combos = sorted({(r["profile"], r["model"], r["workload"]) for r in rows})
    figure, axes = _figure(1, len(combos), max(4.4, 9.0 / len(combos)), 3.4)
    variants = sorted({r["policy"] for r in rows}, key=len)
    for ax, combo in zip(axes[0], combos, strict=True):
        subset = [r for r in rows if (r["profile"], r["model"], r["workload"]) == combo]
        concurrencies = sorted({r["concurrency"] for r in subset})
        width = 0.8 / len(concurrencies)
        for k, concurrency in enumerate(concurrencies):
            by = {r["policy"]: r for r in subset if r["concurrency"] == concurrency}
            base = by[PAPER]["step_time_s"]
            xs = [v + k * width for v in range(len(variants))]
            heights = [by[v]["step_time_s"] / base for v in variants]
            bars = ax.bar(xs, heights, width, label=f"{concurrency} requests")
            for bar, variant in zip(bars, variants, strict=True):
                ax.annotate(
                    f"{single_job_fraction(by[variant]):.0%}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
        ax.set_xticks([v + width * (len(concurrencies) - 1) / 2 for v in range(len(variants))])
        labels = [v.removeprefix(PAPER).strip("/").replace("/", "\n") or "runahead" for v in variants]
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylim(0.9, max(1.2, ax.get_ylim()[1]))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title("/".join(combo), fontsize=8)
        ax.set_ylabel("step time / runahead's")
    axes[0][0].legend(fontsize=6)
    _save(figure, path, "Fig. 6: scheduling order (labels: share of single-job groups)")


def fig7_runahead_prefetch(rows: Sequence[Row], path: Path) -> None:
    """runahead+prefetch throughput relative to runahead, and the share of its prefetches wasted."""
    figure, axes = _figure(1, 2, 5.0, 3.4)
    ratio, wasted = axes[0]
    combos = sorted({(r["profile"], r["model"], r["workload"]) for r in rows})
    for combo in combos:
        subset = [r for r in rows if (r["profile"], r["model"], r["workload"]) == combo]
        base = {r["concurrency"]: r for r in subset if r["policy"] == PAPER}
        both = sorted((r["concurrency"], r) for r in subset if r["policy"] == PAPER_PREFETCH)
        label = "/".join(combo)
        ratio.plot(
            [c for c, _ in both],
            [r["tokens_per_s"] / base[c]["tokens_per_s"] for c, r in both],
            "o-",
            label=label,
        )
        wasted.plot(
            [c for c, _ in both], [r["wasted_prefetches"] / max(1, r["prefetches"]) for c, r in both], "o-"
        )
    ratio.axhline(1.0, color="k", lw=0.8)
    ratio.set_xlabel("requests")
    ratio.set_ylabel("throughput / runahead's")
    ratio.legend(fontsize=6)
    wasted.set_xlabel("requests")
    wasted.set_ylabel("wasted share of prefetches")
    wasted.set_ylim(0, 1)
    _save(figure, path, "Fig. 7: runahead + prefetching vs runahead (30% cache)")


def fig8_barrier(rows: Sequence[Row], path: Path) -> None:
    """Throughput with the step barrier off relative to on (beyond the paper)."""
    figure, axes = _figure(1, 1, 6.0, 3.6)
    ax = axes[0][0]
    combos = sorted({(r["profile"], r["model"], r["workload"]) for r in rows})
    for combo in combos:
        subset = [r for r in rows if (r["profile"], r["model"], r["workload"]) == combo]
        on = {r["concurrency"]: r for r in subset if r["step_barrier"]}
        off = sorted((r["concurrency"], r) for r in subset if not r["step_barrier"])
        ax.plot(
            [c for c, _ in off],
            [r["tokens_per_s"] / on[c]["tokens_per_s"] for c, r in off],
            "o-",
            label="/".join(combo),
        )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("requests")
    ax.set_ylabel("throughput, barrier off / on")
    ax.legend(fontsize=7)
    _save(figure, path, "Fig. 8 (beyond the paper): no step barrier vs barrier, runahead, 30% cache")


def wasted_per_step(row: Row) -> float:
    """Wasted prefetches per decode step over the whole run (the cache counts them per run).

    For an ``agentic`` row this includes the prefills' and the cold start's prefetches, spread over
    the run's decode steps (``concurrency * steps`` tokens), not just the measured window's.
    """
    steps = json.loads(row["point_key"])["steps"] if "point_key" in row else row["steps"]
    return float(row["wasted_prefetches"] / steps)


def single_job_fraction(row: Row) -> float:
    """Share of compute groups that held one job (the row's ``group_sizes``; JSON keys are strings)."""
    sizes = {int(k): v for k, v in row["group_sizes"].items()}
    return float(sizes.get(1, 0) / max(1, sum(sizes.values())))


DRAW: dict[str, Callable[[Sequence[Row], Path], None]] = {
    "fig1_precision": fig1_precision,
    "fig2_throughput_concurrency": fig2_throughput_concurrency,
    "fig3_throughput_cache": fig3_throughput_cache,
    "fig4_breakdown": fig4_breakdown,
    "fig5_grouping": fig5_grouping,
    "fig6_ordering": fig6_ordering,
    "fig7_runahead_prefetch": fig7_runahead_prefetch,
    "fig8_barrier": fig8_barrier,
}
