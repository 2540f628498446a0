"""llama.cpp as the peer on the same GGUF files (not CI: needs llama-cpp-python, FACTS.md's wheel).

``tiny``: tiny random models of each architecture, converted by ``runahead convert`` at F32, Q8_0
and Q4_0; 8 prompts, 32 greedy tokens each, from runahead (torch backend, 8 requests at once, a
cache of 8 slots) and from llama.cpp (``llama_cpp.Llama``, 2 threads) on the same file: how many
tokens agree before the first difference, and the largest logit difference on the prompt's last
position (before any token differs).

``medium FILE``: single-request greedy decode on one GGUF (e.g. the medium model converted at
Q4_0): llama.cpp (2 threads and 1, the whole file mapped) against runahead's torch backend (every
expert resident, and with 30% of them cached, experts read from the file with O_DIRECT; again all
resident with the quantized product kernel off, each expert dequantized per group; ``--twin``:
also the same model's safetensors folder, all resident), tokens/s.

``tensors [--arch A] [--top-k K]``: where the two runtimes part on the tiny ``A`` (default
qwen3_5_moe; ``K`` experts per token instead of its 2): its F32 file, the whole model at F16 and
at Q8_0, then one kind of tensor at a time requantized to Q8_0 in the F32 file; the first-position
logit gap between the runtimes and each one's move from its F32 logits; for qwen3_5_moe, the
attn_qkv file again with runahead rounding that projection's input to Q8_0 as llama.cpp's CPU dot
products do.

    PYTHONPATH=$PWD:tests python bench/gguf_peer.py tiny [--arch gemma4 ...] --out bench/results/gguf-peer
    PYTHONPATH=$PWD:tests python bench/gguf_peer.py tensors --arch qwen3_5_moe --out bench/results/gguf-peer
    PYTHONPATH=$PWD python bench/gguf_peer.py medium FILE [--twin medium] --out bench/results/gguf-peer
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

THREADS = 2  # as runahead's torch (2 intra-op threads on this machine)


def open_llama(path: Path, threads: int) -> Any:
    """llama.cpp on the GGUF ``path`` with ``threads`` threads; ``logits_all``, or ``scores`` of the
    last position read as zeros."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=256,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )


def llama_cpp_greedy(path: Path, prompt: list[int], tokens: int) -> tuple[list[int], np.ndarray[Any, Any]]:
    """llama.cpp's greedy tokens after ``prompt`` and its logits at the prompt's last position."""
    llm = open_llama(path, THREADS)
    llm.eval(prompt)
    first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out, first


TINY = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_5_moe")
"""``tiny``'s architectures by default (the table of docs/results-gguf.md; ``--arch gemma4`` too)."""


def tiny_folder(arch: str, **config: Any) -> tuple[Path, Path]:
    """A tiny random ``arch`` model llama.cpp can load, in a new temporary folder: ``(folder, HF folder)``."""
    import tempfile

    from ggufhelpers import OVERRIDES, save_gemma_tokenizer

    from runahead.tokenizer import save_tokenizer

    from modelhelpers import build_tiny_model

    folder = Path(tempfile.mkdtemp(prefix=f"gguf-peer-{arch}-"))  # the models stay out of --out
    same_width = {"linear_value_head_dim": 8} if arch == "qwen3_5_moe" else {}  # llama.cpp's qwen35
    options = {**OVERRIDES[arch], "vocab_size": 512, **same_width, **config}
    hf = build_tiny_model(arch, folder / "hf", **options)
    for stale in ("tokenizer.json", "tokenizer_config.json"):
        (hf / stale).unlink(missing_ok=True)
    (save_gemma_tokenizer if arch == "gemma4" else save_tokenizer)(hf, 512)  # llama.cpp needs one
    return folder, hf


def tiny(archs: tuple[str, ...] = TINY) -> list[dict[str, Any]]:
    from test_torch_backend import PROMPTS, TOKENS, run

    from runahead.models.gguf_convert import convert

    rows = []
    for arch in archs:
        folder, hf = tiny_folder(arch)
        for kind in ("F32", "Q8_0", "Q4_0"):
            path = convert(hf, folder / f"{kind}.gguf", kind)[0]
            ours, logits, _ = run(path, "runahead", requests=len(PROMPTS), slots=8, barrier=False)
            agree, first_diff = [], []
            for index, prompt in enumerate(PROMPTS):
                theirs, first = llama_cpp_greedy(path, prompt, TOKENS)
                same = next(
                    (k for k, (a, b) in enumerate(zip(ours[index], theirs, strict=True)) if a != b), TOKENS
                )
                agree.append(same)
                first_diff.append(float(np.abs(logits[index][0].numpy() - first).max()))
            row = {
                "arch": arch,
                "type": kind,
                "requests": len(PROMPTS),
                "tokens": TOKENS,
                "agree_before_first_difference": agree,
                "identical_requests": sum(a == TOKENS for a in agree),
                "max_logit_diff_first_position": max(first_diff),
            }
            print(json.dumps(row))
            rows.append(row)
    return rows


def first_logits(path: Path) -> tuple[list[np.ndarray[Any, Any]], list[np.ndarray[Any, Any]]]:
    """Runahead's and llama.cpp's logits at each tiny prompt's last position, on the file ``path``."""
    from test_torch_backend import PROMPTS, run

    _, logits, _ = run(path, "sync", requests=len(PROMPTS), slots=64, barrier=False)
    theirs = []
    for prompt in PROMPTS:
        llm = open_llama(path, THREADS)
        llm.eval(prompt)
        theirs.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    return [logits[i][0].numpy() for i in range(len(PROMPTS))], theirs


EMULATED = {"qwen3_5_moe": ("attn_qkv.weight", ".in_proj_qkv")}
"""Per architecture, a tensor role whose Q8_0 file is rerun with runahead rounding the input of the
projection (canonical weight name suffix) to Q8_0 blocks, as llama.cpp's CPU dot products do."""


@contextmanager
def q8_activations(suffix: str) -> Iterator[None]:
    """Within: every ``F.linear`` of a backend opened here by a weight named ``*suffix`` first rounds
    its input to ggml's Q8_0 (per 32 values ``d = max|x| / 127`` kept as fp16, ``q = round(x / d)``)."""
    import torch
    import torch.nn.functional as F

    from runahead.backends.torch import TorchBackend

    tagged: set[int] = set()
    original, opened, linear = TorchBackend.__dict__["open"], TorchBackend.open, F.linear

    def tagging(*args: Any, **kwargs: Any) -> Any:
        backend = opened(*args, **kwargs)
        tagged.update(id(w) for name, w in backend.model.weights.items() if name.endswith(suffix))
        return backend

    def rounded(x: Any, weight: Any, bias: Any = None) -> Any:
        if id(weight) in tagged:
            blocks = x.reshape(-1, 32).float()
            d = blocks.abs().amax(-1, keepdim=True) / 127
            q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
            x = (d.half().float() * q).reshape(x.shape).to(x.dtype)
        return linear(x, weight, bias)

    TorchBackend.open, F.linear = tagging, rounded  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        TorchBackend.open, F.linear = original, linear


def tensors(arch: str, top_k: int | None = None) -> list[dict[str, Any]]:
    """Where the two runtimes part on a tiny ``arch`` model: its F32 file, the whole model at F16 and
        Q8_0, then the F32 file with one kind of tensor at a time requantized to Q8_0. Per file, the
        largest first-position logit difference between the runtimes, and each runtime's own move from
        its F32 logits: a tensor whose quantization moves both runtimes' logits far is one the model is
        sensitive to, and llama.cpp's 8-bit activations feeding it move them as far again. Then (where
    :data:`EMULATED` names a role) that role's file once more with runahead rounding the projection's
    input as llama.cpp does: if the gap closes, llama.cpp's activation rounding is the whole difference."""
    from ggufhelpers import retyped

    from runahead.models.gguf_convert import convert

    folder, hf = tiny_folder(arch, **({"num_experts_per_tok": top_k} if top_k else {}))
    f32 = convert(hf, folder / "F32.gguf", "F32")[0]
    base_ours, base_theirs = first_logits(f32)
    files = {"F32": f32, "F16 all": convert(hf, folder / "F16.gguf", "F16")[0]}
    files["Q8_0 all"] = convert(hf, folder / "Q8_0.gguf", "Q8_0")[0]
    groups: dict[str, list[str]] = {}
    for tensor in GGUFReader(files["Q8_0 all"]).tensors:
        if tensor.tensor_type.name != "F32":  # per role: blk.N.attn_qkv.weight -> attn_qkv.weight
            role = tensor.name.split(".", 2)[-1] if tensor.name.startswith("blk.") else tensor.name
            groups.setdefault(role, []).append(tensor.name)
    for role, names in sorted(groups.items()):
        files[f"Q8_0 {role}"] = retyped(f32, folder / f"only-{role}.gguf", "Q8_0", tuple(names))

    def gap(a: list[np.ndarray[Any, Any]], b: list[np.ndarray[Any, Any]]) -> float:
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))

    rows = []
    runs = [(label, path, None) for label, path in files.items()]
    if arch in EMULATED:
        role, suffix = EMULATED[arch]
        runs.append((f"Q8_0 {role}, runahead rounding its input as llama.cpp", files[f"Q8_0 {role}"], suffix))
    for label, path, emulated in runs:
        with q8_activations(emulated) if emulated else nullcontext():
            ours, theirs = first_logits(path)
        row = {
            "arch": arch,
            "top_k": top_k,
            "file": label,
            "runahead_vs_llama_cpp": gap(ours, theirs),
            "runahead_vs_its_f32": gap(ours, base_ours),
            "llama_cpp_vs_its_f32": gap(theirs, base_theirs),
            "logit_std_f32": float(np.mean([x.std() for x in base_ours])),
        }
        print(json.dumps(row))
        rows.append(row)
    return rows


def llama_cpp_decode(path: Path, steps: int, threads: int) -> dict[str, Any]:
    """llama.cpp's single-request greedy decode on ``path``: tokens/s over ``steps`` tokens after a warm-up,
    and the median token time (llama.cpp's threads spin at barriers, so a preempted thread stalls the
    others: on a loaded machine the median says more than the mean)."""
    llm = open_llama(path, threads)
    llm.eval([11, 42, 7, 99])
    times = []
    for step in range(4 + steps):  # 4 warm-up tokens
        start = time.perf_counter()
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        if step >= 4:
            times.append(time.perf_counter() - start)
    return {
        "system": f"llama.cpp ({threads} thread{'s' if threads > 1 else ''}, file mapped)",
        "tokens_per_s": steps / sum(times),
        "median_token_ms": 1000 * float(np.median(times)),
    }


def medium(path: Path, steps: int, twin: str | None) -> list[dict[str, Any]]:
    import os

    from runahead.models import qkernel
    from runahead.torchbench import TorchPoint, run_torch_point

    rows = [llama_cpp_decode(path, steps, 2), llama_cpp_decode(path, steps, 1)]
    for fraction, store, preload, kernel in (
        (1.0, "host", True, "on"),
        (0.3, "disk", False, "on"),
        (1.0, "host", True, "off"),
    ):
        os.environ["RUNAHEAD_QUANT_KERNEL"] = kernel  # off: each expert dequantized per group instead
        qkernel._library.cache_clear()
        point = TorchPoint(
            str(path), "runahead", 1, fraction, steps, store=store, warmup_steps=4, preload=preload
        )
        result = run_torch_point(point)
        rows.append(
            {
                "system": f"runahead torch, {int(fraction * 100)}% of experts cached, {store} store"
                + ("" if kernel == "on" else ", dequantized per group (kernel off)"),
                "tokens_per_s": result["tokens_per_s"],
                "fetches_per_step": result["fetches_per_step"],
            }
        )
    os.environ.pop("RUNAHEAD_QUANT_KERNEL")
    qkernel._library.cache_clear()
    if twin is not None:  # the same model as safetensors (bf16 on disk, float32 in the cache)
        point = TorchPoint(twin, "runahead", 1, 1.0, steps, store="host", warmup_steps=4, preload=True)
        result = run_torch_point(point)
        rows.append(
            {"system": f"runahead torch on {twin}, 100% cached", "tokens_per_s": result["tokens_per_s"]}
        )
    rows.append(llama_cpp_decode(path, steps, 2))  # again, after: how much the machine's load moved
    load = os.getloadavg()[0]
    for row in rows:
        row["file"] = str(path)
        row["load_average_1min_at_end"] = load
        row["vs_llama_cpp_2_threads"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        print(json.dumps(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["tiny", "medium", "tensors"])
    parser.add_argument("file", nargs="?", type=Path, help="medium: the GGUF file")
    parser.add_argument("--top-k", type=int, help="tensors: experts per token (the tiny model has 8 experts)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--arch",
        action="append",
        help=f"tiny: an architecture (default: {' '.join(TINY)}); tensors: the one (qwen3_5_moe)",
    )
    parser.add_argument("--steps", type=int, default=32, help="medium: decode steps timed")
    parser.add_argument("--twin", help="medium: also run this safetensors folder (or 'medium') all resident")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "tensors":
        arch = args.arch[0] if args.arch else "qwen3_5_moe"
        rows = tensors(arch, args.top_k)
        name = f"tensors-{arch}" + (f"-top{args.top_k}" if args.top_k else "")
    else:
        archs = tuple(args.arch or TINY)
        rows = tiny(archs) if args.what == "tiny" else medium(args.file, args.steps, args.twin)
        name = args.what if args.what == "medium" or archs == TINY else f"tiny-{'-'.join(archs)}"
    with (args.out / f"{name}.jsonl").open("w") as sink:
        sink.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
