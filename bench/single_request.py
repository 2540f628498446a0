"""Single-request decode speed with every expert resident: runahead's torch backend vs transformers.

Same model (default: the medium one), same device, one request, greedy, both warmed up first.
Ours runs in ``--dtype`` (default ``auto``: on CPU the faster of float32 and bfloat16, timed at
start); transformers' ``generate`` runs in float32 and in bfloat16 (on CUDA: in ``--dtype`` only),
so the ratio against its fastest dtype is measured in the same run. Each row also says how many of
ours' tokens equal transformers' in that dtype (greedy, from the same prompt), and at the first
difference, transformers' margin between its top two logits there (a near tie flips on rounding).
Writes OUT/results.jsonl.

    python bench/single_request.py --out DIR [--model PATH] [--device cuda] [--dtype bfloat16]
        [--peer-dtypes float32]

``--same-process`` (CPU) instead loads both once, in one process, and alternates turns (which goes
first rotates too): on a machine whose memory bandwidth moves by +-15% from minute to minute, the
paired ratio of each round and their median say more than the best of separate loads. With
``--expert-slots stored,compute`` ours runs once per way of holding the experts (bfloat16 as stored,
or widened to float32), each its own turn. It writes OUT/same_process.json.

Threads: ours computes with ``--threads`` (default ``auto``, every core but one:
:mod:`runahead.backends.threads`), transformers with ``--peer-threads`` (default: every core,
torch's own default); torch's count is set before each system's turn, so each runs as configured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from runahead.backends.threads import available_cores
from runahead.cli_args import threads as threads_arg
from runahead.medium import medium_model
from runahead.torchbench import TorchPoint, run_torch_point, slot_dtype, warm_resident

STEPS = 32
WARMUP = 4


def timed_generate(
    model: Any, prompt: list[int], new_tokens: int, device: str = "cpu", **options: Any
) -> tuple[float, Any]:
    """Seconds of one greedy ``generate`` of ``new_tokens`` after a ``WARMUP``-token warm-up call,
    and its output (``options``: more ``generate`` arguments)."""
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=WARMUP, do_sample=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **options)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start, out


def run_transformers(
    path: str, dtype: torch.dtype, prompt: list[int], device: str = "cpu", threads: int | None = None
) -> dict[str, Any]:
    """tokens/s of ``generate`` (greedy, ``WARMUP + STEPS`` tokens after a warm-up call), its tokens
    and, per step, the margin between its two largest logits (``threads``: torch's count for it)."""
    from transformers import AutoModelForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    model.generation_config.eos_token_id = None  # ours does not stop at EOS either
    total = WARMUP + STEPS
    elapsed, out = timed_generate(
        model, prompt, total, device, output_logits=True, return_dict_in_generate=True
    )
    top2 = [torch.topk(step[0].float(), 2).values for step in out.logits]
    return {
        "tokens_per_s": total / elapsed,
        "tokens": out.sequences[0, len(prompt) :].tolist(),
        "margins": [float(v[0] - v[1]) for v in top2],
    }


def same_process(
    path: str, dtype: str, peer: str, rounds: int, slots: list[str], threads: int | str, peer_threads: int
) -> dict[str, Any]:
    """Ours (one backend per ``expert_slots`` mode in ``slots``) and transformers' ``generate`` loaded
    once in this process, in turns of ``STEPS`` greedy tokens (after ``WARMUP``), the order rotating
    each round; per round each one's tokens/s and ours over transformers."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from runahead.backends.torch import TorchBackend
    from runahead.jobs import RequestSpec
    from runahead.sampling import SamplingParams

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, peer)).eval()
    reference.generation_config.eos_token_id = None
    backends = {
        f"ours-{mode}": TorchBackend.open(
            path,
            cache_fraction=1.0,
            dtype=dtype,
            expert_slots=mode,  # type: ignore[arg-type]
            threads=threads,
        )
        for mode in slots
    }
    prompt = [5]

    def ours(backend: TorchBackend) -> tuple[float, list[int]]:
        torch.set_num_threads(backend.compute_threads)

        async def go() -> tuple[float, list[int]]:
            runtime = await warm_resident(backend, "runahead", prompt, WARMUP)
            start = time.perf_counter()
            spec = RequestSpec(1, STEPS, prompt=tuple(prompt), sampling=SamplingParams(max_tokens=STEPS))
            tokens = await runtime.run([spec])
            return STEPS / (time.perf_counter() - start), tokens[1]

        return asyncio.run(go())

    def theirs() -> tuple[float, list[int]]:
        torch.set_num_threads(peer_threads)
        elapsed, out = timed_generate(reference, prompt, STEPS)
        return STEPS / elapsed, out[0, len(prompt) :].tolist()

    names = [*backends, "transformers"]
    turns: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {}
    try:
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                speed, tokens[name] = theirs() if name == "transformers" else ours(backends[name])
                turns[name].append(speed)
            print(f"round {round_}: " + ", ".join(f"{n} {turns[n][-1]:.2f} tok/s" for n in names), flush=True)
    finally:
        for backend in backends.values():
            backend.close()
    result: dict[str, Any] = {
        "compute_dtype": {name: b.compute_dtype for name, b in backends.items()},
        "slot_dtype": {name: slot_dtype(b) for name, b in backends.items()},
        "peer_dtype": peer,
        "threads": {name: b.compute_threads for name, b in backends.items()} | {"transformers": peer_threads},
        "rounds": rounds,
        "tokens_per_s": turns,
        "tokens_compared": STEPS,
    }
    for name in backends:
        ratios = [a / b for a, b in zip(turns[name], turns["transformers"], strict=True)]
        result[name] = {
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "rounds_ours_faster": sum(r > 1 for r in ratios),
            "tokens_equal": sum(a == b for a, b in zip(tokens[name], tokens["transformers"], strict=True)),
        }
    return result


def agreement(ours: list[int], theirs: dict[str, Any]) -> dict[str, Any]:
    """How many tokens agree, how many lead in agreement, and transformers' margin where they first part."""
    same = sum(a == b for a, b in zip(ours, theirs["tokens"], strict=False))
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs["tokens"], strict=False)) if a != b), None)
    margin = theirs["margins"][first] if first is not None else None
    return {
        "equal_tokens": same,
        "leading_equal": first if first is not None else len(ours),
        "margin_at_split": margin,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", help="a model folder (default: the medium model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all systems in turn; best of each")
    parser.add_argument(
        "--peer-dtypes",
        default="float32,bfloat16",
        help="transformers' dtypes on CPU (comma-separated; a CPU without bf16 instructions runs bf16 "
        "generate ~100x slower than float32, so there 'float32' alone is its fastest)",
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="CPU: both loaded once in one process, alternating turns; paired ratios (see above)",
    )
    parser.add_argument(
        "--expert-slots",
        default="auto",
        help="with --same-process: ours once per mode given (comma-separated: auto, stored, compute; "
        "TorchBackend.open's expert_slots), each its own turn",
    )
    parser.add_argument("--threads", type=threads_arg, default="auto", help="ours: compute threads (or auto)")
    parser.add_argument(
        "--peer-threads",
        type=int,
        default=available_cores(),
        help="transformers: torch's threads (default: every core)",
    )
    args = parser.parse_args()
    path = args.model or str(medium_model())
    if args.same_process:
        peer = args.peer_dtypes.split(",")[0]
        result = same_process(
            path, args.dtype, peer, args.rounds, args.expert_slots.split(","), args.threads, args.peer_threads
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "same_process.json").write_text(json.dumps(result, indent=1) + "\n")
        for name in result["compute_dtype"]:
            row = result[name]
            print(
                f"{name} ({result['slot_dtype'][name]} slots) vs transformers ({peer}), {result['rounds']} "
                f"rounds in one process: median ratio {row['median_ratio']:.3f}, ours faster in "
                f"{row['rounds_ours_faster']}; tokens equal {row['tokens_equal']}/{result['tokens_compared']}"
            )
        return
    point = TorchPoint(
        path,
        "runahead",
        1,
        1.0,
        STEPS,
        store="disk",  # every expert preloaded into the cache: nothing is read while decoding
        device=args.device,
        warmup_steps=WARMUP,
        preload=True,
        dtype=args.dtype,
        threads=args.threads,
    )
    # Rounds of every system in turn, best tokens/s of each: on a shared machine a load spike hits
    # one system's run, not all of one system's runs.
    peers = [args.dtype] if args.device != "cpu" else args.peer_dtypes.split(",")
    ours_runs: list[dict[str, Any]] = []
    peer_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
    for _ in range(args.rounds):
        ours_runs.append(run_torch_point(point))
        for name in peers:
            dtype = getattr(torch, ours_runs[0]["compute_dtype"] if name == "auto" else name)
            prompt = ours_runs[0]["prompt_0"]
            peer_runs[name].append(run_transformers(path, dtype, prompt, args.device, args.peer_threads))
    ours = max(ours_runs, key=lambda r: r["tokens_per_s"])
    rows: list[dict[str, Any]] = [
        {
            "system": f"runahead torch backend ({ours['compute_dtype']} on {args.device}, all resident)",
            "tokens_per_s": ours["tokens_per_s"],
            "runs": [r["tokens_per_s"] for r in ours_runs],
        }
    ]
    for name, runs in peer_runs.items():
        theirs = max(runs, key=lambda r: r["tokens_per_s"])
        rows.append(
            {
                "system": f"transformers generate ({name} on {args.device})",
                "tokens_per_s": theirs["tokens_per_s"],
                "runs": [r["tokens_per_s"] for r in runs],
                **agreement(ours["tokens_0"], theirs),
                "tokens_compared": len(ours["tokens_0"]),
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    fastest = max(row["tokens_per_s"] for row in rows[1:])
    with (args.out / "results.jsonl").open("w") as sink:
        for row in rows:
            row["runahead_vs_this"] = rows[0]["tokens_per_s"] / row["tokens_per_s"]
            sink.write(json.dumps(row) + "\n")
            extra = ""
            if "equal_tokens" in row:
                extra = (
                    f"  tokens equal {row['equal_tokens']}/{row['tokens_compared']},"
                    f" first split at {row['leading_equal']} (margin {row['margin_at_split']})"
                )
            speed = f"{row['tokens_per_s']:7.2f} tok/s  runahead is {row['runahead_vs_this']:.2f}x"
            print(f"{row['system']:<64} {speed}{extra}")
    print(f"runahead vs transformers' fastest dtype: {rows[0]['tokens_per_s'] / fastest:.2f}x")


if __name__ == "__main__":
    main()
