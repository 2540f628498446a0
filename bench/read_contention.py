"""Does reading experts slow the compute on this machine? (issue 11: the torch CPU path)

Runahead overlaps the link with compute; the overlap limit assumes the two do not slow each other.
On a GPU the link is DMA; on this project's 2-core CPU sandbox the store's reads (O_DIRECT into a
buffer, then the copy into the slot, widened to the compute dtype) run on the same cores as the
matrix products. This times one request's tokens with every expert resident, in turns: alone, and
with the store reading random experts beside it (``--readers`` reads in flight, each into a scratch
slot, through the backend's own store: the runtime's read path), round after round, alternating
which goes first. Per turn: the compute's wall and CPU time per token (the backend's ``_compute``
calls), and the reads per second.

    python bench/read_contention.py --rounds 6 --out bench/results/torch-medium-read-contention
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from runahead.backends.torch import TorchBackend
from runahead.jobs import Group, JobResult, RequestSpec
from runahead.medium import medium_model
from runahead.sampling import SamplingParams
from runahead.torchbench import warm_resident


class Reader:
    """Reads random experts through ``backend.store`` on a thread of its own until stopped."""

    def __init__(self, backend: TorchBackend, readers: int, seed: int = 0) -> None:
        self.backend, self.readers = backend, readers
        self.random = random.Random(seed)
        self.reads = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Reader:
        self._thread = threading.Thread(target=asyncio.run, args=(self._read(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    async def _read(self) -> None:
        config = self.backend.model.config
        scratch = [torch.empty_like(self.backend.slots.slot(0)) for _ in range(self.readers)]

        async def worker(slot: torch.Tensor) -> None:
            while not self._stop.is_set():
                layer = self.random.randrange(config.num_layers)
                expert = self.random.randrange(config.num_experts)
                await self.backend.store.read_into(layer, expert, slot)
                self.reads += 1

        await asyncio.gather(*(worker(slot) for slot in scratch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--readers", type=int, default=2, help="reads in flight beside the compute")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    backend = TorchBackend.open(str(medium_model()), cache_fraction=1.0, dtype=args.dtype)
    spent = [0.0, 0.0]  # the compute's wall and CPU seconds
    compute = TorchBackend._compute

    def timed(self: TorchBackend, group: Group) -> list[JobResult]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return compute(self, group)
        finally:
            spent[0] += time.perf_counter() - wall
            spent[1] += time.thread_time() - cpu

    TorchBackend._compute = timed  # type: ignore[method-assign]

    def turn(reading: bool) -> dict[str, float]:
        async def go() -> float:
            runtime = await warm_resident(backend, "sync")
            spent[:] = [0.0, 0.0]
            start = time.perf_counter()
            spec = RequestSpec(1, args.tokens, prompt=(5,), sampling=SamplingParams(max_tokens=args.tokens))
            await runtime.run([spec])
            return time.perf_counter() - start

        if not reading:
            wall = asyncio.run(go())
            reads = 0
        else:
            with Reader(backend, args.readers) as reader:
                wall = asyncio.run(go())
                reads = reader.reads
        return {
            "compute_ms": spent[0] / args.tokens * 1e3,
            "compute_cpu_ms": spent[1] / args.tokens * 1e3,
            "token_ms": wall / args.tokens * 1e3,
            "reads_per_s": reads / wall,
        }

    turns: dict[str, list[dict[str, float]]] = {"alone": [], "reading": []}
    try:
        for round_ in range(args.rounds):
            for name in ("alone", "reading") if round_ % 2 == 0 else ("reading", "alone"):
                turns[name].append(turn(name == "reading"))
            print(
                round_,
                {name: {k: round(v, 1) for k, v in t[-1].items()} for name, t in turns.items()},
                flush=True,
            )
    finally:
        backend.close()
    row: dict[str, Any] = {"rounds": args.rounds, "tokens": args.tokens, "readers": args.readers}
    for name, values in turns.items():
        for key in values[0]:
            row[f"{name}_{key}"] = statistics.median(v[key] for v in values)
    ratios = [
        r["compute_ms"] / a["compute_ms"] for a, r in zip(turns["alone"], turns["reading"], strict=True)
    ]
    row["compute_reading_over_alone"] = statistics.median(ratios)
    row["ratios"] = ratios
    print(json.dumps(row, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({**row, "turns": turns}, indent=1) + "\n")


if __name__ == "__main__":
    main()
