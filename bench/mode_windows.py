"""Both of adaptive grouping's modes measured side by side in one run, in alternating windows.

    RUNAHEAD_CACHE=<dir> python bench/mode_windows.py --model small --store host --cache-fraction 0.5 \
        --concurrency 8 --window 12 --steps 128

Runs plain ``runahead`` on the torch backend with :class:`runahead.mode.ModeChooser`'s windows all set
to ``--window`` steps and no margin, so it alternates running ahead and batching (each window after a
switch starts with one settling step) and prints every window's seconds per token as the chooser
measured them. Within one run the machine's drift (10-30% between runs on these VMs) touches both
modes alike, which a comparison of separate runs cannot promise. docs/results-torch.md, "Adaptive
grouping", has what it showed.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from runahead import mode
from runahead.medium import medium_model, small_model
from runahead.torchbench import TorchPoint, run_torch_point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", choices=["small", "medium"])
    parser.add_argument("--store", default="disk", choices=["disk", "host"])
    parser.add_argument("--link-gbps", type=float, default=None)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--window", type=int, default=12, help="measured steps of every window")
    args = parser.parse_args()
    mode.PROBE_STEPS = mode.FIRST_EXPLOIT_STEPS = mode.MAX_EXPLOIT_STEPS = args.window
    mode.SWITCH_MARGIN = 0.0
    windows: list[tuple[mode.Mode, float]] = []
    done = mode.ModeChooser._window_done

    def record(chooser: mode.ModeChooser, now: float, seconds: float) -> None:
        windows.append((chooser.mode, seconds))
        done(chooser, now, seconds)

    mode.ModeChooser._window_done = record  # type: ignore[method-assign]
    point = TorchPoint(
        str(small_model() if args.model == "small" else medium_model()),
        "runahead",
        args.concurrency,
        args.cache_fraction,
        args.steps,
        store=args.store,
        link_gbps=args.link_gbps,
        warmup_steps=4,
    )
    row: dict[str, Any] = run_torch_point(point)
    for index, (which, seconds) in enumerate(windows):
        print(f"window {index:2d}  {which.value:5s}  {seconds * 1e3:7.2f} ms a token")
    later = windows[2:]  # the first two windows start cold
    for which in mode.Mode:
        times = [seconds for kind, seconds in later if kind is which]
        if times:
            median = statistics.median(times) * 1e3
            print(f"{which.value:5s} median {median:.2f} ms a token over {len(times)} windows")
    print(f"run: {row['tokens_per_s']:.1f} tokens/s, {row['batched_share']:.0%} of its tokens batched")


if __name__ == "__main__":
    main()
