"""Tiny random MoE models built with ``transformers`` and saved in the real file formats.

Nothing is downloaded: each helper builds a model from a small config, scales its router up so
routing varies from token to token (see FACTS.md), and saves it with ``save_pretrained`` together
with a small word-level tokenizer, so the folder loads offline like a hub checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runahead.models.base import KVCache, MoEModel
from runahead.models.layout import ExpertLayout
from runahead.models.loader import load_reference_slot

ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "qwen3_5_moe")

HIDDEN = 64
EXPERT_WIDTH = 24  # 2 * I != H, so a transposed stacked tensor cannot pass for the right one
LAYERS = 3
EXPERTS = 8
VOCAB = 256

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": EXPERTS,
        "moe_intermediate_size": EXPERT_WIDTH,
        "intermediate_size": 96,
        "norm_topk_prob": True,
    },
    "mixtral": {"num_local_experts": EXPERTS, "intermediate_size": EXPERT_WIDTH, "sliding_window": 6},
    "olmoe": {"num_experts": EXPERTS, "intermediate_size": EXPERT_WIDTH, "clip_qkv": 3.0},
    "qwen2_moe": {
        "num_experts": EXPERTS,
        "moe_intermediate_size": EXPERT_WIDTH,
        "intermediate_size": 96,
        "shared_expert_intermediate_size": 40,
        "norm_topk_prob": False,
    },
    "qwen3_5_moe": {  # shapes unlike the others': 2 heads of 32, a linear last layer, v heads 2x k heads
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "num_hidden_layers": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 3,
        "num_experts": EXPERTS,
        "moe_intermediate_size": EXPERT_WIDTH,
        "shared_expert_intermediate_size": 40,
    },
}

HF_MODEL_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}
"""The ``model_type`` transformers builds the text-only model under, where it differs from ours."""

ROUTER_SCALE = 8.0
"""How much the router weights are scaled up: random routers are nearly uniform otherwise."""


def _hf_config(arch: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        HF_MODEL_TYPE.get(arch, arch), **{**_COMMON, **_ARCH_CONFIG[arch], **overrides}
    )


def build_tiny_model(
    arch: str,
    path: str | Path,
    *,
    stacked: bool = False,
    sharded: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Build a tiny random ``arch`` model and save it (weights, config, tokenizer) into ``path``.

    ``stacked`` writes transformers' fused expert tensors (``save_original_format=False``) instead
    of the hub's per-expert names; ``sharded`` splits the weights over several files with an index.
    ``overrides`` change config fields. Returns ``path``.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(ROUTER_SCALE)
    model = model.to(dtype)
    kwargs: dict[str, Any] = {"max_shard_size": "60KB"} if sharded else {}
    if stacked:
        kwargs["save_original_format"] = False
    model.save_pretrained(path, **kwargs)
    save_tiny_tokenizer(path)
    return path


def save_tiny_tokenizer(path: str | Path) -> None:
    """Save a word-level tokenizer over a small fixed vocabulary into ``path`` (loads offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(path))


def reference_logits(path: str | Path, tokens: Sequence[int]) -> torch.Tensor:
    """``transformers``' own float32 logits ``[len(tokens), vocab]`` for ``tokens`` as one sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0]


def slots_for(layout: ExpertLayout, layer: int, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Reference cache slots of every expert in ``ids`` at ``layer``, read from the files."""
    return {int(e): load_reference_slot(layout, layer, int(e)) for e in torch.unique(ids).tolist()}


def run_jobs(
    model: MoEModel,
    layout: ExpertLayout,
    requests: Sequence[tuple[KVCache, Sequence[int]]],
) -> list[torch.Tensor]:
    """Run one batch of tokens through every job, as the runtime does; return per-request logits.

    ``requests`` pairs each request's cache with the tokens it adds now (a prefill run or one
    decode token); they are batched in one call per job. Experts come from reference slots.
    """
    segments = [(cache, cache.length, len(tokens)) for cache, tokens in requests]
    flat = torch.tensor([t for _, tokens in requests for t in tokens], dtype=torch.long)
    hidden = model.attention(0, model.embed(flat), segments)
    ids, weights = model.route(0, hidden)
    for layer in range(model.config.num_layers):
        hidden = model.moe(layer, hidden, ids, weights, slots_for(layout, layer, ids))
        if layer + 1 < model.config.num_layers:
            hidden = model.attention(layer + 1, hidden, segments)
            ids, weights = model.route(layer + 1, hidden)
    logits = model.logits(hidden)
    sizes = [len(tokens) for _, tokens in requests]
    return list(torch.split(logits, sizes))
