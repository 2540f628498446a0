"""What the paper figures measure: the settings (full, quick, tiny) and each figure's points.

Every figure is a list of :class:`~runahead.bench.BenchPoint` (or, for the precision figure,
:class:`PrecisionPoint`) built from one :class:`Settings`. Figures share points (the breakdown is
the 30%, 8-request column of the cache sweep; every ablation includes plain ``runahead``), and the
runner measures each distinct point once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from runahead.bench import BenchPoint, sweep

PAPER = "runahead/grouping=opportunistic"
"""The paper's system (Bevy): runahead with the paper's opportunistic grouping, named explicitly
because plain ``runahead`` means bottleneck-aware grouping."""

PAPER_PREFETCH = "runahead+prefetch/grouping=opportunistic"
"""The paper's combination study (Fig. 7): the paper's system with the gate's prefetches, against
:data:`PAPER` (plain ``runahead+prefetch`` uses bottleneck-aware grouping)."""

BASELINES = ("sync", "prefetch-gate", "prefetch-history", PAPER)
"""llama.cpp + LFU, SpecMD (gate prefetch), FineMoE (history prefetch), Bevy."""

BOTTLENECK = "runahead/grouping=bottleneck"
"""Bottleneck-aware grouping (beyond the paper; what plain ``runahead`` means), named explicitly:
drawn beside the paper's grouping wherever grouping matters (throughput, breakdown, the grouping
ablation)."""

ORDERINGS = (
    PAPER,
    f"{PAPER}/compute=fifo",
    f"{PAPER}/fetch=global-srtf",
    f"{PAPER}/compute=fifo/fetch=global-srtf",
)
"""The paper's Fig. 12: lowest-layer-first compute and fetch vs FIFO compute, global-SRTF fetch, both."""

PRECISION_CACHES = ("lru", "lfu", "random")
"""Caches of the precision replay: LRU, LFU, and a randomized cache (see :mod:`runahead.paper.precision`)."""


@dataclass(frozen=True, slots=True)
class PrecisionPoint:
    """One point of the precision replay: a model's synthetic routing under one cache."""

    model: str
    cache: str
    cache_fraction: float
    requests: int
    steps: int
    warmup_steps: int
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Settings:
    """How much of the paper's evaluation to run, and how long each point runs."""

    name: str
    profiles: tuple[str, ...]
    models: tuple[str, ...]
    workloads: tuple[str, ...]
    """Workloads of the end-to-end figures (throughput, breakdown, runahead+prefetch)."""
    ablation_workloads: tuple[str, ...]
    """Workloads of the ablations (grouping, ordering, barrier)."""
    cache_workloads: tuple[str, ...]
    """Workloads of the cache-size sweep (agentic points cost ~4x chat's: the full run keeps it to chat)."""
    concurrencies: tuple[int, ...]
    cache_fractions: tuple[float, ...]
    steps: int
    warmup_steps: int
    static_groupings: tuple[str, ...]
    main_concurrency: int = 8
    main_cache: float = 0.3
    ordering_concurrencies: tuple[int, ...] = (8,)
    precision_requests: int = 4
    precision_steps: int = 128
    prefill_chunk: int = 512
    seed: int = 0
    timeline: tuple[str, str, str] | None = None
    """(profile, model, workload) of the representative point whose timeline is exported."""
    timeline_steps: int = 16
    charge_overhead: bool = False
    """Every bench point advances virtual time by the runtime's own CPU time (``--charge-overhead``)."""
    charge_scale: float = 1.0
    """With ``charge_overhead``, that CPU time times this (``--charge-scale``: a host with slower cores)."""
    extra: dict[str, str] = field(default_factory=dict)


STATIC_OF_8 = ("static:1:1:1:1:1:1:1:1", "static:2:2:2:2", "static:4:4", "static:8", "static:3:3:2")

FULL = Settings(
    name="full",
    profiles=("thor", "mac-mini"),
    models=("qwen3.6-35b-a3b", "gemma4-26b-a4b"),
    workloads=("chat", "agentic"),
    ablation_workloads=("chat",),
    cache_workloads=("chat",),
    concurrencies=(2, 4, 8, 16),
    cache_fractions=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
    steps=48,
    warmup_steps=8,
    static_groupings=STATIC_OF_8,
    ordering_concurrencies=(8, 16),
    timeline=("thor", "gemma4-26b-a4b", "chat"),
)

QUICK = Settings(
    name="quick",
    profiles=("thor",),
    models=("gemma4-26b-a4b",),
    workloads=("chat", "agentic"),
    ablation_workloads=("chat",),
    cache_workloads=("chat", "agentic"),
    concurrencies=(2, 4, 8, 16),
    cache_fractions=(0.1, 0.3, 0.5, 0.7),
    steps=16,
    warmup_steps=4,
    static_groupings=("static:1:1:1:1:1:1:1:1", "static:2:2:2:2", "static:4:4", "static:8"),
    precision_requests=2,
    precision_steps=48,
    timeline=("thor", "gemma4-26b-a4b", "chat"),
    timeline_steps=8,
)

TINY = Settings(
    name="tiny",
    profiles=("mac-mini",),
    models=("olmoe-1b-7b",),
    workloads=("chat", "agentic"),
    ablation_workloads=("chat",),
    cache_workloads=("chat", "agentic"),
    concurrencies=(2, 4),
    cache_fractions=(0.3, 0.6),
    steps=3,
    warmup_steps=2,
    static_groupings=("static:1:1:1:1", "static:2:2", "static:4"),
    main_concurrency=4,
    ordering_concurrencies=(4,),
    precision_requests=1,
    precision_steps=12,
    prefill_chunk=64,
    timeline=("mac-mini", "olmoe-1b-7b", "chat"),
    timeline_steps=3,
)


def _points(
    s: Settings,
    workloads: tuple[str, ...],
    policies: tuple[str, ...],
    concurrencies: tuple[int, ...],
    fractions: tuple[float, ...],
    barriers: tuple[bool, ...] = (True,),
) -> list[BenchPoint]:
    return [
        point
        for profile, model, workload in itertools.product(s.profiles, s.models, workloads)
        for point in sweep(
            model,
            profile,
            policies,
            concurrencies,
            fractions,
            s.steps,
            workload=workload,
            seed=s.seed,
            barriers=barriers,
            warmup_steps=s.warmup_steps,
            prefill_chunk=s.prefill_chunk,
            charge_overhead=s.charge_overhead,
            charge_scale=s.charge_scale,
        )
    ]


FIGURES = (
    "fig1_precision",
    "fig2_throughput_concurrency",
    "fig3_throughput_cache",
    "fig4_breakdown",
    "fig5_grouping",
    "fig6_ordering",
    "fig7_runahead_prefetch",
    "fig8_barrier",
)
"""Figure names, in order: each becomes ``NAME.png`` and ``NAME.jsonl``."""


def figure_points(s: Settings) -> dict[str, list[BenchPoint | PrecisionPoint]]:
    """Every figure's points under settings ``s``."""
    main_c, main_f = (s.main_concurrency,), (s.main_cache,)
    grouping = (PAPER, BOTTLENECK, *(f"runahead/grouping={g}" for g in s.static_groupings))
    systems = (*BASELINES, BOTTLENECK)
    precision: list[BenchPoint | PrecisionPoint] = [
        PrecisionPoint(
            model, cache, fraction, s.precision_requests, s.precision_steps, s.warmup_steps, s.seed
        )
        for model, (cache, fraction) in itertools.product(
            s.models, [("none", 0.0), *itertools.product(PRECISION_CACHES, s.cache_fractions)]
        )
    ]
    points: dict[str, list[BenchPoint | PrecisionPoint]] = {
        "fig1_precision": precision,
        "fig2_throughput_concurrency": [*_points(s, s.workloads, systems, s.concurrencies, main_f)],
        "fig3_throughput_cache": [*_points(s, s.cache_workloads, systems, main_c, s.cache_fractions)],
        "fig4_breakdown": [*_points(s, s.workloads, systems, main_c, main_f)],
        "fig5_grouping": [*_points(s, s.ablation_workloads, grouping, main_c, s.cache_fractions)],
        "fig6_ordering": [*_points(s, s.ablation_workloads, ORDERINGS, s.ordering_concurrencies, main_f)],
        "fig7_runahead_prefetch": [
            *_points(s, s.workloads, (PAPER, PAPER_PREFETCH), s.concurrencies, main_f)
        ],
        "fig8_barrier": [*_points(s, s.ablation_workloads, (PAPER,), s.concurrencies, main_f, (True, False))],
    }
    assert tuple(points) == FIGURES
    return points
