"""The paper's models (Qwen3.5/3.6 MoE, Gemma 4 MoE) and gpt-oss on the mlx backend: transformers' tokens.

Tiny random float32 models as ``tests/modelhelpers.py`` builds them for the torch backend (their
constant-initialised weights randomised, linear-attention and sliding layers mixed in), run with 4
requests at once, a cache of 8 of the model's experts and prompts in chunks of 2, under ``sync``,
``runahead``, ``prefetch-gate`` and a static grouping. Their tokens equal transformers' and the
torch backend's. Skipped without MLX.

The same architectures converted by ``mlx_lm.convert`` to 4 bits (the mlx-community checkpoints'
format: mlx-lm's renamed, re-laid-out tensors, every expert matrix quantized) give mlx-lm's own
greedy tokens for the same folder, under ``sync`` and ``runahead`` with the same small cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core")

from runahead.backends.mlx import MLXBackend

from mlxhelpers import (
    MLX_LM_PAPER,
    build_mlx_model,
    convert,
    mlx_lm_greedy,
    run_requests,
    transformers_greedy,
)
from modelhelpers import build_tiny_model

TOKENS = 10
PROMPTS = [(5, 17, 42, 9), (3, 99, 7), (120, 4, 4, 66, 8, 31), (200,)]
SLOTS = 8
POLICIES = ["sync", "runahead", "prefetch-gate", "runahead/grouping=static:2:2"]
PAPER = ["qwen3_5_moe", "gemma4", "gpt_oss"]


@pytest.fixture(scope="module", params=PAPER)
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]]]:
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return path, transformers_greedy(path, PROMPTS, TOKENS)


def run(backend: Any, policy: str) -> dict[int, list[int]]:
    tokens, runtime = run_requests(backend, policy, PROMPTS, TOKENS, slots=SLOTS)
    assert runtime.cache.stats.evictions > 0
    return tokens


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_transformers(model: tuple[Path, list[list[int]]], policy: str) -> None:
    path, expected = model
    tokens = run(MLXBackend.open(str(path), cache_slots=SLOTS, device="cpu"), policy)
    assert [tokens[i] for i in range(len(PROMPTS))] == expected


def test_the_torch_backend_gives_the_same_tokens(model: tuple[Path, list[list[int]]]) -> None:
    from runahead.backends.torch import TorchBackend

    path, expected = model
    tokens = run(TorchBackend.open(str(path), cache_slots=SLOTS), "runahead")
    assert [tokens[i] for i in range(len(PROMPTS))] == expected


@pytest.fixture(scope="module", params=list(MLX_LM_PAPER))
def converted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]]]:
    """A tiny model converted by ``mlx_lm.convert`` at 4 bits, and mlx-lm's greedy tokens for it."""
    pytest.importorskip("mlx_lm")
    root = tmp_path_factory.mktemp(request.param)
    q4 = convert(build_mlx_model(request.param, root / "f32"), root / "q4")
    return q4, mlx_lm_greedy(q4, PROMPTS, TOKENS)


@pytest.mark.parametrize("policy", ["sync", "runahead"])
def test_mlx_lm_conversions_give_mlx_lms_tokens(converted: tuple[Path, list[list[int]]], policy: str) -> None:
    path, expected = converted
    backend = MLXBackend.open(str(path), cache_slots=SLOTS, store="disk", device="cpu")
    tokens = run(backend, policy)
    assert [tokens[i] for i in range(len(PROMPTS))] == expected
    assert backend.store.reads > SLOTS  # experts were evicted and read again
    checkpoint = backend.checkpoint
    assert checkpoint.mlx_format and checkpoint.quant  # resident matrices quantized too
    assert all(f.quant is not None and f.quant.bits == 4 for f in checkpoint.formats.values())


def test_mlx_lm_gpt_oss_folders_are_refused_by_name(tmp_path: Path) -> None:
    """mlx-lm converts gpt-oss only from the hub's MXFP4 tensors; its folders are refused, naming it."""
    import json

    from runahead.models.description import ModelLoadError

    path = build_tiny_model("gpt_oss", tmp_path / "gpt_oss")
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlx-lm's gpt_oss folders .* do not run on the mlx backend"):
        MLXBackend.open(str(path), cache_slots=SLOTS)
