"""`runahead bench paper`'s wall time, one source tree after another on the same machine.

Each tree (a folder holding a ``runahead`` package, e.g. ``git archive <rev> runahead | tar -x -C DIR``)
runs the whole paper bench in a fresh process (``python -P``: that tree's package, not the current
folder's) into a fresh output folder, one tree after the other (never both at once: they would share
the cores). Reports each tree's wall and CPU time and number of points, and, over the points both
trees ran (matched by the rows' ``point_key``), the sum of the rows' own ``wall_s``: the trees may differ
in their point lists (later trees add systems to the figures).

    python bench/paper_wall.py --before /tmp/old-src --after /tmp/new-src [--quick] [--workers 2] [--keep DIR]

``--before-paper-grouping`` matches a tree from before issue 11's grouping (f221470, when issue 14
was filed), whose plain ``runahead`` is today's ``runahead/grouping=opportunistic``.

Needs a quiet machine: wall time is what it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runahead.paper.runner import load_rows


def run_tree(tree: Path, quick: bool, workers: int, keep: Path | None = None) -> dict[str, Any]:
    """One tree's whole paper bench: wall, children's CPU, and each point's own seconds. ``keep``:
    the bench's output folder (a fresh one), kept for a look at its rows; else a temporary one."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    if keep is not None and keep.exists():
        raise SystemExit(f"{keep} exists: --keep wants a fresh folder for each tree's output")
    with (
        contextlib.nullcontext(str(keep))
        if keep
        else tempfile.TemporaryDirectory(prefix="paper-wall-") as out
    ):
        command = [sys.executable, "-P", "-m", "runahead", "bench", "paper", "--out", out]
        command += ["--workers", str(workers), "--no-resume", "--quiet"] + (["--quick"] if quick else [])
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            failed = f"{tree}: runahead bench paper failed ({done.returncode})"
            raise SystemExit(f"{failed}:\n{done.stderr[-2000:]}")
        rows = load_rows(Path(out) / "rows.jsonl")
    # Fig. 1's precision replays have no wall_s
    points = {key: float(row["wall_s"]) for key, row in rows.items() if "wall_s" in row}
    return {
        "tree": str(tree),
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "points": points,
    }


def as_opportunistic(key: str) -> str:
    """A stored point key from a tree older than the bottleneck-aware grouping (issue 11), where
    ``runahead[...]`` was the paper's grouping: the same point's key today."""
    fields = json.loads(key)
    policy = fields.get("policy")
    if isinstance(policy, str) and policy.startswith("runahead") and "grouping=" not in policy:
        name, *knobs = policy.split("/")
        fields["policy"] = "/".join([name, "grouping=opportunistic", *knobs])
    return json.dumps(fields, sort_keys=True)


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--before", type=Path, required=True, help="folder holding the before tree's package")
    parser.add_argument("--after", type=Path, required=True, help="folder holding the after tree's package")
    parser.add_argument("--quick", action="store_true", help="the paper bench's short settings")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write both runs' figures here")
    parser.add_argument("--keep", type=Path, help="keep each tree's bench output in KEEP/before, KEEP/after")
    parser.add_argument(
        "--before-paper-grouping",
        action="store_true",
        help="the before tree predates bottleneck grouping: its plain runahead is the paper's grouping",
    )
    args = parser.parse_args()
    runs = []
    for name, tree in (("before", args.before), ("after", args.after)):
        if not (tree / "runahead" / "__init__.py").is_file():
            raise SystemExit(f"{tree} holds no runahead package")
        print(f"{name}: {tree} ...", flush=True)
        keep = args.keep / name if args.keep else None
        runs.append(run_tree(tree, args.quick, args.workers, keep))
    before, after = runs
    if args.before_paper_grouping:
        before["points"] = {as_opportunistic(key): s for key, s in before["points"].items()}
    common = sorted(set(before["points"]) & set(after["points"]))
    sums = [sum(run["points"][key] for key in common) for run in runs]
    for name, run in zip(("before", "after"), runs, strict=True):
        print(f"{name}: wall {run['wall_s']:.1f} s, CPU {run['cpu_s']:.1f} s, {len(run['points'])} points")
    wall, cpu = after["wall_s"] / before["wall_s"], after["cpu_s"] / before["cpu_s"]
    print(f"after / before: wall {wall:.3f}, CPU {cpu:.3f}")
    ratio = sums[1] / sums[0]
    print(f"{len(common)} points in both: {sums[0]:.1f} s -> {sums[1]:.1f} s, per point summed ({ratio:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"before": before, "after": after, "common": len(common)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
