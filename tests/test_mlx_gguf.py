"""GGUF files on the mlx backend: Q4_0 / Q8_0 experts repacked exactly as MLX affine quantization.

The experts stay quantized from the file to ``mx.gather_qmm`` (4 / 8 bits, group 32, scale ``d``,
bias ``-8d`` / ``-128d``). The judge is transformers on the GGUF's *dequantized* weights
(``ggufhelpers.reference_model``, as in ``tests/test_gguf.py``): greedy tokens equal its argmax
at every step, logits within 1e-4, with 4
requests at once, 8 cache slots for 24-32 experts and prompts in chunks of 2; other policies give
the same tokens (Gemma 4: every policy). Skipped without MLX.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mlx.core")

import mlx.core as mx
from ggufhelpers import GGUF_ARCH, LOGIT_TOLERANCE, build_tiny_gguf, reference_model

from runahead.backends.mlx import MLXBackend
from runahead.models.mlx.checkpoint import GGUF_ARCHITECTURES as MLX_GGUF
from runahead.models.mlx.ggufq import repack

from mlxhelpers import run_requests
from simhelpers import POLICIES

TOKENS = 8
PROMPTS = [(5, 17, 42, 9), (3, 99, 7), (120, 4, 4, 66, 8, 31), (200,)]
SLOTS = 8
CASES = [(arch, kind) for kind in ("Q4_0", "Q8_0") for arch in MLX_GGUF]
OTHER_POLICIES = {
    "qwen3_moe": ("sync", "prefetch-gate", "runahead/grouping=static:2:2"),
    "gemma4": tuple(p for p in POLICIES if p != "runahead"),  # the paper's model: every policy
}


def run(path: Path, policy: str) -> tuple[dict[int, list[int]], dict[int, list[np.ndarray]], MLXBackend]:
    backend = MLXBackend.open(str(path), cache_slots=SLOTS, device="cpu", keep_logits=True)
    logits: dict[int, list[np.ndarray]] = {}
    tokens, runtime = run_requests(backend, policy, PROMPTS, TOKENS, slots=SLOTS, keep=logits)
    assert runtime.cache.stats.evictions > 0
    return tokens, logits, backend


@pytest.mark.parametrize(("arch", "kind"), CASES)
def test_greedy_tokens_and_logits_equal_the_dequantized_reference(
    arch: str, kind: str, tmp_path: Path
) -> None:
    path, hf = build_tiny_gguf(arch, tmp_path, kind)
    reference = reference_model(arch, path, hf, tmp_path)
    tokens, logits, backend = run(path, "runahead")
    assert all(f.quant is not None and f.quant.group_size == 32 for f in backend.checkpoint.formats.values())
    resident = backend.model.quant  # the projections, LM head and embedding stay quantized too
    assert "embed" in resident and any(key.startswith("1.") for key in resident)  # and layer 1's projections
    assert {q.group_size for q in resident.values()} == {32}
    if (
        arch == "gemma4"
    ):  # sqrt(hidden) in the rows' dtype, not the packed table's uint32 (which truncates it)
        assert backend.model.embed_scale.dtype == backend.model.weights["embed.scales"].dtype
    with torch.no_grad():
        for index, prompt in enumerate(PROMPTS):
            ref = reference(torch.tensor([list(prompt) + tokens[index]])).logits[0, len(prompt) - 1 : -1]
            assert ref.argmax(-1).tolist() == tokens[index], f"request {index}: greedy tokens differ"
            assert np.abs(np.stack(logits[index]) - ref.numpy()).max() < LOGIT_TOLERANCE.get(arch, 1e-4)
    others = OTHER_POLICIES.get(arch, ()) if kind == "Q4_0" else ("sync",)  # every policy: at Q4_0
    for policy in others:  # the other policies give the same tokens
        assert run(path, policy)[0] == tokens, policy


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


@pytest.mark.parametrize("arch", sorted(set(GGUF_ARCH) - set(MLX_GGUF)))
def test_other_gguf_architectures_are_refused_by_name(arch: str, tmp_path: Path) -> None:
    from runahead.models.description import ModelLoadError

    path, _ = build_tiny_gguf(arch, tmp_path, "Q8_0")
    with pytest.raises(ModelLoadError, match=f"GGUF {arch} .*mlx backend"):
        MLXBackend.open(str(path), cache_slots=SLOTS, device="cpu")
