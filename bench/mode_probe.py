"""A prototype, not the product: choose between running ahead and batching from measured round times.

    RUNAHEAD_CACHE=<dir> python bench/mode_probe.py bench --backend torch --model small --policy runahead \
        --concurrency 8 --cache-fraction 0.3 --steps 32 --warmup-steps 4

Runs ``runahead`` (arguments as for ``runahead``) with the scheduler's grouping switched at step-barrier
rounds between the bottleneck rule (``runahead``) and one group of every request (``sync``'s), from the
wall time of each round: ``PROBE`` rounds of each (the first of a window is a transition and is not
counted), then ``EXPLOIT`` rounds of the faster, then ``PROBE`` rounds of the other again, and so on.
Prints each window's mean round time to stderr. Real backends only (wall clock); it patches the
scheduler, so it lives here, beside ``grouping_gap.py``.

Measured (docs/results-torch.md, "The demo's point on an AVX2 EPYC"): at the demo's point, where
batching won, its tokens/s came out between sync's and runahead's; behind a 0.6 GB/s host link, where
running ahead wins by ~27%, it kept to running ahead but lost ~6% to plain ``runahead`` in a 32-step
run, the cost of its batch probes. Where the two modes' round times are close it switches back and
forth (no margin before a switch).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import runahead.actors.scheduler as scheduler_module
from runahead.cli import main
from runahead.scheduling import Grouping

AHEAD, BATCH = Grouping(bottleneck=True), Grouping(static=True)
PROBE = 3  # rounds a probe window lasts (the first is the switch's transition, not counted)
EXPLOIT = 10  # rounds the faster mode runs before the other is probed again


class ModeProbe:
    """Switches one scheduler's grouping at round boundaries from the rounds' measured wall times."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.mode, self.phase, self.left = "ahead", "probe", PROBE
        self.started: float | None = None
        self.window: list[float] = []
        self.mean: dict[str, float] = {}
        self.log: list[tuple[str, str, float]] = []

    def round_ended(self) -> None:
        now = time.monotonic()
        if self.started is not None:
            self.window.append(now - self.started)
        self.started = now
        self.left -= 1
        if self.left > 0:
            return
        counted = self.window[1:] or self.window
        self.mean[self.mode] = sum(counted) / len(counted)
        self.log.append((self.phase, self.mode, round(self.mean[self.mode] * 1e3, 1)))
        self.window = []
        if self.phase == "probe" and len(self.mean) < 2:
            self._switch("batch", "probe", PROBE)
        elif self.phase == "probe":
            self._switch(min(self.mean, key=self.mean.__getitem__), "exploit", EXPLOIT)
        else:
            self._switch("batch" if self.mode == "ahead" else "ahead", "probe", PROBE)

    def _switch(self, mode: str, phase: str, rounds: int) -> None:
        self.mode, self.phase, self.left = mode, phase, rounds
        self.scheduler.queue.grouping = AHEAD if mode == "ahead" else BATCH


PROBES: list[ModeProbe] = []
_init = scheduler_module.ComputeScheduler.__init__


def _probed_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    probe = ModeProbe(self)
    PROBES.append(probe)
    release = self.barrier._release

    def released() -> Any:
        probe.round_ended()
        return release()

    self.barrier._release = released


if __name__ == "__main__":
    scheduler_module.ComputeScheduler.__init__ = _probed_init  # type: ignore[method-assign]
    code = main(sys.argv[1:])
    for probe in PROBES:
        print("mode windows (phase, mode, mean ms a round):", probe.log, file=sys.stderr)
    sys.exit(code)
