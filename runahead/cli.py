"""``runahead`` command line. It only builds configs and calls the public API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


DTYPES = ["auto", "float32", "bfloat16", "float16"]
"""Compute and cache dtypes of the torch backend (``auto``: bfloat16 on CUDA, float32 on CPU)."""


def _list(kind: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    def parse(text: str) -> list[T]:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what}: expected a comma-separated list, got {text!r}"
            ) from None

    return parse


def _barriers(text: str) -> list[bool]:
    values = {"on": True, "off": False}
    try:
        return [values[part] for part in text.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"--step-barrier: expected on, off or on,off; got {text!r}"
        ) from None


def _policies(text: str) -> list[str]:
    from runahead.policy import parse_policy

    specs = [part for part in text.split(",") if part.strip()]
    try:
        for spec in specs:
            parse_policy(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return specs


def build_parser() -> argparse.ArgumentParser:
    from runahead import __version__

    parser = argparse.ArgumentParser(
        prog="runahead", description="Runahead inference for offloaded MoE models."
    )
    parser.add_argument("--version", action="version", version=f"runahead {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="compare scheduling policies side by side",
        description="Run every (policy, concurrency, cache fraction, barrier) point and print a table. "
        "Policies: runahead, sync, prefetch-gate, prefetch-history, runahead+prefetch, with knobs as "
        "NAME/compute=fifo/fetch=global-srtf/grouping=static:2:2:2.",
    )
    bench.add_argument(
        "what",
        nargs="?",
        choices=["paper"],
        help="'paper': regenerate the paper's figures on the sim (PNG + JSONL per figure) into --out",
    )
    bench.add_argument("--quick", action="store_true", help="paper: the short version (under 3 minutes)")
    bench.add_argument("--workers", type=int, default=2, help="paper: parallel worker processes")
    bench.add_argument("--no-resume", action="store_true", help="paper: recompute points already in --out")
    bench.add_argument("--backend", default="sim", choices=["sim", "torch"])
    bench.add_argument(
        "--model",
        default=None,
        help="sim: a model spec name or TOML path (default qwen3.6-35b-a3b); "
        "torch: a Hugging Face folder or 'medium' (built once, ~3 GB)",
    )
    bench.add_argument(
        "--store", default="disk", choices=["disk", "host"], help="torch: where experts come from"
    )
    bench.add_argument("--device", default="cpu", help="torch: cpu or cuda")
    bench.add_argument("--dtype", default="float32", choices=DTYPES, help="torch: compute and cache dtype")
    bench.add_argument("--profile", default="thor", help="hardware profile name or TOML path")
    bench.add_argument(
        "--policy", type=_policies, default=["sync", "prefetch-gate", "prefetch-history", "runahead"]
    )
    bench.add_argument("--concurrency", type=_list(int, "--concurrency"), default=[2, 4, 8, 16])
    bench.add_argument("--cache-fraction", type=_list(float, "--cache-fraction"), default=[0.3])
    bench.add_argument("--steps", type=int, default=256, help="decode steps per request")
    bench.add_argument("--workload", default="chat")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--step-barrier", type=_barriers, default=[True], metavar="on|off|on,off")
    bench.add_argument("--eviction", default="lfu", choices=["lfu", "lru"])
    bench.add_argument(
        "--warmup-steps",
        type=int,
        default=8,
        help="trace steps replayed into the cache before decoding (what the prompt left there)",
    )
    bench.add_argument(
        "--zero-cost",
        action="store_true",
        help="charge no time for compute or reads, to measure the runtime's own overhead per job",
    )
    bench.add_argument(
        "--trace", type=Path, help="a recorded routing trace (.npz) instead of the synthetic one"
    )
    bench.add_argument("--out", type=Path, help="write DIR/results.jsonl, one row per point")
    bench.add_argument("--quiet", action="store_true", help="print only the final table")
    bench.add_argument(
        "--timeline",
        type=Path,
        help="write each point's run as a Chrome-trace / Perfetto JSON (FILE, or FILE-<i>.json for several)",
    )
    demo = commands.add_parser(
        "demo",
        help="the embedded default: a small random model served under sync and runahead, side by side",
        description="Builds (once, cached) a small random Qwen3-MoE, then decodes several requests at once "
        "with its experts read from disk (O_DIRECT) into a cache holding a fraction of them, under sync "
        "and runahead, and prints the comparison. No download.",
    )
    demo.add_argument("--concurrency", type=int, default=8)
    demo.add_argument("--tokens", type=int, default=32, help="decode steps measured per request")
    demo.add_argument("--cache-fraction", type=float, default=0.3)
    demo.add_argument("--store", default="disk", choices=["disk", "host"])

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model", help="a Hugging Face folder, or 'medium'")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", help="the name clients ask for (default: the folder's name)")
    serve.add_argument("--backend", default="torch", choices=["torch"])
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, else float32")
    serve.add_argument("--policy", default="runahead")
    serve.add_argument("--cache-fraction", type=float, default=0.3)
    serve.add_argument("--store", default="disk", choices=["disk", "host"])
    serve.add_argument("--log-json", action="store_true", help="JSON log lines instead of the console format")
    serve.add_argument("--log-level", default="info")

    gen = commands.add_parser("generate", help="generate with a real model (torch backend)")
    gen.add_argument(
        "model", help="a Hugging Face folder (config.json + safetensors + tokenizer), or 'medium'"
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    source.add_argument("--prompt-ids", type=_list(int, "--prompt-ids"), help="prompt token ids: 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="copy i samples with seed + i")
    gen.add_argument("--policy", default="runahead")
    gen.add_argument("--backend", default="torch", choices=["torch"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, else float32")
    gen.add_argument("--store", default="disk", choices=["disk", "host"])
    gen.add_argument("--cache-fraction", type=float, default=0.3)
    gen.add_argument("--concurrency", type=int, default=1, help="copies of the prompt run at once")
    gen.add_argument("--step-barrier", choices=["on", "off"], default="on")
    gen.add_argument("--record-trace", type=Path, help="write the experts each request selected (.npz)")
    gen.add_argument("--json", action="store_true", help="one JSON object per request")
    gen.add_argument("--timeline", type=Path, help="write the run as a Chrome-trace / Perfetto JSON file")
    gen.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute each request on its own, so its tokens never depend on what it is batched with",
    )
    return parser


def run_generate(args: argparse.Namespace) -> int:
    import json

    from runahead.generate import generate
    from runahead.sampling import SamplingParams
    from runahead.torchbench import resolve_model

    _check_serving_options(args)
    model = resolve_model(args.model)
    eos = _eos_token(model)
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=frozenset() if eos is None else frozenset({eos}),
    )
    streaming = args.concurrency == 1 and not args.json
    completions = generate(
        model,
        args.prompt if args.prompt is not None else list(args.prompt_ids),
        sampling,
        policy=args.policy,
        device=args.device,
        dtype=args.dtype,
        store=args.store,
        cache_fraction=args.cache_fraction,
        concurrency=args.concurrency,
        step_barrier=args.step_barrier == "on",
        record_trace=args.record_trace,
        on_text=(lambda text: print(text, end="", flush=True)) if streaming else None,
        timeline=args.timeline,
        batch_invariant=args.batch_invariant,
    )
    if streaming:
        print()
        return 0
    for completion in completions:
        if args.json:
            row = {"request": completion.request, "token_ids": completion.token_ids, "text": completion.text}
            print(json.dumps(row))
        else:
            shown = (
                completion.text if completion.text is not None else " ".join(map(str, completion.token_ids))
            )
            print(f"[{completion.request}] {shown}")
    return 0


def _eos_token(model: str) -> int | None:
    """The end-of-sequence id the model's config names (generation stops there)."""
    from runahead.models.loader import read_config

    eos = read_config(model).get("eos_token_id")
    return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from runahead.server import serve
    from runahead.torchbench import resolve_model

    _check_serving_options(args)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal after shutting down
        asyncio.run(
            serve(
                resolve_model(args.model),
                host=args.host,
                port=args.port,
                model_name=args.model_name,
                log_json=args.log_json,
                log_level=args.log_level,
                backend=args.backend,
                device=args.device,
                dtype=args.dtype,
                policy=args.policy,
                cache_fraction=args.cache_fraction,
                store=args.store,
            )
        )
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from runahead.bench import format_table
    from runahead.medium import small_model
    from runahead.torchbench import TorchPoint, run_torch_point

    path = str(small_model())
    rows = []
    for policy in ("sync", "runahead"):
        print(
            f"decoding {args.concurrency} requests x {args.tokens} tokens under {policy} ...", file=sys.stderr
        )
        point = TorchPoint(
            path, policy, args.concurrency, args.cache_fraction, args.tokens, store=args.store, warmup_steps=4
        )
        rows.append(run_torch_point(point))
    print(format_table(rows))
    same = rows[0]["token_digest"] == rows[1]["token_digest"]
    print(
        f"\nrunahead: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x the tokens/s of sync; "
        f"outputs identical under both policies: {'yes' if same else 'NO'}"
    )
    return 0 if same else 1


def run_bench(args: argparse.Namespace) -> int:
    from runahead.bench import format_table, run_sweep, sweep
    from runahead.trace import RoutingTrace

    if args.what == "paper":
        from runahead.paper import run_paper

        if args.out is None:
            raise ValueError("runahead bench paper needs --out DIR")
        run_paper(args.out, quick=args.quick, workers=args.workers, resume=not args.no_resume)
        return 0
    if args.backend == "torch":
        return run_torch_bench(args)
    points = sweep(
        args.model or "qwen3.6-35b-a3b",
        args.profile,
        args.policy,
        args.concurrency,
        args.cache_fraction,
        args.steps,
        workload=args.workload,
        seed=args.seed,
        barriers=args.step_barrier,
        eviction=args.eviction,
        warmup_steps=args.warmup_steps,
        zero_cost=args.zero_cost,
    )
    trace = RoutingTrace.load(args.trace) if args.trace else None
    rows = run_sweep(points, args.out, trace, _progress(len(points), args.quiet), timeline=args.timeline)
    print(format_table(rows))
    if args.out:
        print(f"\nwrote {args.out / 'results.jsonl'}")
    return 0


def run_torch_bench(args: argparse.Namespace) -> int:
    import itertools

    from runahead.bench import format_table, run_sweep
    from runahead.torchbench import TorchPoint, run_torch_point

    points = [
        TorchPoint(
            args.model or "medium",
            policy,
            concurrency,
            fraction,
            args.steps,
            args.store,
            args.device,
            barrier,
            args.eviction,
            args.warmup_steps,
            args.seed,
            dtype=args.dtype,
        )
        for concurrency, fraction, barrier, policy in itertools.product(
            args.concurrency, args.cache_fraction, args.step_barrier, args.policy
        )
    ]
    progress = _progress(len(points), args.quiet)
    rows = run_sweep(points, args.out, progress=progress, timeline=args.timeline, run=run_torch_point)
    print(format_table(rows))
    return 0


def _check_serving_options(args: argparse.Namespace) -> None:
    """Refuse a bad policy or cache fraction before a model is loaded."""
    from runahead.policy import parse_policy

    parse_policy(args.policy)
    if not 0 < args.cache_fraction <= 1:
        raise ValueError(f"cache fraction must lie in (0, 1], got {args.cache_fraction}")


def _progress(total: int, quiet: bool) -> Callable[[dict[str, Any]], None]:
    """A progress line on stderr per finished bench point."""
    done = 0

    def report(row: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        if not quiet:
            print(
                f"[{done}/{total}] {row['policy']} x{row['concurrency']} cache {row['cache_fraction']:.2f}: "
                f"{row['tokens_per_s']:.2f} tok/s ({row['wall_s']:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return run_bench(args)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "demo":
            return run_demo(args)
        if args.command == "serve":
            return run_serve(args)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"runahead: error: {error}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
