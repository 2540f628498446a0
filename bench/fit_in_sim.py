"""Bottleneck grouping on the sim, priced the way a real backend prices it: from measured fits.

On torch and MLX the rule has no cost model: it prices candidate groups from a fit of the groups
the run has computed (:class:`runahead.bottleneck.ComputeFit`) and the link's time per read from
the run's link busy time. Real runs on this machine move by 10-20% from run to run, so what the
fit's form does to the rule's decisions cannot be shown there; on the sim it can, deterministically:
this hides the sim's cost model from the scheduler (the sim still computes and reads with it), so
the rule decides from what it measures, as on a real backend. ``--fit``:

- ``model``: the rule prices with the cost model (the sim's own path; nothing hidden);
- ``kinds``: a fit per kind of layer, entry / middle / last (what real backends use);
- ``one-line``: one fit over every layer (real backends before issue 11's fourth round).

    python bench/fit_in_sim.py --fit kinds bench --model qwen3.6-35b-a3b --profile thor \
        --policy runahead --concurrency 4,8 --cache-fraction 0.3 --steps 64 --out DIR
"""

from __future__ import annotations

import sys

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
    if fit == "one-line":
        ComputeFit.line = lambda self, layer: self.middle  # type: ignore[method-assign]


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "--fit":
        raise SystemExit("usage: python bench/fit_in_sim.py --fit model|kinds|one-line bench ARGS...")
    use_fit(args[1])
    main(args[2:])
