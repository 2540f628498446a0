"""``runahead demo``: the small model decoded under ``sync`` and ``runahead``, in alternating pairs.

On a small CPU machine one run's tokens/s moves by 10-30% from run to run (reads and compute share
the cores with everything else), so the demo runs a few sync/runahead pairs back to back and reports
the ratio of each pair: its median and range say how much one number can be trusted. The pairs
alternate which policy runs first, so a machine that drifts one way during the demo (a disk
speeding up or slowing down) does not favour the policy that always runs second.
"""

from __future__ import annotations

from typing import Any

import structlog

from runahead.progress import progress_bar

log = structlog.get_logger("runahead.demo")


def run_pairs(
    concurrency: int,
    tokens: int,
    cache_fraction: float,
    store: str,
    repeats: int,
    *,
    backend: str = "torch",
    dtype: str = "auto",
    threads: int | str = "auto",
) -> tuple[list[dict[str, Any]], list[float]]:
    """Run ``repeats`` pairs of sync and runahead on ``backend`` (torch or mlx), sync first in the
    first pair, runahead first in the next, and so on; return every row (each pair's as sync, then
    runahead) and each pair's tokens/s ratio (runahead over sync).

    ``dtype``: the compute dtype (``auto``: timed at start on torch, :mod:`runahead.backends.dtypes`;
    the mlx backend's own rule on mlx); ``threads``: torch's compute threads on CPU
    (:mod:`runahead.backends.threads`)."""
    from runahead.medium import small_model
    from runahead.torchbench import TorchPoint, run_torch_point

    path = str(small_model())
    rows: list[dict[str, Any]] = []
    ratios: list[float] = []
    with progress_bar("demo runs", 2 * repeats) as advance:
        for repeat in range(repeats):
            pair = []
            order = ("sync", "runahead") if repeat % 2 == 0 else ("runahead", "sync")
            for policy in order:
                point = TorchPoint(
                    path,
                    policy,
                    concurrency,
                    cache_fraction,
                    tokens,
                    store=store,
                    warmup_steps=4,
                    backend=backend,
                    dtype=dtype,
                    threads=threads,
                )
                pair.append(run_torch_point(point))
                advance(len(rows) + len(pair))
                log.info(
                    "run done",
                    repeat=repeat + 1,
                    policy=policy,
                    concurrency=concurrency,
                    tokens=tokens,
                    tokens_per_s=round(pair[-1]["tokens_per_s"], 1),
                )
            sync, ahead = sorted(pair, key=lambda row: row["policy"] != "sync")
            rows += [sync, ahead]
            ratios.append(ahead["tokens_per_s"] / sync["tokens_per_s"])
    return rows, ratios
