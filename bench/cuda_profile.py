"""Where a group's time goes on the torch backend's CUDA path: the compute thread's wall and CPU time a
group, its Python hot spots (cProfile in the compute thread), torch's op and CUDA-API table
(torch.profiler) and every call site that synchronises the device inside a group (torch's sync debug
mode, "warn"). One request with every expert resident, then ``--concurrency`` requests from the host
store at 30% cache; a few knobs are timed side by side (switch interval, torch's CPU threads).

    python bench/cuda_profile.py --model DIR [--tokens 24] [--concurrency 8] [--out DIR]

Prints everything; with ``--out`` also writes ``profile.json`` (the timings) and the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import json
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from runahead.backends.torch import TorchBackend
from runahead.jobs import RequestSpec
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams
from runahead.torchbench import warm_resident


class Probe:
    """Wraps a backend's ``_compute`` (it runs on the compute thread): per group wall and thread CPU
    time; optionally a cProfile of the thread's calls and the sites of device synchronisations."""

    def __init__(self, backend: TorchBackend) -> None:
        self.inner = backend._compute
        backend._compute = self  # type: ignore[method-assign]
        self.reset()

    def reset(self, profile: bool = False, syncs: bool = False) -> None:
        self.groups, self.jobs, self.wall, self.cpu = 0, 0, 0.0, 0.0
        self.profile = cProfile.Profile() if profile else None
        self.syncs: collections.Counter[str] | None = collections.Counter() if syncs else None

    def __call__(self, group: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        if self.profile is not None:
            self.profile.enable()
        try:
            if self.syncs is None:
                return self.inner(group)
            return self._watched(group)
        finally:
            if self.profile is not None:
                self.profile.disable()
            self.wall += time.perf_counter() - wall
            self.cpu += time.thread_time() - cpu
            self.groups += 1
            self.jobs += len(group.jobs)

    def _watched(self, group: Any) -> Any:
        found = self.syncs
        assert found is not None

        def record(message: Any, *args: Any, **kwargs: Any) -> None:
            frames = [f for f in traceback.extract_stack()[:-1] if "runahead" in f.filename]
            found[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:][::-1])] += 1

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():  # restores the filters and showwarning on the way out
                warnings.simplefilter("always")
                warnings.showwarning = record
                return self.inner(group)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def row(self, tokens: int, seconds: float) -> dict[str, Any]:
        return {
            "tokens_per_s": tokens / seconds,
            "groups": self.groups,
            "jobs_per_group": self.jobs / max(1, self.groups),
            "group_wall_us": self.wall / max(1, self.groups) * 1e6,
            "group_cpu_us": self.cpu / max(1, self.groups) * 1e6,
            "compute_share_of_wall": self.wall / seconds,
        }


async def decode(runtime: Runtime, requests: int, tokens: int, vocab: int) -> float:
    """Seconds to decode ``tokens`` tokens for each of ``requests`` new one-token-prompt requests."""
    specs = [
        RequestSpec(100 + r, tokens, prompt=(5 + r * 7919 % (vocab - 10),), sampling=SamplingParams(max_tokens=tokens))
        for r in range(requests)
    ]
    start = time.perf_counter()
    await runtime.run(specs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def call_cost(device: str, calls: int = 2000) -> float:
    """Microseconds of host time one small torch call takes on ``device`` (an in-place add on a
    1024-element tensor, launched ``calls`` times back to back): the unit a group's calls cost."""
    x = torch.zeros(1024, device=device)
    for _ in range(100):
        x.add_(1.0)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        x.add_(1.0)
    elapsed = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def top_python(profile: cProfile.Profile, limit: int = 30) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself")
    parser.add_argument("--out", type=Path)
    asyncio.run(measure(parser.parse_args()))


async def measure(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    found: dict[str, Any] = {"device": name, "torch": torch.__version__}
    tables: dict[str, str] = {}

    backend = TorchBackend.open(args.model, cache_fraction=1.0, device=args.device, dtype=dtype, store="host")
    vocab = backend.vocab_size
    probe = Probe(backend)
    runtime = await warm_resident(backend, "sync", warmup=4)
    knobs = [
        ("as is", lambda: None),
        ("switch interval 0.1 ms", lambda: sys.setswitchinterval(1e-4)),
        ("torch CPU threads 1", lambda: torch.set_num_threads(1)),
        ("as is, again", lambda: (sys.setswitchinterval(5e-3), torch.set_num_threads(backend.compute_threads))),
    ]
    for name, apply in knobs:
        apply()
        probe.reset()
        seconds = await decode(runtime, 1, args.tokens, vocab)
        found[f"single: {name}"] = row = probe.row(args.tokens, seconds)
        print(f"single request, resident, {name}: {json.dumps(row)}", flush=True)

    found["us per torch call"] = call_cost(args.device)
    print(f"host time of one small torch call on {args.device}: {found['us per torch call']:.1f} us", flush=True)

    probe.reset(syncs=cuda)
    await decode(runtime, 2, 8, vocab)
    found["sync sites"] = dict(probe.syncs or {})
    print("device synchronisations inside groups (sync debug mode), by call site:", flush=True)
    for site, count in (probe.syncs or collections.Counter()).most_common():
        print(f"  {count:5d}  {site}")

    probe.reset(profile=True)
    seconds = await decode(runtime, 1, args.tokens, vocab)
    found["single: cProfile on"] = probe.row(args.tokens, seconds)
    assert probe.profile is not None
    tables["python-single"] = top_python(probe.profile)
    print(tables["python-single"], flush=True)

    from torch.profiler import ProfilerActivity, profile

    probe.reset()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    prof = profile(activities=activities)
    # torch's profiler records the CPU ops of the thread that starts it: the compute thread's
    pool = backend._compute_thread
    await asyncio.wrap_future(pool.submit(prof.start))
    seconds = await decode(runtime, 1, 8, vocab)
    await asyncio.wrap_future(pool.submit(prof.stop))
    found["single: torch.profiler on"] = probe.row(8, seconds)
    averages = prof.key_averages()
    tables["ops-by-cpu"] = averages.table(sort_by="self_cpu_time_total", row_limit=35)
    tables["ops-by-cuda"] = averages.table(sort_by="self_cuda_time_total" if cuda else "cpu_time_total", row_limit=20)
    print(tables["ops-by-cpu"], flush=True)
    print(tables["ops-by-cuda"], flush=True)
    backend.close()

    backend = TorchBackend.open(args.model, cache_fraction=0.3, device=args.device, dtype=dtype, store="host")
    probe = Probe(backend)
    for policy in ("sync", "runahead"):  # one backend, a runtime (an empty cache) a policy
        runtime = Runtime(backend, RuntimeConfig(cache_slots=backend.num_slots, policy=policy))
        await decode(runtime, args.concurrency, 4, vocab)  # warm-up
        probe.reset(profile=policy == "runahead")
        seconds = await decode(runtime, args.concurrency, args.tokens // 2, vocab)
        found[f"{args.concurrency} requests, host store, 30%: {policy}"] = row = probe.row(
            args.concurrency * (args.tokens // 2), seconds
        )
        print(f"{args.concurrency} requests, host store, 30%, {policy}: {json.dumps(row)}", flush=True)
        if probe.profile is not None:
            tables[f"python-{args.concurrency}"] = top_python(probe.profile, 25)
            print(tables[f"python-{args.concurrency}"], flush=True)
    backend.close()

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(found, indent=1))
        (args.out / "profile-tables.txt").write_text("\n\n".join(f"== {k}\n{v}" for k, v in tables.items()))


if __name__ == "__main__":
    main()
