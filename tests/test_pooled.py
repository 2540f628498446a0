"""A group's experts as grouped products over the slot pool (runahead/models/pooled.py), and the
other ways the GPU path cuts its torch calls.

On CUDA this path is the default (tests/test_cuda.py runs it there); torch's grouped product also
runs on CPU, so the same code is judged here: against the loop over experts, against transformers'
tokens for every architecture it applies to, and by how many torch calls a group takes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.models import load_model
from runahead.models.loader import load_reference_slot
from runahead.models.pooled import PooledExperts, grouped_mm, pooled_by_default
from runahead.models.routing import ExpertRows
from runahead.store import SlotPool

from modelhelpers import ARCHS, TorchCalls, build_tiny_model, compare_with_transformers

pytestmark = pytest.mark.skipif(grouped_mm() is None, reason="this torch has no grouped matrix product")


@pytest.fixture(scope="module", params=["qwen3_moe", "gemma4"])  # gemma4: its own activation
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def _group(path: Path, experts: int, rows: int, seed: int = 0) -> tuple[Any, Any, dict[str, Any]]:
    """The model, its slot pool with layer 0's experts in shuffled slots, and a group's MoE inputs:
    ``rows`` rows routed to ``experts`` distinct experts (some rows to the same ones)."""
    model, layout = load_model(str(path), device="cpu")
    config = model.config
    rng = random.Random(seed)
    chosen = rng.sample(range(config.num_experts), experts)
    pool = SlotPool(config.num_experts + 3, layout.slot_numel)
    slots = rng.sample(range(pool.num_slots), experts)
    tensors = {}
    for expert, slot in zip(chosen, slots, strict=True):
        pool.slot(slot)[: layout.slot_numel].copy_(load_reference_slot(layout, 0, expert))
        tensors[expert] = pool.slot(slot)
    routing = [rng.sample(chosen, config.top_k) if experts >= config.top_k else chosen for _ in range(rows)]
    hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    weights = torch.softmax(torch.randn(rows, len(routing[0])), dim=-1)
    return model, pool, {"hidden": hidden, "weights": weights, "experts": tensors, "routing": routing}


def _moe(model: Any, pool: SlotPool, inputs: dict[str, Any], grouped: bool) -> torch.Tensor:
    model.use_slot_pool(pool.data, grouped=grouped)
    routing = ExpertRows.from_host(inputs["routing"], inputs["experts"])
    return model.moe_partial(0, inputs["hidden"], None, inputs["weights"], inputs["experts"], None, routing)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("experts", "rows"), [(2, 1), (4, 3), (8, 9)])
def test_grouped_products_equal_the_loop_over_experts(
    tiny: Path, experts: int, rows: int, grouped_calls: list[int]
) -> None:
    model, pool, inputs = _group(tiny, experts, rows)
    looped = _moe(model, pool, inputs, grouped=False)
    assert model._pooled is None and grouped_calls[0] == 0
    grouped = _moe(model, pool, inputs, grouped=True)
    assert grouped_calls[0] == 1, "the grouped path did not run"
    torch.testing.assert_close(grouped, looped, rtol=1e-6, atol=1e-6)


def _calls(model: Any, pool: SlotPool, inputs: dict[str, Any], grouped: bool) -> int:
    with TorchCalls() as mode:
        _moe(model, pool, inputs, grouped)
    return sum(mode.calls.values())


def test_a_group_takes_the_same_torch_calls_however_many_experts_it_routes_to(tiny: Path) -> None:
    """The point of the grouped path: host time per group (torch calls, each a launch on a GPU) does
    not grow with the experts routed to, where the loop's grows by several calls an expert."""
    few, many = _group(tiny, 2, 2), _group(tiny, 8, 9)
    grouped = [_calls(*case, grouped=True) for case in (few, many)]
    looped = [_calls(*case, grouped=False) for case in (few, many)]
    assert grouped[0] == grouped[1], grouped
    assert looped[1] - looped[0] >= 3 * 6, looped  # at least three calls for each of 6 more experts
    assert grouped[1] < looped[1] / 2, (grouped, looped)


@pytest.fixture
def grouped_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the groups the grouped path computed (the CPU kernel, where it applies, comes first)."""
    calls = [0]
    products = PooledExperts.products

    def counted(self: PooledExperts, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        calls[0] += 1
        return products(self, *args, **kwargs)

    monkeypatch.setattr(PooledExperts, "products", counted)
    return calls


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt_oss"])
def test_grouped_products_give_transformers_tokens(
    arch: str, tmp_path: Path, grouped_calls: list[int]
) -> None:
    """Every architecture whose experts are the plain ``down(glu(gate, up))``: 4 requests, 8 slots
    (experts evicted, refetched, in whatever slot is free), two-token prompt chunks (waves)."""
    path = build_tiny_model(arch, tmp_path / arch)
    found = compare_with_transformers(path, tokens=8, chunk=2, grouped=True)
    assert grouped_calls[0] > 0, "the grouped path never ran"
    assert found["tokens_equal"], found
    assert found["logit_error"] < 1e-4, found


def test_gpt_oss_keeps_its_loop(tmp_path: Path) -> None:
    """gpt-oss's experts carry biases and a clamped activation in their slots: the grouped path
    does not apply, and asking for it leaves the loop in place."""
    model, layout = load_model(str(build_tiny_model("gpt_oss", tmp_path / "gpt_oss")), device="cpu")
    model.use_slot_pool(SlotPool(4, layout.slot_numel).data, grouped=True)
    assert model._pooled is None


def test_a_pool_too_small_for_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold experts"):
        PooledExperts(torch.zeros(4, 10), 4, 2, torch.mm)


def test_cpu_keeps_its_kernel_by_default() -> None:
    assert not pooled_by_default(torch.device("cpu"), torch.bfloat16)


def test_a_pool_off_16_bytes_keeps_the_loop(tiny: Path) -> None:
    """The fused kernel wants every matrix on 16 bytes: a pool whose slots stride 4 bytes off is
    left to the loop instead of failing at the first group."""
    model, layout = load_model(str(tiny), device="cpu")
    pool = torch.zeros(4, layout.slot_numel + 1)
    model.use_slot_pool(pool, grouped=True)
    assert model._pooled is None
    model.use_slot_pool(torch.zeros(4, layout.slot_numel), grouped=True)
    assert model._pooled is not None


def test_a_product_torch_refuses_hands_the_group_to_the_loop(tiny: Path) -> None:
    """Should torch refuse the grouped product on some device, the group still gets its experts
    (from the loop), and later groups go straight to the loop."""
    model, pool, inputs = _group(tiny, 4, 3)
    looped = _moe(model, pool, inputs, grouped=False)
    model.use_slot_pool(pool.data, grouped=True)
    assert model._pooled is not None

    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("grouped_mm: this device is not supported")

    model._pooled.product = refuse
    routing = ExpertRows.from_host(inputs["routing"], inputs["experts"])
    out = model.moe_partial(0, inputs["hidden"], None, inputs["weights"], inputs["experts"], None, routing)
    torch.testing.assert_close(out, looped, rtol=0, atol=0)
    assert model._pooled is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4"])
def test_grouped_products_in_bfloat16_stay_as_close_to_float32_as_transformers_bfloat16(
    arch: str, tmp_path: Path, grouped_calls: list[int]
) -> None:
    """The dtype the grouped path runs in on a GPU, here on CPU: ours no further from float32 than
    transformers' own bfloat16 (the bound tests/test_cuda.py asks on the GPU)."""
    path = build_tiny_model(arch, tmp_path / arch)
    found = compare_with_transformers(path, dtype=torch.bfloat16, tokens=8, grouped=True)
    assert grouped_calls[0] > 0, "the grouped path never ran"
    assert found["logit_mean_error"] <= 1.5 * found["reference_mean_error"] + 1e-3, found
    assert found["logit_error"] <= 4 * found["reference_error"] + 1e-2, found


@pytest.mark.parametrize("shape", [(1, 2048), (8, 2048), (3, 4, 128)])
def test_the_accelerators_one_call_rms_norm_gives_the_five_calls_bits(shape: tuple[int, ...]) -> None:
    """On a GPU the norm is torch's one ``F.rms_norm`` call (runahead/models/base.py): on CPU it
    gives the very bits of the five-call form transformers uses, so only the GPU's own kernel can
    round otherwise (there the tests judge by tolerance)."""
    from runahead.models.ops import fused_rms_norm

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3
    manual = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(fused_rms_norm(x, 1e-6), manual)
