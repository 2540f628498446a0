"""The torch model code before and after a change, in one process, alternately: one request, all resident.

The per-token work of the torch backend outside its matrix products (norms, RoPE, routing, the
hops around them) is a few percent of a token per change, below what separate runs on a shared
machine can show (+-15% from run to run). So both versions run in one process on one loaded
backend (the medium model, every expert preloaded), round after round, alternating which goes
first: ``--before DIR`` is a folder holding an older ``runahead`` package (``git archive <rev>
runahead | tar -x -C DIR``); its ``runahead/models/base.py`` is loaded beside the current one and
its ``MoEModel`` methods swapped in for the "before" turns (their module-level helpers come with
them). A before tree without the runtime's speculative-gate switch ran the next layer's gate under
every policy, so its turns do too. Per turn: the compute thread's CPU time and the wall time per
token (``--tokens`` greedy tokens after 4 warm-up ones), and the tokens, which must not change.

    OMP_NUM_THREADS=1 python bench/model_ab.py --before /tmp/before-src --rounds 8 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import runahead.models.base as base
from runahead.backends.torch import TorchBackend
from runahead.jobs import Group, JobResult, RequestSpec
from runahead.medium import medium_model
from runahead.sampling import SamplingParams
from runahead.torchbench import warm_resident


def load_before(tree: Path) -> tuple[dict[str, Any], bool]:
    """The before tree's ``MoEModel`` methods, and whether it ran the speculative gate always."""
    spec = importlib.util.spec_from_file_location("runahead_before_base", tree / "runahead/models/base.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    methods = {name: value for name, value in vars(module.MoEModel).items() if callable(value)}
    gate_always = "use_speculative_gate" not in (tree / "runahead/backends/common.py").read_text()
    return methods, gate_always


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--policy", default="sync")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    before_methods, gate_always = load_before(args.before)
    current = vars(base.MoEModel)
    after_methods = {name: current[name] for name in before_methods if name in current}
    backend = TorchBackend.open(str(medium_model()), cache_fraction=1.0, dtype="float32")
    busy = [0.0]
    compute = TorchBackend._compute

    def timed(self: TorchBackend, group: Group) -> list[JobResult]:
        start = time.thread_time()
        try:
            return compute(self, group)
        finally:
            busy[0] += time.thread_time() - start

    TorchBackend._compute = timed  # type: ignore[method-assign]

    def turn(version: str) -> tuple[float, float, dict[int, list[int]]]:
        for name, method in (before_methods if version == "before" else after_methods).items():
            setattr(base.MoEModel, name, method)

        async def go() -> tuple[float, dict[int, list[int]]]:
            runtime = await warm_resident(backend, args.policy)
            if version == "before" and gate_always:
                backend.speculate = True  # over the runtime's switch: the before tree ran it always
            busy[0] = 0.0
            start = time.perf_counter()
            tokens = await runtime.run(
                [RequestSpec(1, args.tokens, prompt=(5,), sampling=SamplingParams(max_tokens=args.tokens))]
            )
            return time.perf_counter() - start, tokens

        wall, tokens = asyncio.run(go())
        return busy[0] / args.tokens * 1e3, wall / args.tokens * 1e3, tokens

    turns: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    outputs: dict[str, dict[int, list[int]]] = {}
    try:
        for round_ in range(args.rounds):
            for version in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
                cpu, wall, outputs[version] = turn(version)
                turns[version].append((cpu, wall))
            print(round_, {v: [round(x, 1) for x in t[-1]] for v, t in turns.items()}, flush=True)
    finally:
        backend.close()
    row: dict[str, Any] = {"rounds": args.rounds, "tokens": args.tokens, "policy": args.policy}
    for version, values in turns.items():
        row[f"{version}_cpu_ms_per_token"] = statistics.median(cpu for cpu, _ in values)
        row[f"{version}_wall_ms_per_token"] = statistics.median(wall for _, wall in values)
    row["after_over_before_cpu"] = row["after_cpu_ms_per_token"] / row["before_cpu_ms_per_token"]
    row["after_over_before_wall"] = row["after_wall_ms_per_token"] / row["before_wall_ms_per_token"]
    pairs = zip(turns["after"], turns["before"], strict=True)
    row["after_faster_rounds"] = sum(after[1] < before[1] for after, before in pairs)
    row["same_tokens"] = outputs["before"] == outputs["after"]
    row["turns"] = turns
    print(json.dumps({k: v for k, v in row.items() if k != "turns"}, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
