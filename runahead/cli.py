"""``runahead`` command line. It only builds configs and calls the public API.

Bad arguments get one line naming the option and exit code 2 (checked by argparse's types in
:mod:`runahead.cli_args`, or by the configs the commands build); a missing optional package gets one
line naming the extra to install. Long work shows a progress bar on a terminal; log lines go
through structlog (``--log-json`` for JSON).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runahead import cli_args as a

DTYPES = ["auto", "float32", "bfloat16", "float16"]
"""Compute and cache dtypes of the torch backend (``auto``: bfloat16 on CUDA; on CPU the faster of
float32 and bfloat16 at the model's shapes, timed once at start: :mod:`runahead.backends.dtypes`)."""

DTYPE_HELP = (
    "compute and cache dtype (auto: bfloat16 on CUDA; on CPU the faster of float32 and bfloat16, timed)"
)

MODEL_HELP = "a Hugging Face folder, or a model built once under $RUNAHEAD_CACHE: 'small' or 'medium'"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; every option has a help line (with its default, where it has one)."""
    from runahead import __version__
    from runahead.engine import DEFAULT_MAX_WAITING

    common = a.Parser(add_help=False)
    common.add_argument("--log-json", action="store_true", help="log lines as JSON objects (one per line)")
    common.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log threshold",
    )
    parser = a.Parser(
        prog="runahead",
        description="Runahead inference for offloaded MoE models.",
        formatter_class=a.HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"runahead {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common], formatter_class=a.HelpFormatter, **kwargs)

    _add_bench(
        command("bench", help="compare scheduling policies side by side", description=BENCH_DESCRIPTION)
    )
    demo = command(
        "demo",
        help="the embedded default: a small random model served under sync and runahead, side by side",
        description="Builds (once, cached) a small random Qwen3-MoE, then decodes several requests at once "
        "with its experts read from disk (O_DIRECT) into a cache holding a fraction of them, under sync "
        "and runahead, and prints the comparison: the ratio of their tokens/s over a few repeats. "
        "No download.",
    )
    demo.add_argument("--concurrency", type=a.integer(1), default=8, help="requests decoding at once")
    demo.add_argument("--tokens", type=a.integer(1), default=32, help="decode steps measured per request")
    demo.add_argument("--cache-fraction", type=a.FRACTION, default=0.3, help="share of the experts cached")
    demo.add_argument("--store", default="disk", choices=["disk", "host"], help="where experts are read from")
    demo.add_argument("--backend", default="torch", choices=["torch", "mlx"], help="the compute backend")
    demo.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    demo.add_argument(
        "--repeats",
        type=a.integer(1),
        default=3,
        help="sync/runahead pairs run; the ratio's median and range",
    )
    serve = command("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model", help=MODEL_HELP)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (loopback: this machine only)"
    )
    serve.add_argument("--port", type=a.integer(0, 65535), default=8000, help="TCP port (0: any free port)")
    serve.add_argument("--model-name", help="the name clients ask for (default: the folder's name)")
    _add_engine_options(serve)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("RUNAHEAD_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every request but /health (default: $RUNAHEAD_API_KEY)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=a.integer(1),
        default=8 << 20,
        help="larger request bodies get 413 (default: 8 MiB)",
    )
    serve.add_argument(
        "--max-waiting",
        type=a.integer(0),
        default=DEFAULT_MAX_WAITING,
        help="requests that may wait beyond the running ones; more get 429 with Retry-After",
    )
    serve.add_argument(
        "--request-timeout",
        type=a.number(0.0, open_low=True),
        default=None,
        help="seconds a request may run before it is cancelled with 504 (default: no limit)",
    )
    gen = command("generate", help="generate with a real model (torch or mlx backend)")
    gen.add_argument("model", help=MODEL_HELP)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    source.add_argument("--prompt-ids", type=a.token_ids, help="prompt token ids: 1,2,3")
    gen.add_argument("--max-tokens", type=a.integer(1), default=32, help="tokens to generate per request")
    gen.add_argument("--temperature", type=a.number(0.0, 100.0), default=0.0, help="0 samples greedily")
    gen.add_argument("--top-p", type=a.number(0.0, 1.0, open_low=True), default=1.0, help="nucleus mass kept")
    gen.add_argument("--top-k", type=a.integer(0), default=0, help="most likely tokens kept (0: all)")
    gen.add_argument("--seed", type=int, default=None, help="copy i samples with seed + i (default: random)")
    _add_engine_options(gen)
    gen.add_argument("--concurrency", type=a.integer(1), default=1, help="copies of the prompt run at once")
    gen.add_argument("--step-barrier", choices=["on", "off"], default="on", help="one step at a time")
    gen.add_argument("--record-trace", type=Path, help="write the experts each request selected (.npz)")
    gen.add_argument("--json", action="store_true", help="one JSON object per request")
    gen.add_argument("--timeline", type=Path, help="write the run as a Chrome-trace / Perfetto JSON file")
    gen.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute each request on its own, so its tokens never depend on what it is batched with",
    )
    convert = command(
        "convert",
        help="write a Hugging Face MoE folder as a GGUF file (llama.cpp's layout)",
        description="Experts and the other matrices as --type (Q4_0: the paper's format), norms and "
        "routers in F32; names, metadata, tokenizer and chat template as llama.cpp's convert_hf_to_gguf.py "
        "writes them.",
    )
    convert.add_argument("model", type=Path, help="a Hugging Face model folder")
    convert.add_argument("out", type=Path, help="the .gguf file to write")
    convert.add_argument("--type", default="q4_0", choices=["q4_0", "q8_0", "f16", "f32"], help="matrix type")
    convert.add_argument("--split-max-tensors", type=a.integer(0), default=0, help="tensors per split file")
    convert.add_argument("--split-max-size", type=a.integer(0), default=0, help="bytes per split file")
    convert.add_argument("--no-vocab", action="store_true", help="write no tokenizer (weights alone)")
    return parser


BENCH_DESCRIPTION = (
    "Run every (policy, concurrency, cache fraction, barrier) point and print a table. Policies: runahead, "
    "sync, prefetch-gate, prefetch-history, runahead+prefetch, with knobs as "
    "NAME/compute=fifo/fetch=global-srtf/grouping=static:2:2:2."
)


def _add_bench(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "what",
        nargs="?",
        choices=["paper"],
        help="'paper': regenerate the paper's figures on the sim (PNG + JSONL per figure) into --out",
    )
    bench.add_argument("--quick", action="store_true", help="paper: the short version (under 3 minutes)")
    bench.add_argument(
        "--tiny", action="store_true", help="paper: a check that it runs (seconds; the tests')"
    )
    bench.add_argument("--workers", type=a.integer(1), default=2, help="paper: parallel worker processes")
    bench.add_argument("--no-resume", action="store_true", help="paper: recompute points already in --out")
    bench.add_argument(
        "--backend",
        default="sim",
        choices=["sim", "torch", "mlx"],
        help="virtual time, or a real model (torch, or MLX: Apple silicon / MLX's CPU build)",
    )
    bench.add_argument(
        "--model",
        default=None,
        help="sim: a model spec name or TOML path (default: the --trace's recorded model, else "
        "qwen3.6-35b-a3b); torch: " + MODEL_HELP + " (default: medium, ~3 GB)",
    )
    bench.add_argument(
        "--store", default="disk", choices=["disk", "host"], help="torch: where experts are read from"
    )
    bench.add_argument("--device", type=a.device, default="cpu", help="torch: cpu, cuda or cuda:N")
    bench.add_argument("--dtype", default="auto", choices=DTYPES, help="torch: " + DTYPE_HELP)
    bench.add_argument("--profile", default="thor", help="sim: hardware profile name or TOML path")
    bench.add_argument(
        "--policy",
        type=a.listed(a.policy),
        default=["sync", "prefetch-gate", "prefetch-history", "runahead"],
        help="comma-separated policy specs",
    )
    bench.add_argument(
        "--concurrency", type=a.listed(a.integer(1)), default=[2, 4, 8, 16], help="requests at once"
    )
    bench.add_argument(
        "--cache-fraction",
        type=a.listed(a.FRACTION),
        default=[0.3],
        help="share of all routed experts cached",
    )
    bench.add_argument("--steps", type=a.integer(1), default=256, help="decode steps measured per request")
    bench.add_argument("--workload", default="chat", choices=["chat", "agentic"], help="sim: the request mix")
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing and the prompts")
    bench.add_argument(
        "--step-barrier", type=a.barriers, default=[True], metavar="on|off|on,off", help="one step at a time"
    )
    bench.add_argument("--eviction", default="lfu", choices=["lfu", "lru"], help="cache eviction policy")
    bench.add_argument(
        "--warmup-steps",
        type=a.integer(0),
        default=8,
        help="steps run before measuring (sim: replayed into the cache, what the prompt left there)",
    )
    bench.add_argument(
        "--zero-cost",
        action="store_true",
        help="sim: charge no time for compute or reads, to measure the runtime's own overhead per job",
    )
    bench.add_argument(
        "--charge-overhead",
        action="store_true",
        help="sim: advance virtual time by the CPU time the runtime spends on its event loop "
        "(the default charges only the cost model; charged runs vary slightly between runs)",
    )
    bench.add_argument(
        "--trace",
        type=Path,
        help="sim: a recorded routing trace (.npz, see generate --record-trace) instead of the synthetic one",
    )
    bench.add_argument("--out", type=Path, help="write DIR/results.jsonl, one row per point (paper: needed)")
    bench.add_argument("--quiet", action="store_true", help="print only the final table")
    bench.add_argument(
        "--timeline",
        type=Path,
        help="write each point's run as a Chrome-trace / Perfetto JSON (FILE, or FILE-<i>.json for several)",
    )


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="torch", choices=["torch", "mlx"], help="the compute backend")
    parser.add_argument(
        "--device", type=a.device, default="cpu", help="torch: cpu, cuda or cuda:N; mlx: cpu, gpu or auto"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help=DTYPE_HELP,
    )
    parser.add_argument("--policy", type=a.policy, default="runahead", help="scheduling policy spec")
    parser.add_argument("--cache-fraction", type=a.FRACTION, default=0.3, help="share of the experts cached")
    parser.add_argument(
        "--store", default="disk", choices=["disk", "host"], help="where experts are read from"
    )


def run_generate(args: argparse.Namespace) -> int:
    import json

    from runahead.generate import generate
    from runahead.policy import check_concurrency
    from runahead.sampling import SamplingParams
    from runahead.tokenizer import has_tokenizer
    from runahead.torchbench import resolve_model

    check_concurrency(args.policy, args.concurrency)
    a.check_device(args.device)
    model = resolve_model(args.model)
    if args.prompt is not None and not has_tokenizer(model):
        raise ValueError(f"{args.model} has no tokenizer, so it cannot take --prompt: give --prompt-ids")
    eos = _eos_token(model)
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=frozenset() if eos is None else frozenset({eos}),
    )
    streaming = args.concurrency == 1 and not args.json and has_tokenizer(model)
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
        backend=args.backend,
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
    import contextlib

    from runahead import loops
    from runahead.server import EngineStopped, ServerConfig, serve
    from runahead.torchbench import resolve_model

    a.check_device(args.device)
    config = ServerConfig(
        api_key=args.api_key, max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout
    )
    try:
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal after shutting down
            loops.run(
                serve(
                    resolve_model(args.model),
                    host=args.host,
                    port=args.port,
                    model_name=args.model_name,
                    log_json=args.log_json,
                    log_level=args.log_level,
                    config=config,
                    backend=args.backend,
                    device=args.device,
                    dtype=args.dtype,
                    policy=args.policy,
                    cache_fraction=args.cache_fraction,
                    store=args.store,
                    max_waiting=args.max_waiting,
                )
            )
    except EngineStopped as stopped:  # a supervisor (docker, systemd) restarts on a non-zero exit
        print(f"runahead: {stopped}", file=sys.stderr)
        return 1
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from runahead.models.gguf_convert import convert

    files = convert(
        args.model,
        args.out,
        args.type,
        split_max_tensors=args.split_max_tensors,
        split_max_size=args.split_max_size,
        vocab=not args.no_vocab,
    )
    for file in files:
        print(f"{file}  {file.stat().st_size} bytes")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    import statistics

    from runahead.bench import format_table
    from runahead.demo import run_pairs

    rows, ratios = run_pairs(
        args.concurrency,
        args.tokens,
        args.cache_fraction,
        args.store,
        args.repeats,
        backend=args.backend,
        dtype=args.dtype,
    )
    print(format_table(rows[-2:]))
    same = len({row["token_digest"] for row in rows}) == 1
    low, median, high = min(ratios), statistics.median(ratios), max(ratios)
    print(
        f"\nrunahead / sync tokens/s over {len(ratios)} repeat(s): median {median:.2f}x "
        f"(range {low:.2f}-{high:.2f}x: " + ", ".join(f"{r:.2f}" for r in ratios) + ")"
        f"\noutputs identical under both policies in every run: {'yes' if same else 'NO'}"
    )
    return 0 if same else 1


def run_bench(args: argparse.Namespace) -> int:
    from runahead.bench import format_overhead, format_table, run_sweep, sweep
    from runahead.progress import progress_bar
    from runahead.trace import RoutingTrace

    if args.what == "paper":
        return run_paper_command(args)
    if args.backend in ("torch", "mlx"):
        if args.trace is not None:
            raise ValueError(
                f"--trace replays recorded routing on the sim backend: drop --backend {args.backend}"
            )
        return run_torch_bench(args)
    trace = RoutingTrace.load(args.trace) if args.trace else None
    model = args.model or (trace.spec.name if trace is not None and trace.spec is not None else None)
    if trace is not None and model is None:
        raise ValueError(
            f"{args.trace} carries no model spec (it was not recorded by generate): give --model"
        )
    points = sweep(
        model or "qwen3.6-35b-a3b",
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
        charge_overhead=args.charge_overhead,
    )
    with progress_bar("bench", len(points), enabled=not args.quiet) as advance:
        report = _progress(len(points), args.quiet, advance)
        rows = run_sweep(points, args.out, trace, report, timeline=args.timeline)
    print(format_table(rows))
    if args.zero_cost:
        print(format_overhead(rows))
    if args.out:
        print(f"\nwrote {args.out / 'results.jsonl'}")
    return 0


def run_paper_command(args: argparse.Namespace) -> int:
    import structlog

    from runahead.paper import run_paper
    from runahead.paper.runner import describe
    from runahead.progress import progress_bar

    if args.out is None:
        raise ValueError("runahead bench paper needs --out DIR")
    log = structlog.get_logger("runahead.paper")
    with progress_bar("paper points", None, enabled=not args.quiet) as advance:

        def report(index: int, count: int, point: Any, row: dict[str, Any]) -> None:
            advance(index)
            if not args.quiet:
                log.info(
                    "point done", done=f"{index}/{count}", point=describe(point), wall_s=row.get("wall_s")
                )

        written = run_paper(
            args.out,
            quick=args.quick,
            tiny=args.tiny,
            workers=args.workers,
            resume=not args.no_resume,
            progress=report,
        )
    print(f"wrote {len(written)} files into {args.out}")
    return 0


def run_torch_bench(args: argparse.Namespace) -> int:
    import itertools

    from runahead.bench import format_table, run_sweep
    from runahead.progress import progress_bar
    from runahead.torchbench import TorchPoint, resolve_model, run_torch_point

    a.check_device(args.device)
    model = resolve_model(args.model or "medium")
    points = [
        TorchPoint(
            model,
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
            backend=args.backend,
        )
        for concurrency, fraction, barrier, policy in itertools.product(
            args.concurrency, args.cache_fraction, args.step_barrier, args.policy
        )
    ]
    with progress_bar("bench", len(points), enabled=not args.quiet) as advance:
        report = _progress(len(points), args.quiet, advance)
        rows = run_sweep(points, args.out, progress=report, timeline=args.timeline, run=run_torch_point)
    print(format_table(rows))
    return 0


def _progress(total: int, quiet: bool, advance: Callable[[int], None]) -> Callable[[dict[str, Any]], None]:
    """A log line per finished bench point (and the bar moved on)."""
    import structlog

    log = structlog.get_logger("runahead.bench")
    done = 0

    def report(row: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        advance(done)
        if not quiet:
            log.info(
                "point done",
                done=f"{done}/{total}",
                policy=row["policy"],
                concurrency=row["concurrency"],
                cache_fraction=row["cache_fraction"],
                tokens_per_s=round(row["tokens_per_s"], 2),
                wall_s=round(row["wall_s"], 1),
            )

    return report


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "bench": run_bench,
    "convert": run_convert,
    "generate": run_generate,
    "demo": run_demo,
    "serve": run_serve,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; the exit status (2 for a bad argument)."""
    from runahead.extras import missing_extra
    from runahead.logs import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(json=args.log_json, level=args.log_level)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"runahead {args.command}: error: {error}\n")
    except ModuleNotFoundError as error:
        hint = missing_extra(error)
        if hint is None:
            raise
        parser.exit(1, f"runahead {args.command}: error: {hint}\n")


if __name__ == "__main__":
    sys.exit(main())
