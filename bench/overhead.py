"""The runtime's own cost, before and after a change, side by side; and whether decisions changed.

Runs each point ``--reps`` times in a fresh process per source tree (``--before DIR`` and
``--after DIR``: folders holding a ``runahead`` package), ``--rounds`` processes per tree,
alternating the trees, and keeps the least CPU time of each (a loaded machine only ever adds
time). The points are the zero-cost bench's (Qwen3.6 on the Thor profile: sync and runahead at 8
and 16 requests, cache 1.0 and 0.3) and, with ``--real``, the same with the Thor's costs.
``--check`` instead runs a fixed set of simulated runs (every policy and knob, both profiles,
chat and agentic, zero cost with prefetch) in both trees and compares what they decided: every
compute and read record, every token time and the cache counters, as one digest per run.
``--instructions`` counts the instructions of each point's run alone under valgrind's callgrind
(the run bracketed by callgrind client requests through a small C helper built with ``cc``): slow
(~50x), but deterministic, so a few percent show on a loaded machine where CPU time cannot.
``--bytecodes`` counts the Python bytecodes each point's run executes (``sys.settrace`` opcode
events, no valgrind), per job and per function: deterministic too, and it says where they go
(``--top N`` functions of the after tree per point).

    python bench/overhead.py --before /tmp/main-src --after . --reps 3
    python bench/overhead.py --before /tmp/main-src --after . --check
    python bench/overhead.py --before /tmp/main-src --after . --instructions --steps 8
    python bench/overhead.py --before /tmp/main-src --after . --bytecodes --steps 16 --top 12
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

POLICIES = ("sync", "runahead")
CONCURRENCIES = (8, 16)
FRACTIONS = (1.0, 0.3)

CHECKS: list[dict[str, Any]] = [
    *(
        {"model": "qwen3.6-35b-a3b", "profile": "thor", "policy": p, "concurrency": c, "cache_fraction": 0.3}
        for p in ("sync", "runahead", "prefetch-gate", "prefetch-history", "runahead+prefetch")
        for c in (2, 16)
    ),
    *(
        {"model": "gemma4-26b-a4b", "profile": "mac-mini", "policy": p, "concurrency": 8}
        for p in (
            "runahead/fetch=global-srtf",
            "runahead/compute=fifo",
            "runahead/grouping=static:2:2:2:2",
            "runahead/grouping=bottleneck",
            "runahead/fetch=fifo",
        )
    ),
    {
        "model": "gemma4-26b-a4b",
        "profile": "thor",
        "policy": "runahead",
        "concurrency": 8,
        "cache_fraction": 0.3,
        "step_barrier": False,
    },
    {
        "model": "gemma4-26b-a4b",
        "profile": "thor",
        "policy": "runahead",
        "concurrency": 8,
        "cache_fraction": 0.3,
        "eviction": "lru",
    },
    *(
        {"model": "qwen3.6-35b-a3b", "profile": "thor", "policy": p, "concurrency": 4}
        | {"cache_fraction": 0.3, "workload": "agentic", "prefill_chunk": 256}
        for p in ("runahead", "sync")
    ),
    {
        "model": "qwen3.6-35b-a3b",
        "profile": "thor",
        "policy": "runahead+prefetch",
        "concurrency": 8,
        "cache_fraction": 0.3,
        "zero_cost": True,
    },
    {
        "model": "olmoe-1b-7b",
        "profile": "mac-mini",
        "policy": "runahead/grouping=bottleneck",
        "concurrency": 16,
        "cache_fraction": 0.1,
    },
    *(  # every expert resident: the cache stops counting pins (ExpertCache's ``experts``)
        {"model": "qwen3.6-35b-a3b", "profile": "thor", "policy": p, "concurrency": 8}
        | {"cache_fraction": 1.0, "preload": True}
        for p in ("sync", "runahead", "runahead+prefetch")
    ),
]
"""Runs whose decisions ``--check`` compares (16 steps each, 4 warm-up steps)."""

WORKER = """
import hashlib, json, sys
import runahead
from runahead.bench import BenchPoint, run_point
fields, reps = json.loads(sys.argv[1]), int(sys.argv[2])
best = None
for _ in range(reps):
    captured = []
    row = run_point(BenchPoint(**fields), timeline=captured.append)
    best = row if best is None or row["cpu_s"] < best["cpu_s"] else best
recorder, cache = captured[0].recorder, captured[0].cache
digest = hashlib.sha256(
    repr((recorder.computes, recorder.fetches, recorder.tokens, cache.stats)).encode()
).hexdigest()[:16]
keep = ("cpu_s", "jobs", "groups_run", "reads", "tokens_per_s")
print(json.dumps({"digest": digest, "package": runahead.__file__, **{k: best[k] for k in keep}}))
"""


CALLGRIND_HELPER = """
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) {
    CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT("run"); CALLGRIND_STOP_INSTRUMENTATION;
}
"""

IR_WORKER = """
import ctypes, json, sys
import runahead, runahead.bench as bench
helper = ctypes.CDLL(sys.argv[2])
run_virtual = bench.run_virtual
def bracketed(*args, **kwargs):
    helper.cg_start()
    try:
        return run_virtual(*args, **kwargs)
    finally:
        helper.cg_stop()
bench.run_virtual = bracketed
row = bench.run_point(bench.BenchPoint(**json.loads(sys.argv[1])))
keep = ("jobs", "groups_run", "reads")
print(json.dumps({"package": runahead.__file__, **{k: row[k] for k in keep}}))
"""


BYTECODE_WORKER = """
import collections, json, sys
import runahead, runahead.bench as bench
counts = collections.Counter()
def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode":
        counts[frame.f_code] += 1
    return tracer
run_virtual = bench.run_virtual
def traced(*args, **kwargs):
    sys.settrace(tracer)
    try:
        return run_virtual(*args, **kwargs)
    finally:
        sys.settrace(None)
bench.run_virtual = traced
row = bench.run_point(bench.BenchPoint(**json.loads(sys.argv[1])))
where = lambda code: f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno} {code.co_name}"
top = [(where(code), n) for code, n in counts.most_common(int(sys.argv[2]))]
total = sum(counts.values())
print(json.dumps({"package": runahead.__file__, "jobs": row["jobs"], "bytecodes": total, "top": top}))
"""


def measure_bytecodes(tree: Path, fields: dict[str, Any], top: int) -> dict[str, Any]:
    """Bytecodes one point's run executes (not the start-up, not the summary), and the ``top``
    functions by bytecodes executed in them."""
    return run_worker(tree, BYTECODE_WORKER, fields, top)


def compare_bytecodes(before: Path, after: Path, points: list[dict[str, Any]], real: bool, top: int) -> None:
    print_count_header("op")
    for fields in points:
        b, a = measure_bytecodes(before, fields, 0), measure_bytecodes(after, fields, top)
        print_count_row(fields, real, a["jobs"], b["bytecodes"] / b["jobs"], a["bytecodes"] / a["jobs"])
        for name, count in a["top"]:
            print(f"    {count / a['jobs']:7.1f} /job {count / a['bytecodes']:6.1%}  {name}", flush=True)


def measure_instructions(tree: Path, fields: dict[str, Any], helper: Path) -> dict[str, Any]:
    """Instructions of one point's run (not the start-up, not the summary) under callgrind."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "cg.out"
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no"]
        command += [f"--callgrind-out-file={out}", sys.executable, "-P", "-c", IR_WORKER]
        done = subprocess.run(
            [*command, json.dumps(fields), str(helper)], env=env, capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"{tree}: {fields}: {done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        for dump in Path(folder).glob("cg.out*"):
            text = dump.read_text()
            if "Trigger: Client Request: run" in text:
                totals = [line for line in text.splitlines() if line.startswith("totals:")]
                result["instructions"] = int(totals[0].split()[1])
    if not result["package"].startswith(str(tree.resolve())) or "instructions" not in result:
        raise RuntimeError(f"{tree}: ran {result['package']}, or no dump of the run")
    return result


def compare_instructions(before: Path, after: Path, points: list[dict[str, Any]], real: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        source, helper = Path(folder) / "cg.c", Path(folder) / "cg.so"
        source.write_text(CALLGRIND_HELPER)
        subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(helper), str(source)], check=True)
        print_count_header("Ir")
        for fields in points:
            b, a = (measure_instructions(tree, fields, helper) for tree in (before, after))
            print_count_row(
                fields, real, a["jobs"], b["instructions"] / b["jobs"], a["instructions"] / a["jobs"]
            )


def print_count_header(unit: str) -> None:
    print(
        f"{'costs':<9} {'policy':<9} {'conc':>4} {'cache':>5} {'jobs':>6} {f'before {unit}/job':>13} "
        f"{f'after {unit}/job':>12} {'after/before':>12}"
    )


def print_count_row(fields: dict[str, Any], real: bool, jobs: int, per_b: float, per_a: float) -> None:
    """One point's count per job before and after (instructions or bytecodes)."""
    print(
        f"{'thor' if real else 'zero':<9} {fields['policy']:<9} {fields['concurrency']:>4} "
        f"{fields['cache_fraction']:>5.2f} {jobs:>6} {per_b:>13.0f} {per_a:>12.0f} {per_a / per_b:>12.3f}",
        flush=True,
    )


def measure(tree: Path, fields: dict[str, Any], reps: int = 1) -> dict[str, Any]:
    """Run one point ``reps`` times in a fresh process on the ``runahead`` package under ``tree``;
    the row of the run that took the least CPU time."""
    return run_worker(tree, WORKER, fields, reps)


def run_worker(tree: Path, worker: str, fields: dict[str, Any], count: int) -> dict[str, Any]:
    """Run ``worker`` on one point in a fresh process on the ``runahead`` package under ``tree``;
    the JSON object it prints last."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    done = subprocess.run(  # -P: not the current folder's package, the tree's
        [sys.executable, "-P", "-c", worker, json.dumps(fields), str(count)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"{tree}: {fields}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["package"].startswith(str(tree.resolve())):
        raise RuntimeError(f"{tree}: ran the package at {result['package']}")
    return result


def overhead_points(
    steps: int,
    real: bool,
    workload: str = "chat",
    concurrencies: tuple[int, ...] = CONCURRENCIES,
    fractions: tuple[float, ...] = FRACTIONS,
    preload: bool = False,
) -> list[dict[str, Any]]:
    """The points compared: Qwen3.6 on the Thor, every policy, concurrency and cache fraction given
    (``agentic``: prompts prefilled in chunks and waves; ``chat`` prefills nothing; ``preload``:
    every expert that fits is resident before the run, as ``runahead bench --preload``)."""
    return [
        {
            "model": "qwen3.6-35b-a3b",
            "profile": "thor",
            "policy": policy,
            "concurrency": concurrency,
            "cache_fraction": fraction,
            "steps": steps,
            "zero_cost": not real,
            "workload": workload,
            **({"preload": True} if preload else {}),
        }
        for concurrency in concurrencies
        for fraction in fractions
        for policy in POLICIES
    ]


def compare_cost(
    before: Path, after: Path, points: list[dict[str, Any]], reps: int, real: bool, rounds: int
) -> None:
    header = (
        f"{'costs':<9} {'policy':<9} {'conc':>4} {'cache':>5} {'jobs':>6} {'groups':>6} {'reads':>6} "
        f"{'before us/job':>13} {'after us/job':>12} {'after/before':>12}"
    )
    print(header)
    for fields in points:
        best: dict[str, dict[str, Any]] = {}
        for _ in range(rounds):
            for name, tree in (("before", before), ("after", after)):
                row = measure(tree, fields, reps)
                if name not in best or row["cpu_s"] < best[name]["cpu_s"]:
                    best[name] = row
        b, a = best["before"], best["after"]
        if (b["jobs"], b["groups_run"], b["reads"]) != (a["jobs"], a["groups_run"], a["reads"]):
            work = ("jobs", "groups_run", "reads")
            print(f"  (before: {', '.join(f'{k} {b[k]}' for k in work)}; the row is after's)")
        per_b, per_a = b["cpu_s"] / b["jobs"] * 1e6, a["cpu_s"] / a["jobs"] * 1e6
        print(
            f"{'thor' if real else 'zero':<9} {fields['policy']:<9} {fields['concurrency']:>4} "
            f"{fields['cache_fraction']:>5.2f} {a['jobs']:>6} {a['groups_run']:>6} {a['reads']:>6} "
            f"{per_b:>13.1f} {per_a:>12.1f} {per_a / per_b:>12.2f}",
            flush=True,
        )


def compare_decisions(before: Path, after: Path) -> int:
    differ = 0
    for check in CHECKS:
        fields = {"steps": 16, "warmup_steps": 4, "cache_fraction": 0.2, **check}
        b, a = measure(before, fields), measure(after, fields)
        same = b["digest"] == a["digest"]
        differ += not same
        label = " ".join(f"{k}={v}" for k, v in check.items() if k not in ("model", "profile"))
        verdict = "same" if same else "DIFFERENT"
        print(f"{verdict:<9} {check['profile']:<8} {check['model']:<16} {label}", flush=True)
    print(f"{len(CHECKS) - differ} of {len(CHECKS)} runs decided the same in both trees")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="folder holding the old runahead package")
    parser.add_argument("--after", type=Path, default=Path("."), help="folder holding the new one")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="runs per process (least CPU counts)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per point and tree, alternating")
    parser.add_argument("--real", action="store_true", help="the Thor's costs instead of zero cost")
    parser.add_argument("--check", action="store_true", help="compare decisions instead of cost")
    parser.add_argument("--instructions", action="store_true", help="count instructions (callgrind)")
    parser.add_argument("--bytecodes", action="store_true", help="count bytecodes, per function (settrace)")
    parser.add_argument("--top", type=int, default=0, help="with --bytecodes: the after tree's top functions")
    parser.add_argument(
        "--workload", default="chat", choices=["chat", "agentic"], help="the points' workload"
    )
    parser.add_argument("--concurrency", help="comma list instead of 8,16")
    parser.add_argument("--cache-fraction", help="comma list instead of 1.0,0.3")
    parser.add_argument(
        "--preload", action="store_true", help="fill the cache before each run (runahead bench --preload)"
    )
    args = parser.parse_args()
    points = overhead_points(
        args.steps,
        args.real,
        args.workload,
        tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else CONCURRENCIES,
        tuple(float(f) for f in args.cache_fraction.split(",")) if args.cache_fraction else FRACTIONS,
        args.preload,
    )
    if args.check:
        return compare_decisions(args.before, args.after)
    if args.bytecodes:
        compare_bytecodes(args.before, args.after, points, args.real, args.top)
        return 0
    if args.instructions:
        compare_instructions(args.before, args.after, points, args.real)
        return 0
    compare_cost(args.before, args.after, points, args.reps, args.real, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
