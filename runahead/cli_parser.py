"""The ``runahead`` command line's parser: every command, its options, defaults and help.

:mod:`runahead.cli` runs the commands; :mod:`runahead.cli_args` holds the argument types that check
values (one line naming the option, exit code 2).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from runahead import cli_args as a
from runahead.models.layout import EXPERT_SLOTS

DTYPES = ["auto", "float32", "bfloat16", "float16"]
"""Compute and cache dtypes of the torch backend (``auto``: bfloat16 on CUDA; on CPU float32 where the
CPU kernel takes the experts as stored, else the faster of float32 and bfloat16 at the model's
shapes, timed once at start: :mod:`runahead.backends.torch_load`, :mod:`runahead.backends.dtypes`)."""

DTYPE_HELP = (
    "compute and cache dtype (auto: bfloat16 on CUDA; on CPU float32 where the CPU kernel takes the "
    "experts as stored, else the faster of float32 and bfloat16, timed)"
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
    _add_threads(demo)
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
        type=a.POSITIVE,
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
        help="compute each request on its own, so its tokens never depend on what it is batched with "
        "(float32 or bfloat16 compute on the CPU kernel already does for Qwen3-MoE, Qwen3.6 and Gemma 4; "
        "this holds on any path, slower)",
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
    bench.add_argument(
        "--expert-slots",
        default="auto",
        choices=EXPERT_SLOTS,
        help="torch: a bfloat16/float16 checkpoint's experts in the cache as stored (multiplied as stored "
        "by the CPU kernel; float32 compute on CPU) or widened to the compute dtype; auto: stored where "
        "that applies",
    )
    _add_link_cap(bench)
    _add_threads(bench)
    _add_inline_compute(bench)
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
    bench.add_argument(
        "--workload-file",
        metavar="PATH",
        help="sim: the workload's requests from a file instead of the synthetic mix: ShareGPT JSON (chat), "
        "a SWE-agent .traj file or a folder of them (agentic)",
    )
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
        "--preload",
        action="store_true",
        help="every expert that fits in the cache is loaded before the run (not counted as reads), "
        "as an engine that loaded its model at start",
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
        "(paper: at every bench point; the default charges only the cost model; charged runs "
        "vary slightly between runs)",
    )
    bench.add_argument(
        "--charge-scale",
        type=a.POSITIVE,
        default=1.0,
        metavar="X",
        help="sim, with --charge-overhead: charge X times the CPU time spent, as on a host whose cores "
        "run the runtime X times slower than this one's (a Jetson's, say; default 1)",
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
    _add_link_cap(parser)
    _add_threads(parser)
    _add_inline_compute(parser)


def _add_inline_compute(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--inline-compute",
        choices=["on", "off"],
        default="on",
        help="torch: compute a decode group on the event loop's thread while the link has nothing to "
        "read (two thread hand-offs saved; off: every group on the compute thread)",
    )


def _add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=a.threads,
        default="auto",
        metavar="N|auto",
        help="torch on CPU: intra-op compute threads (auto: every core but one, at least one: the event "
        "loop and the expert readers run beside the compute)",
    )


def _add_link_cap(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--link-gbps",
        type=a.POSITIVE,
        default=None,
        help="torch/mlx: pace expert reads to a serial link of this many GB/s (a steady stand-in for a "
        "device's link; every byte still read from the store)",
    )
    parser.add_argument(
        "--reads-in-flight",
        type=a.integer(1),
        default=None,
        metavar="N",
        help="torch/mlx: expert reads kept in flight at once (default 4; an NVMe drive may want more)",
    )
