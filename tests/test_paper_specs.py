"""The sim's model specs of the paper's models agree with what the torch backend parses from their configs.

Each spec in ``runahead/data/models`` cites the hub's ``config.json``; those configs (the text part,
in the hub's spelling) parse here into the layer layout the torch backend runs, which must be the
one the sim models: the same layers, experts, widths and heads, and the same layers full attention.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from runahead.models import get_architecture
from runahead.models.base import MoEConfig
from runahead.models.loader import read_headers, weight_files
from runahead.specs import load_model_spec

from modelhelpers import build_tiny_model

QWEN36: dict[str, Any] = {  # Qwen/Qwen3.6-35B-A3B, text_config
    "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "vocab_size": 248320, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "rms_norm_eps": 1e-06, "hidden_act": "silu", "attn_output_gate": True,
}  # fmt: skip
GEMMA4: dict[str, Any] = {  # google/gemma-4-26B-A4B, text_config
    "model_type": "gemma4_text", "hidden_size": 2816, "num_hidden_layers": 30, "intermediate_size": 2112,
    "moe_intermediate_size": 704, "num_experts": 128, "top_k_experts": 8, "enable_moe_block": True,
    "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2, "head_dim": 256,
    "global_head_dim": 512, "attention_k_eq_v": True, "sliding_window": 1024, "vocab_size": 262144,
    "tie_word_embeddings": True, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
}  # fmt: skip
GPT_OSS: dict[str, Any] = {  # openai/gpt-oss-20b
    "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "num_local_experts": 32,
    "experts_per_token": 4, "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "sliding_window": 128, "vocab_size": 201088, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "layer_types": ["sliding_attention", "full_attention"] * 12, "hidden_act": "silu",
}  # fmt: skip


@pytest.mark.parametrize(
    ("spec_name", "raw"),
    [("qwen3.6-35b-a3b", QWEN36), ("gemma4-26b-a4b", GEMMA4), ("gpt-oss-20b", GPT_OSS)],
)
def test_spec_matches_the_parsed_config(spec_name: str, raw: dict[str, Any]) -> None:
    spec = load_model_spec(spec_name)
    config: MoEConfig = get_architecture(raw["model_type"]).parse_config(raw)
    assert (config.num_layers, config.num_experts, config.top_k) == (
        spec.num_layers,
        spec.num_experts,
        spec.top_k,
    )
    assert (config.hidden_size, config.intermediate_size) == (spec.hidden_size, spec.expert_width)
    assert (config.num_attention_heads, config.num_kv_heads, config.head_dim) == (
        spec.num_attention_heads,
        spec.num_kv_heads,
        spec.head_dim,
    )
    assert config.shared_expert_size == spec.shared_expert_width
    assert getattr(config, "dense_mlp_size", 0) == spec.dense_mlp_width
    full = [kind == "full_attention" for kind in config.layer_types]
    assert full == [spec.is_full_attention(layer) for layer in range(spec.num_layers)]
    local = {kind for kind in config.layer_types if kind != "full_attention"}
    if spec.sliding_window:
        assert local == {"sliding_attention"} and config.sliding_window == spec.sliding_window
    else:
        assert local == {"linear_attention"}


def test_qwen36_recurrent_state_is_the_specs_size() -> None:
    config = get_architecture("qwen3_5_moe").parse_config(QWEN36)
    la = config.linear_attention
    assert la is not None and config.rotary_dim == 64 and config.rope_theta == 1e7
    conv = la.conv_channels * (la.conv_kernel - 1) * 4
    recurrent = la.value_heads * la.key_dim * la.value_dim * 4  # float32, as the runtime keeps it
    assert conv + recurrent == load_model_spec("qwen3.6-35b-a3b").linear_state_bytes


@pytest.mark.parametrize(("arch", "interval", "window"), [("gemma4", 2, 5), ("gpt_oss", 2, 4)])
def test_sim_spec_from_a_model_folder(arch: str, interval: int, window: int, tmp_path: Path) -> None:
    folder = build_tiny_model(arch, tmp_path / arch)
    spec = load_model_spec(folder)
    assert (spec.full_attention_interval, spec.sliding_window, spec.linear_state_bytes) == (
        interval,
        window,
        0,
    )
    infos = read_headers(weight_files(folder))
    stored = sum(math.prod(info.shape) for info in infos.values())
    assert abs(spec.total_params - stored) / stored < 0.02  # the final norm and gpt-oss's expert biases aside
    assert spec.bits_per_weight == 32.0  # the tiny models are saved in float32


def test_sim_spec_from_a_qwen36_folder_has_its_recurrent_state(tmp_path: Path) -> None:
    layers = ["linear_attention"] * 3 + ["full_attention"]
    folder = build_tiny_model("qwen3_5_moe", tmp_path / "q", layer_types=layers)
    spec = load_model_spec(folder)
    assert spec.full_attention_interval == 4 and spec.sliding_window == 0
    assert spec.linear_state_bytes == 4 * (4 * 8 * 12 + (2 * 2 * 8 + 4 * 12) * 2)  # recurrent + conv tail
    with pytest.raises(ValueError, match="is not one the sim models"):
        load_model_spec(
            build_tiny_model("qwen3_5_moe", tmp_path / "irregular")
        )  # linear, full, linear, linear


def test_sim_bench_runs_on_a_model_folder(tmp_path: Path) -> None:
    from runahead.cli import main

    folder = build_tiny_model("gpt_oss", tmp_path / "m")
    argv = ["bench", "--backend", "sim", "--model", str(folder), "--policy", "sync,runahead"]
    assert main([*argv, "--concurrency", "2", "--steps", "4", "--out", str(tmp_path / "out"), "--quiet"]) in (
        0,
        None,
    )
    assert (tmp_path / "out" / "results.jsonl").read_text().count("\n") == 2
