"""The mlx backend gives bit-identical logits under every schedule in ``batch_invariant`` mode.

A prompt chunk whose experts do not fit the cache at once runs its MoE in waves, and which experts
go in which wave depends on what the schedule left in the cache. Summing each wave into a running
total made the split reach the last bits (``(a + c) + b`` against ``(a + b) + c``); the backend now
keeps every routed pair's weighted product from its wave and sums them at the last one as a job in
one wave does. Top-4 routing, since with top-2 any split into two waves adds ``x + 0``, which is
exact, and hides the difference. Skipped without MLX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from runahead.backends.mlx import MLXBackend

from mlxhelpers import build_mlx_model, convert, run_requests
from modelhelpers import build_tiny_model

PROMPTS = [(5, 17, 42, 9), (3, 99, 7), (120, 4, 4, 66, 8, 31), (200,), (11, 12, 13)]
TOKENS = 12
SLOTS = 10
SCHEDULES = ("sync", "runahead", "runahead/grouping=opportunistic", "runahead/grouping=static:1:1:1:1:1")


def logits_under_every_schedule(path: Path) -> dict[str, dict[int, Any]]:
    """Each request's logits of every step per schedule, prompts in chunks of 4; asserts that some
    jobs ran in waves under every schedule."""
    seen = {}
    for policy in SCHEDULES:
        backend = MLXBackend.open(
            str(path), cache_slots=SLOTS, device="cpu", keep_logits=True, batch_invariant=True
        )
        waved = []
        moe = backend._moe

        def counted(layer, jobs, states, moe=moe, waved=waved):  # type: ignore[no-untyped-def]
            waved.extend(job for job in jobs if job.remaining or job.wave)
            return moe(layer, jobs, states)

        backend._moe = counted  # type: ignore[method-assign]
        kept: dict[int, Any] = {}
        run_requests(backend, policy, PROMPTS, TOKENS, slots=SLOTS, chunk=4, keep=kept)
        assert waved, policy
        seen[policy] = {request: np.stack([np.array(step) for step in kept[request]]) for request in kept}
    return seen


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "gemma4", "gpt_oss"])
def test_waves_leave_no_trace_in_the_logits(arch: str, tmp_path: Path) -> None:
    if arch == "gpt_oss":  # mlx-lm does not convert it; the backend reads transformers' folder
        path = build_tiny_model(arch, tmp_path / arch, num_experts_per_tok=4)
    else:
        path = build_mlx_model(arch, tmp_path / arch, num_experts_per_tok=4)
    seen = logits_under_every_schedule(path)
    first, *others = seen.values()
    assert sorted(first) == list(range(len(PROMPTS)))
    for other in others:
        for request, logits in first.items():
            assert logits.shape == other[request].shape
            assert np.array_equal(logits, other[request])  # bit for bit, not just close


def test_waves_leave_no_trace_in_a_4_bit_models_logits(tmp_path: Path) -> None:
    """The same through ``gather_qmm``: Qwen3.6 converted to 4 bits by ``mlx_lm.convert``. (With these
    prompts the old running sum happened to agree here too; the float32 cases above catch it.)"""
    plain = build_mlx_model("qwen3_5_moe", tmp_path / "f32", quantized=True, num_experts_per_tok=4)
    seen = logits_under_every_schedule(convert(plain, tmp_path / "q4"))
    first, *others = seen.values()
    for other in others:
        for request, logits in first.items():
            assert np.array_equal(logits, other[request])
