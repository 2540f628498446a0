"""Model specs, hardware profiles and the roofline cost model."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runahead.costs import CostModel, GroupCost
from runahead.jobs import ENTRY_LAYER, Job
from runahead.specs import (
    HardwareProfile,
    ModelSpec,
    load_model_spec,
    load_profile,
    model_names,
    profile_names,
)

# Published totals / active parameters (model cards); our counts keep the LM head and, for "total",
# count the embedding separately, so a 10% band covers tying and rounding.
PUBLISHED = {
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "olmoe-1b-7b": (6.9e9, 1.3e9),
    "gpt-oss-20b": (20.9e9, 3.6e9),
    "qwen3.6-35b-a3b": (35e9, 3.0e9),
    "gemma4-26b-a4b": (26e9, 3.8e9),
}


def test_all_shipped_files_load() -> None:
    assert set(model_names()) == set(PUBLISHED)
    assert set(profile_names()) == {"thor", "mac-mini", "pcie4-desktop"}
    for name in model_names():
        spec = load_model_spec(name)
        assert spec.name == name and spec.sources and spec.bits_per_weight == 4.5
    for name in profile_names():
        profile = load_profile(name)
        assert profile.name == name and profile.sources and profile.estimates


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_model_cards(name: str) -> None:
    spec = load_model_spec(name)
    total, active = PUBLISHED[name]
    print(f"{name}: total {spec.total_params / 1e9:.2f}B active {spec.active_params / 1e9:.2f}B")
    assert spec.total_params == pytest.approx(total, rel=0.1)
    assert spec.active_params == pytest.approx(active, rel=0.1)


def test_brief_shapes() -> None:
    qwen = load_model_spec("qwen3.6-35b-a3b")
    assert (qwen.num_layers, qwen.num_experts, qwen.top_k, qwen.hidden_size, qwen.expert_width) == (
        40,
        256,
        8,
        2048,
        512,
    )
    assert qwen.num_shared_experts == 1
    assert qwen.expert_bytes == 3 * 2048 * 512 * 18 // 32  # Q4_0: 18 bytes per 32 weights
    gemma = load_model_spec("gemma4-26b-a4b")
    assert (gemma.num_layers, gemma.num_experts, gemma.hidden_size, gemma.expert_width) == (
        30,
        128,
        2816,
        704,
    )
    assert gemma.dense_mlp_width > 0
    assert [qwen.is_full_attention(layer) for layer in range(4)] == [False, False, False, True]


def test_bad_spec_values_name_the_problem(tmp_path: Path) -> None:
    spec = load_model_spec("olmoe-1b-7b")
    with pytest.raises(ValueError, match="top_k 65 > num_experts 64"):
        dataclasses.replace(spec, top_k=65)
    with pytest.raises(ValueError, match="bits_per_weight"):
        dataclasses.replace(spec, bits_per_weight=0)
    profile = load_profile("thor")
    with pytest.raises(ValueError, match="link_queue_depth must be >= 2"):
        dataclasses.replace(profile, link_queue_depth=1)
    with pytest.raises(ValueError, match="bandwidth_efficiency"):
        dataclasses.replace(profile, bandwidth_efficiency=1.5)


def test_bad_files_name_the_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        load_model_spec("nope")
    path = tmp_path / "m.toml"
    path.write_text("num_layers = 2\nbogus = 1\n")
    with pytest.raises(ValueError, match=r"m\.toml: unknown keys \['bogus'\]"):
        load_model_spec(path)
    path.write_text("num_layers = 2\n")
    with pytest.raises(ValueError, match=r"m\.toml: missing required keys \['num_experts'"):
        load_model_spec(path)
    path.write_text("num_layers = 2.5\n")
    with pytest.raises(ValueError, match="num_layers must be an integer"):
        load_model_spec(path)
    path.write_text("num_layers = [\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_model_spec(path)
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.toml")


def test_load_from_path_round_trip(tmp_path: Path) -> None:
    text = resources.files("runahead").joinpath("data", "profiles", "thor.toml").read_text()
    path = tmp_path / "mine.toml"
    path.write_text(text.replace('name = "thor"\n', ""))
    profile = load_profile(path)
    assert profile.name == "mine"
    assert profile.memory_bandwidth == load_profile("thor").memory_bandwidth


def _toy() -> tuple[ModelSpec, HardwareProfile]:
    model = ModelSpec(
        name="toy",
        num_layers=4,
        num_experts=8,
        top_k=2,
        hidden_size=64,
        expert_width=32,
        vocab_size=100,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        bits_per_weight=8.0,
        kv_bytes_per_element=2.0,
    )
    profile = HardwareProfile(
        name="toy",
        memory_bandwidth=1e6,
        bandwidth_efficiency=0.5,
        peak_flops=1e12,
        group_overhead_s=1e-3,
        link_bandwidth=1e5,
        link_latency_s=2e-3,
        link_queue_depth=2,
    )
    return model, profile


def test_compute_time_formula_by_hand() -> None:
    model, profile = _toy()
    costs = CostModel(model, profile)
    expert = 3 * 64 * 32  # bytes at 8 bits/weight
    attention = 64 * 16 * (4 + 4) + 4 * 16 * 64 + 64 * 8
    kv = 2 * 2 * 16 * 2  # bytes per token per layer
    bw = 1e6 * 0.5
    # middle layer: 3 distinct experts + attention of layer 2 + two jobs' KV (10 and 20 tokens)
    expected = 1e-3 + (3 * expert + attention + (10 + 20) * kv) / bw
    assert costs.compute_time(1, [1, 1], [10, 20], 3) == pytest.approx(expected)
    # entry job: embedding rows + attention 0, no experts
    assert costs.compute_time(ENTRY_LAYER, [1], [5], 0) == pytest.approx(
        1e-3 + (64 + attention + 5 * kv) / bw
    )
    # last layer: experts + LM head instead of a next attention
    assert costs.compute_time(3, [1], [5], 2) == pytest.approx(1e-3 + (2 * expert + 100 * 64) / bw)
    assert costs.fetch_transfer_time() == pytest.approx(expert / 1e5)
    assert costs.fetch_transfer_time(1000) == pytest.approx(0.01)
    assert costs.link_latency_s == 2e-3 and costs.expert_bytes == expert


def test_batching_shares_weights_and_flops_can_bound() -> None:
    model, profile = _toy()
    costs = CostModel(model, profile)
    one = costs.compute_time(1, [1], [10], 2)
    four = costs.compute_time(1, [1] * 4, [10] * 4, 2)
    assert four < 4 * one  # shared weights read once per group
    assert four > one  # but each job's KV is its own
    slow = CostModel(model, dataclasses.replace(profile, peak_flops=1e6))
    memory_bytes, flops = slow.group_bytes_and_flops(1, [512], [512], 2)
    assert slow.compute_time(1, [512], [512], 2) == pytest.approx(1e-3 + flops / 1e6)
    assert flops / 1e6 > memory_bytes / 5e5


def test_compute_time_rejects_bad_groups() -> None:
    costs = CostModel(*_toy())
    with pytest.raises(ValueError, match="layer 4 out of range"):
        costs.compute_time(4, [1], [1], 1)
    with pytest.raises(ValueError, match="at least one job"):
        costs.compute_time(0, [], [], 1)
    with pytest.raises(ValueError, match="distinct_experts 9"):
        costs.compute_time(0, [1], [1], 9)
    with pytest.raises(ValueError, match="2 token counts but 1 context"):
        costs.compute_time(0, [1, 1], [1], 1)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_cost_model_reads_each_jobs_attention_state_as_the_spec_says(name: str) -> None:
    spec = load_model_spec(name)
    costs = CostModel(spec, load_profile("thor"))
    for layer in range(spec.num_layers):
        for context in (0, 1, 700, 1024, 5000, 300_000):
            state_bytes, flops_per_token = costs._job_terms(layer, context)
            assert state_bytes == spec.attention_state_bytes(layer, context)
            # a linear-attention state: 4 flops per f32 element; other layers attend over their KV
            kv_tokens = state_bytes // spec.kv_bytes_per_token
            linear = not spec.is_full_attention(layer) and spec.sliding_window == 0
            heads = spec.num_attention_heads * spec.head_dim
            assert flops_per_token == (spec.linear_state_bytes if linear else 4 * kv_tokens * heads)


def test_local_layers_cap_attention_state() -> None:
    gemma = load_model_spec("gemma4-26b-a4b")
    assert gemma.attention_state_bytes(0, 4096) == 1024 * gemma.kv_bytes_per_token  # sliding window
    assert gemma.attention_state_bytes(5, 4096) == 4096 * gemma.kv_bytes_per_token  # global layer
    qwen = load_model_spec("qwen3.6-35b-a3b")
    assert (
        qwen.attention_state_bytes(0, 4096)
        == qwen.attention_state_bytes(0, 10)
        == 2 * qwen.linear_state_bytes
    )


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["qwen3.6-35b-a3b", "gemma4-26b-a4b"]),  # linear / sliding-window local layers
    st.sampled_from(["thor", "mac-mini"]),
    st.integers(ENTRY_LAYER, 60),  # past the last layer: the last layer
    st.lists(
        st.tuples(st.integers(1, 600), st.integers(0, 50_000), st.lists(st.integers(0, 255), max_size=10)),
        min_size=1,
        max_size=16,
    ),
)
def test_a_group_priced_job_by_job_is_compute_time_bit_for_bit(
    name: str, profile: str, layer: int, specs: list[tuple[int, int, list[int]]]
) -> None:
    """Bottleneck grouping compares candidates' prices: the running price must be the whole group's
    to the last bit after every job added (token counts, contexts and shared experts at random)."""
    spec = load_model_spec(name)
    costs = CostModel(spec, load_profile(profile))
    layer = min(layer, spec.num_layers - 1)
    contexts = [context for _, context, _ in specs]
    group = GroupCost(costs, lambda job: contexts[job.request])
    tokens: list[int] = []
    seen: set[int] = set()
    for request, (num_tokens, _, picked) in enumerate(specs):
        experts = tuple({e % spec.num_experts for e in picked}) if layer != ENTRY_LAYER else ()
        group.add(Job(request, 0, layer, experts, lane=request, num_tokens=num_tokens))
        tokens.append(num_tokens)
        seen.update(experts)
        whole = costs.compute_time(layer, tokens, contexts[: request + 1], len(seen))
        assert group.seconds().hex() == whole.hex()


def test_a_group_priced_job_by_job_rejects_what_compute_time_rejects() -> None:
    costs = CostModel(*_toy())
    context = 5
    group = GroupCost(costs, lambda job: context)
    with pytest.raises(ValueError, match="at least one job"):
        group.seconds()
    with pytest.raises(ValueError, match="layer 4 out of range"):
        group.add(Job(0, 0, 4, (1,), lane=0))
    with pytest.raises(ValueError, match="token counts must be >= 1"):
        GroupCost(costs, lambda job: -1, [Job(0, 0, 1, (1,), lane=0)])
    GroupCost(costs, lambda job: context, [Job(0, 0, 1, tuple(range(8)), lane=0)]).seconds()
    group = GroupCost(costs, lambda job: context, [Job(r, 0, 1, (r,), lane=r) for r in range(9)])
    with pytest.raises(ValueError, match="distinct_experts 9"):
        group.seconds()
