"""The ``medium`` model: a random Qwen3-MoE of ~3 GB of bf16 experts, built once and cached.

It stands in for a real checkpoint on machines that cannot download one: hidden 1024, 16 layers,
64 experts, top-8, expert width 512 (1.7 B parameters). Routers are scaled up and weights drawn
with a wider init so tokens and routing vary. Built with ``transformers`` and saved in the hub's
format, so it goes through the same loader and O_DIRECT store as a real model; a byte-level BPE
tokenizer with a chat template (:mod:`runahead.tokenizer`) is trained and saved with it, so text
prompts and chat work on it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MEDIUM_CONFIG: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "intermediate_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "norm_topk_prob": True,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SMALL_CONFIG: dict[str, Any] = {
    **MEDIUM_CONFIG,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 4096,
}
"""The ``small`` model of ``runahead demo``: 8 layers x 32 experts, top-4 (~200 MB in float32: 256 experts
of 3 x 256 x 256 weights)."""
ROUTER_SCALE = 8.0


def cache_dir() -> Path:
    """Where built models are kept: ``$RUNAHEAD_CACHE`` or ``~/.cache/runahead``."""
    return Path(os.environ.get("RUNAHEAD_CACHE", Path.home() / ".cache" / "runahead"))


def medium_model(progress: bool = True) -> Path:
    """The folder of the medium model, building it first if it is not there (about a minute)."""
    return build_cached("medium-qwen3-moe", MEDIUM_CONFIG, "bfloat16", progress)


def small_model(progress: bool = True) -> Path:
    """The folder of the small demo model, building it first if it is not there (seconds)."""
    return build_cached("small-qwen3-moe", SMALL_CONFIG, "float32", progress)


def build_cached(
    name: str, config: dict[str, Any], dtype: str, progress: bool = True, device: str = "cpu"
) -> Path:
    """A random Qwen3-MoE with ``config`` and a trained tokenizer, saved under the cache directory once.

    A folder built before the tokenizer existed gets one added. ``device`` is where the random
    weights are drawn (``cuda`` draws billions in seconds).
    """
    path = cache_dir() / name
    with _build_lock(path):
        return _build(path, config, dtype, progress, device)


@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` exclusively: a second process building the same model (two demos, two
    test workers) waits for the first and then finds its folder instead of writing beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(path: Path, config: dict[str, Any], dtype: str, progress: bool, device: str) -> Path:
    from runahead.tokenizer import has_tokenizer, save_tokenizer

    name = path.name
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        if not has_tokenizer(path):
            save_tokenizer(path, config["vocab_size"])
        return path
    import structlog
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from runahead.progress import progress_bar

    log = structlog.get_logger("runahead.build")
    if progress:
        log.info("building model (once)", model=name, path=str(path))
    with progress_bar(f"building {name}", 3, enabled=progress) as advance:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                Qwen3MoeConfig(**config), dtype=getattr(torch, dtype)
            )
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("mlp.gate.weight"):
                    param.mul_(ROUTER_SCALE)
        advance(1)
        partial = path.with_name(path.name + ".partial")
        if partial.exists():  # left by a build that was killed
            shutil.rmtree(partial)
        save_tokenizer(partial, config["vocab_size"])
        advance(2)
        model.save_pretrained(partial)
        advance(3)
    partial.rename(path)
    if progress:
        log.info("model built", model=name, path=str(path))
    return path
