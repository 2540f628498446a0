"""``runahead`` command line. It only builds configs and calls the public API; the parser (every
option, default and help) is :mod:`runahead.cli_parser`.

Bad arguments get one line naming the option and exit code 2 (checked by argparse's types in
:mod:`runahead.cli_args`, or by the configs the commands build); a missing optional package gets one
line naming the extra to install. Long work shows a progress bar on a terminal; log lines go
through structlog (``--log-json`` for JSON).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from runahead import cli_args as a
from runahead.cli_parser import build_parser


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
        link_bandwidth=a.bytes_per_second(args.link_gbps),
        threads=args.threads,
        reads_in_flight=args.reads_in_flight,
        inline_compute=args.inline_compute == "on",
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
                    link_bandwidth=a.bytes_per_second(args.link_gbps),
                    threads=args.threads,
                    reads_in_flight=args.reads_in_flight,
                    inline_compute=args.inline_compute == "on",
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
        threads=args.threads,
    )
    print(format_table(rows[-2:]))
    same = len({row["token_digest"] for row in rows}) == 1
    low, median, high = min(ratios), statistics.median(ratios), max(ratios)
    print(
        f"\nrunahead / sync tokens/s over {len(ratios)} repeat(s): median {median:.2f}x "
        f"(range {low:.2f}-{high:.2f}x: " + ", ".join(f"{r:.2f}" for r in ratios) + ")"
        f"\noutputs identical under both policies in every run: {'yes' if same else 'NO'}"
    )
    batched = [row["batched_share"] for row in rows if row["policy"] == "runahead"]
    print(
        "runahead's adaptive grouping batched every request in one group for "
        + ", ".join(f"{share:.0%}" for share in batched)
        + " of its tokens (where that measured faster than running ahead; docs/results-torch.md)"
    )
    ran = {
        policy: [r["compute_cpu_share"] for r in rows if r["policy"] == policy and r.get("compute_cpu_share")]
        for policy in ("sync", "runahead")
    }
    if all(ran.values()):
        print(
            f"the compute thread ran {statistics.median(ran['runahead']):.0%} of its time inside groups "
            f"under runahead, {statistics.median(ran['sync']):.0%} under sync (medians); the rest it waited, "
            "mostly for the GIL: the stores read on C threads that never take it, but each read that "
            'lands wakes the event loop, which does (docs/results-torch.md, "Reads on C threads")'
        )
    return 0 if same else 1


def run_bench(args: argparse.Namespace) -> int:
    from runahead.bench import format_table, run_sweep, sweep
    from runahead.bench_requests import check_workload_file
    from runahead.overhead import format_overhead
    from runahead.progress import progress_bar
    from runahead.trace import RoutingTrace

    if args.charge_scale != 1.0 and not args.charge_overhead:
        raise ValueError("--charge-scale scales what --charge-overhead charges: give both, or drop it")
    if args.what == "paper":
        return run_paper_command(args)
    if args.backend in ("torch", "mlx"):
        if args.trace is not None:
            raise ValueError(
                f"--trace replays recorded routing on the sim backend: drop --backend {args.backend}"
            )
        if args.workload_file is not None or args.workload != "chat":
            raise ValueError(
                f"--workload and --workload-file shape the sim backend's requests: drop them for --backend "
                f"{args.backend} (it decodes the chat workload)"
            )
        if args.charge_overhead:  # (a scale without it was refused above)
            raise ValueError(
                "--charge-overhead and --charge-scale charge the runtime's CPU time to the sim's virtual "
                f"clock; --backend {args.backend} runs on real time, which already pays it: drop them"
            )
        return run_torch_bench(args)
    if args.reads_in_flight is not None:
        raise ValueError(
            "--reads-in-flight sets a real store's reads; the sim's link keeps its profile's "
            "link_queue_depth: drop it, or give --backend torch or mlx"
        )
    if args.inline_compute != "on":
        raise ValueError(
            "--inline-compute sets where a real backend computes; the sim computes on virtual time: "
            "drop it, or give --backend torch"
        )
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
        workload_file=args.workload_file,
        preload=args.preload,
        charge_scale=args.charge_scale,
    )
    if args.workload_file is not None:
        count = check_workload_file(args.workload, args.workload_file)
        print(f"{args.workload} workload: {count} requests from {args.workload_file}")
    with progress_bar("bench", len(points), enabled=not args.quiet) as advance:
        report = _progress(len(points), args.quiet, advance)
        rows = run_sweep(points, args.out, trace, report, timeline=args.timeline)
    print(format_table(rows))
    if args.zero_cost:
        print(format_overhead(rows))
    if args.out:
        print(f"\nwrote {args.out / 'results.jsonl'}")
    return 0


PAPER_OPTIONS = {
    "out",
    "quick",
    "tiny",
    "workers",
    "no_resume",
    "charge_overhead",
    "charge_scale",
    "quiet",
    "log_json",
    "log_level",
}
"""What ``runahead bench paper`` takes (besides logging); any other bench option set is refused."""


def run_paper_command(args: argparse.Namespace) -> int:
    import structlog

    from runahead.paper import run_paper
    from runahead.paper.runner import describe
    from runahead.progress import progress_bar

    if args.out is None:
        raise ValueError("runahead bench paper needs --out DIR")
    defaults = vars(build_parser().parse_args(["bench", "paper"]))
    ignored = [
        "--" + name.replace("_", "-")
        for name, value in vars(args).items()
        if name not in PAPER_OPTIONS and value != defaults.get(name)
    ]
    if ignored:
        raise ValueError(
            f"runahead bench paper runs the paper's own points and ignores {', '.join(ignored)}: drop "
            f"{'it' if len(ignored) == 1 else 'them'} (or run 'runahead bench' without 'paper')"
        )
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
            charge_overhead=args.charge_overhead,
            charge_scale=args.charge_scale,
        )
    print(f"wrote {len(written)} files into {args.out}")
    return 0


def run_torch_bench(args: argparse.Namespace) -> int:
    import itertools

    from runahead.bench import format_table, run_sweep
    from runahead.progress import progress_bar
    from runahead.torchbench import TorchPoint, format_handoffs, resolve_model, run_torch_point

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
            expert_slots=args.expert_slots,
            link_gbps=args.link_gbps,
            threads=args.threads,
            preload=args.preload,
            inline_compute=args.inline_compute == "on",
            **({} if args.reads_in_flight is None else {"queue_depth": args.reads_in_flight}),
        )
        for concurrency, fraction, barrier, policy in itertools.product(
            args.concurrency, args.cache_fraction, args.step_barrier, args.policy
        )
    ]
    with progress_bar("bench", len(points), enabled=not args.quiet) as advance:
        report = _progress(len(points), args.quiet, advance)
        rows = run_sweep(points, args.out, progress=report, timeline=args.timeline, run=run_torch_point)
    print(format_table(rows))
    print(format_handoffs(rows))
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
