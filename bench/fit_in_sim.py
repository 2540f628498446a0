"""Bottleneck grouping on the sim, priced the way a real backend prices it: from measured fits.

On torch and MLX the rule has no cost model: it prices candidate groups from a fit of the groups
the run has computed (:class:`runahead.bottleneck.ComputeFit`) and the link's time per read from
the run's link busy time. Real runs on this machine move by 10-20% from run to run, so what the
fit's form does to the rule's decisions cannot be shown there; on the sim it can, deterministically:
this hides the sim's cost model from the scheduler (the sim still computes and reads with it), so
the rule decides from what it measures, as on a real backend. ``--fit``:

- ``model``: the rule prices with the cost model (the sim's own path; nothing hidden);
- ``kinds``: a fit per kind of layer, entry / middle / last (what real backends use);
- ``one-line``: one line over every layer by job count (real backends before issue 11's fourth
  round).

    python bench/fit_in_sim.py --fit kinds bench --model qwen3.6-35b-a3b --profile thor \
        --policy runahead --concurrency 4,8 --cache-fraction 0.3 --steps 64 --out DIR

`bash bench/fit-in-sim.sh` runs every variant over both profiles and models; `python
bench/fit_in_sim.py --summary bench/results/fit-in-sim` prints each variant's tokens/s over the
paper's grouping, and the share of the rule's gain (with the cost model) each measured fit keeps.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import runahead.actors.scheduler as scheduler
from runahead.bottleneck import ComputeFit
from runahead.cli import main

FITS = ("model", "kinds", "one-line")


def use_fit(fit: str) -> None:
    """Make every scheduler built from now on price the rule's groups with ``fit``."""
    if fit not in FITS:
        raise SystemExit(f"--fit must be one of {', '.join(FITS)}, got {fit!r}")
    if fit == "model":
        return
    built = scheduler.ComputeScheduler.__init__

    def measuring(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        built(self, *args, **kwargs)
        self._model = self._pricer = None  # the rule measures, as without a cost model

    scheduler.ComputeScheduler.__init__ = measuring  # type: ignore[method-assign]
    if fit == "one-line":  # the fit before: one line over every layer's groups, by job count

        def observe_group(self, jobs, seconds):  # type: ignore[no-untyped-def]
            if not any(job.prefill for job in jobs):
                self.middle.observe(len(jobs), seconds)

        ComputeFit.observe_group = observe_group  # type: ignore[method-assign]
        ComputeFit.__call__ = lambda self, jobs: self.middle(len(jobs))  # type: ignore[method-assign]


VARIANTS = ("fit-one-line", "fit-per-kind-jobs", "fit-per-kind-experts", "cost-model")


def summary(folder: Path) -> None:
    """Tokens/s of each variant over the paper's grouping, point by point (a markdown table)."""
    rates: dict[tuple[str, int], dict[str, float]] = collections.defaultdict(dict)
    for path in sorted(folder.glob("*-paper-grouping.jsonl")):
        setup = path.name.removesuffix("-paper-grouping.jsonl")
        for variant in ("paper-grouping", *VARIANTS):
            runs = folder / f"{setup}-{variant}.jsonl"
            if runs.exists():
                for line in runs.read_text().splitlines():
                    row = json.loads(line)
                    rates[setup, row["concurrency"]][variant] = row["tokens_per_s"]
    shown = [v for v in VARIANTS if any(v in point for point in rates.values())]
    print("| setup | requests | paper's grouping | " + " | ".join(shown) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(shown))
    kept: dict[str, list[float]] = collections.defaultdict(list)
    for (setup, requests), point in sorted(rates.items()):
        paper = point["paper-grouping"]
        cells = [f"{point[v] / paper:.3f}" if v in point else "-" for v in shown]
        print(f"| {setup} | {requests} | {paper:.1f} tok/s | " + " | ".join(cells) + " |")
        gain = point.get("cost-model", paper) / paper - 1
        for variant in shown[:-1]:
            if gain > 0 and variant in point:
                kept[variant].append((point[variant] / paper - 1) / gain)
    for variant, shares in kept.items():
        low, high, mean = (round(x, 2) or 0.0 for x in (min(shares), max(shares), sum(shares) / len(shares)))
        print(
            f"{variant}: keeps {low:.0%}-{high:.0%} of the rule's gain with the cost model "
            f"(mean {mean:.0%}, {len(shares)} points)"
        )


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--summary"] and len(args) == 2:
        summary(Path(args[1]))
        raise SystemExit(0)
    if len(args) < 2 or args[0] != "--fit":
        raise SystemExit("usage: python bench/fit_in_sim.py --fit model|kinds|one-line bench ARGS...")
    use_fit(args[1])
    main(args[2:])
