"""The mlx backend's benchmark (issue 9): a medium random Qwen3-MoE in mlx-lm's 4-bit format,
experts read from disk (O_DIRECT), on this machine's MLX device; ratios side by side in one run.

    python bench/mlx_medium.py --out bench/results/mlx-medium [--steps 16] [--concurrency 2,4,8]

1. ``runahead`` vs ``sync`` vs ``prefetch-gate`` at each concurrency with 30% of the experts cached
   (``results.jsonl``; ``bench/summarize.py`` prints the overlap limit and share of the gain).
2. Single-request decode with every expert resident (host store, preloaded) against mlx-lm's own
   ``stream_generate`` on the same checkpoint, in pairs run back to back (``single.jsonl``).

The model is built once under ``$RUNAHEAD_CACHE`` (float32 from transformers, then
``mlx_lm.convert`` to 4 bits, group 64, scales in float32): sized so the whole run takes minutes on
MLX's CPU build (whose matrix products are ~40x slower than torch's here); ``--model`` takes any
other mlx-lm folder (a Mac: a real mlx-community checkpoint).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from runahead.medium import MEDIUM_CONFIG, build_cached, cache_dir
from runahead.metrics import overlap_limit
from runahead.torchbench import TorchPoint, run_torch_point

MLX_MEDIUM: dict[str, Any] = {
    **MEDIUM_CONFIG,
    "num_hidden_layers": 8,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 8192,
}
"""The medium model's shapes (hidden 1024, experts 512 wide) with 8 layers x 32 experts, top-4, and
a vocabulary of 8192: 403 M expert weights, 226 MB at 4 bits."""


def mlx_medium_model() -> Path:
    """The 4-bit mlx-lm folder of the medium MLX model, building and converting it once."""
    target = cache_dir() / "mlx-medium-qwen3-moe-4bit"
    if (target / "config.json").exists():
        return target
    source = build_cached("mlx-medium-qwen3-moe", MLX_MEDIUM, "float32")
    config_file = source / "config.json"
    config = json.loads(config_file.read_text())  # mlx-lm reads only the hub's spelling
    config.setdefault("num_experts", config.get("num_local_experts"))
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    config_file.write_text(json.dumps(config, indent=2))
    from mlx_lm import convert

    convert(str(source), str(target), quantize=True, q_group_size=64, q_bits=4, dtype="float32")
    return target


def mlx_lm_tokens_per_s(path: str, steps: int) -> float:
    """mlx-lm's own greedy decode speed on ``path`` (one request, one prompt token), after a warm-up."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(path)
    sampler = make_sampler(temp=0.0)
    for _ in stream_generate(model, tokenizer, [11], max_tokens=4, sampler=sampler):
        pass
    *_, last = stream_generate(model, tokenizer, [11], max_tokens=steps, sampler=sampler)
    mx.clear_cache()
    return float(last.generation_tps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", help="an mlx-lm folder (default: the medium MLX model, built once)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured per request")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--concurrency", default="2,4,8")
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--device", default="cpu", help="cpu, gpu or auto")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every point (the machine is shared)")
    parser.add_argument("--skip-policies", action="store_true", help="only the single-request comparison")
    args = parser.parse_args()
    path = args.model or str(mlx_medium_model())
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_policies:
        policies = ["sync", "prefetch-gate", "runahead"]
        with (args.out / "results.jsonl").open("w") as rows:
            for repeat in range(args.repeats):
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    order = policies[repeat % 3 :] + policies[: repeat % 3]  # rotate: no policy always first
                    for policy in order:
                        point = TorchPoint(
                            path, policy, concurrency, args.cache_fraction, args.steps, store="disk",
                            device=args.device, warmup_steps=args.warmup_steps, backend="mlx", dtype="auto",
                        )  # fmt: skip
                        row = {**run_torch_point(point), "repeat": repeat}
                        rows.write(json.dumps(row) + "\n")
                        rows.flush()
                        print(
                            f"[{repeat}] {policy:>14} x{concurrency}: {row['tokens_per_s']:7.2f} tok/s, "
                            f"compute {row['compute_s']:.3f} s, fetch {row['fetch_s']:.3f} s per step, "
                            f"overlap {row['overlap_fraction']:.2f}, direct I/O {row['direct_io']}",
                            flush=True,
                        )
    single = single_request(path, args.device, args.repeats)
    (args.out / "single.jsonl").write_text("".join(json.dumps(r) + "\n" for r in single))
    for r in single:
        print(f"[{r['repeat']}] {r['system']:<45} {r['tokens_per_s']:7.2f} tok/s")
    ratios = [
        ours["tokens_per_s"] / theirs["tokens_per_s"]
        for ours, theirs in zip(single[::2], single[1::2], strict=True)
    ]
    print("runahead / mlx-lm, each pair: " + ", ".join(f"{r:.2f}" for r in ratios))
    if not args.skip_policies:
        print(report([json.loads(line) for line in (args.out / "results.jsonl").read_text().splitlines()]))


def single_request(path: str, device: str, repeats: int, steps: int = 32) -> list[dict[str, Any]]:
    """Single-request greedy decode, every expert resident (host store, preloaded), against mlx-lm's
    ``stream_generate`` on the same folder: ``repeats`` pairs run back to back (ours, then theirs)."""
    rows = []
    for repeat in range(repeats):
        resident = TorchPoint(
            path, "sync", 1, 1.0, steps, store="host", device=device, warmup_steps=4,
            preload=True, backend="mlx", dtype="auto",
        )  # fmt: skip
        ours = run_torch_point(resident)["tokens_per_s"]
        theirs = mlx_lm_tokens_per_s(path, steps)
        rows.append(
            {"system": "runahead mlx backend (all experts resident)", "tokens_per_s": ours, "repeat": repeat}
        )
        rows.append({"system": "mlx_lm stream_generate", "tokens_per_s": theirs, "repeat": repeat})
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    """Per concurrency: median tokens/s of each policy over the repeats; runahead / sync and
    prefetch-gate / sync as the median (and range) of the ratios within each repeat (the machine is
    shared: only runs made back to back compare); the overlap limit (compute + fetch) /
    max(compute, fetch) of sync's own runs and the share of it runahead reaches, (x - 1) / (limit - 1);
    sync's compute over fetch; each policy's compute seconds per step (medians)."""
    from statistics import median

    def spread(values: list[float]) -> str:
        return f"{median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    lines = [
        f"{'conc':>4} {'sync':>6} {'pf-gate':>7} {'runahead':>8} {'runahead/sync':>17} {'pf-gate/sync':>17} "
        f"{'limit':>5} {'of gain':>7} {'c/f':>5} {'compute s/step s|p|r':>21}"
    ]
    policies = ("sync", "prefetch-gate", "runahead")
    notes: list[str] = []
    for concurrency in sorted({r["concurrency"] for r in rows}):
        mine = [r for r in rows if r["concurrency"] == concurrency]
        by = {p: [r for r in mine if r["policy"] == p] for p in policies}
        tps = {p: median(r["tokens_per_s"] for r in rs) for p, rs in by.items()}
        repeats = sorted({r["repeat"] for r in mine})
        pairs = {
            p: [
                next(r for r in by[p] if r["repeat"] == i)["tokens_per_s"]
                / next(r for r in by["sync"] if r["repeat"] == i)["tokens_per_s"]
                for i in repeats
            ]
            for p in ("runahead", "prefetch-gate")
        }
        compute = {p: median(r["compute_s"] for r in rs) for p, rs in by.items()}
        fetch = median(r["fetch_s"] for r in by["sync"])
        limit = overlap_limit(compute["sync"], fetch)
        share = (median(pairs["runahead"]) - 1) / (limit - 1) if limit > 1 else float("nan")
        fetches = {p: median(r["fetches_per_step"] for r in rs) for p, rs in by.items()}
        prefetched = sum(r["prefetches"] for r in by["prefetch-gate"])
        wasted = sum(r["wasted_prefetches"] for r in by["prefetch-gate"]) / prefetched if prefetched else 0.0
        same = len({r["token_digest"] for r in mine}) == 1
        notes.append(
            f"{concurrency:>4}: fetches per step sync {fetches['sync']:.0f}, prefetch-gate "
            f"{fetches['prefetch-gate']:.0f} ({wasted:.0%} of its prefetches unused), runahead "
            f"{fetches['runahead']:.0f}; mean group size runahead "
            f"{median(r['mean_group_size'] for r in by['runahead']):.2f}; the same tokens under every "
            f"policy and repeat: {'yes' if same else 'NO'}"
        )
        lines.append(
            f"{concurrency:>4} {tps['sync']:6.2f} {tps['prefetch-gate']:7.2f} {tps['runahead']:8.2f} "
            f"{spread(pairs['runahead']):>17} {spread(pairs['prefetch-gate']):>17} {limit:5.2f} {share:7.0%} "
            f"{compute['sync'] / fetch:5.2f} {compute['sync']:7.2f}|{compute['prefetch-gate']:.2f}|"
            f"{compute['runahead']:.2f}"
        )
    return "\n".join(lines + notes)


if __name__ == "__main__":
    main()
