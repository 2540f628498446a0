"""GGUF files on the mlx backend: Q4_0 / Q8_0 experts repacked exactly as MLX affine quantization.

The experts stay quantized from the file to ``mx.gather_qmm`` (4 / 8 bits, group 32, scale ``d``,
bias ``-8d`` / ``-128d``). The judge is transformers on the GGUF's *dequantized* weights (as in
``tests/test_gguf.py``): greedy tokens equal its argmax at every step, logits within 1e-4, with 4
requests at once, 8 cache slots for 24 experts and prompts in chunks of 2. Skipped without MLX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("mlx.core")

import mlx.core as mx
from ggufhelpers import GGUF_ARCH, LOGIT_TOLERANCE, build_tiny_gguf, dequantized_folder, transformers_gguf

from runahead.backends.mlx import MLXBackend
from runahead.models.mlx.ggufq import repack

from mlxhelpers import run_requests

TOKENS = 8
PROMPTS = [(5, 17, 42, 9), (3, 99, 7), (120, 4, 4, 66, 8, 31), (200,)]
SLOTS = 8
MLX_GGUF = [arch for arch in GGUF_ARCH if arch != "gpt_oss"]  # gpt-oss's expert biases: not on mlx yet
CASES = [(arch, kind) for kind in ("Q4_0", "Q8_0") for arch in MLX_GGUF]


def run(path: Path, policy: str) -> tuple[dict[int, list[int]], dict[int, list[np.ndarray]], MLXBackend]:
    backend = MLXBackend.open(str(path), cache_slots=SLOTS, device="cpu", keep_logits=True)
    logits: dict[int, list[np.ndarray]] = {}
    tokens, runtime = run_requests(backend, policy, PROMPTS, TOKENS, slots=SLOTS, keep=logits)
    assert runtime.cache.stats.evictions > 0
    return tokens, logits, backend


def _reference(arch: str, path: Path, hf: Path, folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    if GGUF_ARCH[arch] == "qwen3moe":  # transformers fails on the converter's 2-D qwen2moe shexp gate
        return transformers_gguf(path, hf).eval()
    return AutoModelForCausalLM.from_pretrained(
        dequantized_folder(path, hf, folder / "dequantized"), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize(("arch", "kind"), CASES)
def test_greedy_tokens_and_logits_equal_the_dequantized_reference(
    arch: str, kind: str, tmp_path: Path
) -> None:
    path, hf = build_tiny_gguf(arch, tmp_path, kind)
    reference = _reference(arch, path, hf, tmp_path)
    tokens, logits, backend = run(path, "runahead")
    assert all(f.quant is not None and f.quant.group_size == 32 for f in backend.checkpoint.formats.values())
    with torch.no_grad():
        for index, prompt in enumerate(PROMPTS):
            ref = reference(torch.tensor([list(prompt) + tokens[index]])).logits[0, len(prompt) - 1 : -1]
            assert ref.argmax(-1).tolist() == tokens[index], f"request {index}: greedy tokens differ"
            assert np.abs(np.stack(logits[index]) - ref.numpy()).max() < LOGIT_TOLERANCE.get(arch, 1e-4)
    if arch == "qwen3_moe":  # the other policies give the same tokens
        for policy in ("sync", "prefetch-gate", "runahead/grouping=static:2:2"):
            assert run(path, policy)[0] == tokens


def test_gpt_oss_gguf_is_refused_by_name(tmp_path: Path) -> None:
    from runahead.models.base import ModelLoadError

    path, _ = build_tiny_gguf("gpt_oss", tmp_path, "Q8_0")
    with pytest.raises(
        ModelLoadError, match=rf"{path}: GGUF gpt_oss \(expert biases\) is not run on the mlx"
    ):
        MLXBackend.open(str(path), cache_slots=SLOTS, device="cpu")


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_repacked_blocks_dequantize_to_the_gguf_packages_values(kind: str) -> None:
    from gguf import GGMLQuantizationType, quants

    kind_type = GGMLQuantizationType[kind]
    weights = np.random.default_rng(0).normal(size=(24, 96)).astype(np.float32)
    raw = np.asarray(quants.quantize(weights, kind_type))
    expected = quants.dequantize(raw, kind_type).reshape(24, 96)
    packed, scales, biases = repack(kind, raw.reshape(-1).view(np.uint8), (24, 96))
    bits = 4 if kind == "Q4_0" else 8
    got = mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=32, bits=bits)
    assert np.array_equal(np.array(got), expected)
