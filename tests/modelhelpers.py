"""Tiny random MoE models built with ``transformers`` and saved in the real file formats.

Nothing is downloaded: each helper builds a model from a small config, scales its router up so
routing varies from token to token (see FACTS.md), and saves it with ``save_pretrained`` together
with a small word-level tokenizer, so the folder loads offline like a hub checkpoint.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runahead.models.base import KVCache, MoEModel
from runahead.models.layout import ExpertLayout
from runahead.models.loader import load_reference_slot

ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "qwen3_5_moe", "gemma4", "gpt_oss")
PAPER_ARCHS = ("qwen3_5_moe", "gemma4", "gpt_oss")
"""The paper's models and gpt-oss: architectures whose constant-initialised weights get randomised."""

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
    "gemma4": {  # sliding layers: 2 KV heads of 12; global layers: 1 KV head of 24 (K = V), 3 of 4 slide
        "hidden_size": 48,
        "head_dim": 12,
        "global_head_dim": 24,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_hidden_layers": 4,
        "sliding_window": 5,
        "intermediate_size": 40,
        "enable_moe_block": True,
        "num_experts": EXPERTS,
        "top_k_experts": 2,
        "moe_intermediate_size": EXPERT_WIDTH,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 30.0,
        "pad_token_id": 0,
    },
    "gpt_oss": {  # 6 heads of 8 over 2 KV heads, 6 experts, YaRN RoPE (the default), a clamp that bites
        "hidden_size": 40,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 6,
        "intermediate_size": EXPERT_WIDTH,
        "sliding_window": 4,
        "swiglu_limit": 0.8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
    },
}

HF_MODEL_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text"}
"""The ``model_type`` transformers builds the text-only model under, where it differs from ours."""

ROUTER_SCALE = 8.0
"""How much the router weights are scaled up: random routers are nearly uniform otherwise."""

PERTURBED = ("norm", "layer_scalar", "router.scale", "per_expert_scale", "dt_bias", "A_log", "bias", "sinks")
"""Parameters transformers initialises to constants (norms at 1 or 0, scales at 1); the paper's
architectures get them randomised, so a weight read wrongly (or not at all) changes the output."""


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
            if name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "router.proj.weight", "router.weight")
            ):
                param.mul_(ROUTER_SCALE)
            elif arch in PAPER_ARCHS and any(part in name for part in PERTURBED):
                param.add_(torch.rand_like(param) * 0.6 - 0.3)
        for name, buffer in model.named_buffers():
            if arch in PAPER_ARCHS and name.endswith("layer_scalar"):
                buffer.uniform_(0.7, 1.3)
    model = model.to(dtype)
    kwargs: dict[str, Any] = {"max_shard_size": "60KB"} if sharded else {}
    if stacked:
        kwargs["save_original_format"] = False
    model.save_pretrained(path, **kwargs)
    save_tiny_tokenizer(path)
    return path


def float32_expert_bytes(path: str | Path) -> int:
    """Bytes of one routed expert of the model at ``path`` in float32 (gate, up and down)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return 3 * config["hidden_size"] * config["moe_intermediate_size"] * 4


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


def reference_greedy(
    path: str | Path, prompts: Sequence[Sequence[int]], tokens: int, *, eos: int | None = None
) -> list[list[int]]:
    """``transformers``' own greedy continuation of each prompt: ``tokens`` new tokens (float32).

    With ``eos`` a continuation stops after that token (as a server stopping at end-of-sequence
    does); without, it runs the full length (as the runtime does without stop tokens).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    stop: dict[str, Any] = {"eos_token_id": eos} if eos is not None else {"min_new_tokens": tokens}
    continuations = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, **stop
            )
            continuation = out[0, len(prompt) :].tolist()
            if eos is not None and eos in continuation:
                continuation = continuation[: continuation.index(eos) + 1]
            continuations.append(continuation)
    return continuations


def reference_logits(path: str | Path, tokens: Sequence[int]) -> torch.Tensor:
    """``transformers``' own float32 logits ``[len(tokens), vocab]`` for ``tokens`` as one sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0]


def random_moe_inputs(
    model: Any, layout: ExpertLayout, layer: int, rows: int = 12
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """``(hidden, ids, weights, experts)`` for ``model.moe_partial(layer, ...)``: ``rows`` random rows,
    each routed to ``top_k`` random experts with softmax weights, and every expert's reference slot."""
    c = model.config
    torch.manual_seed(0)
    hidden = torch.randn(rows, c.hidden_size)
    ids = torch.stack([torch.randperm(c.num_experts)[: c.top_k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, c.top_k), dim=-1)
    experts = {e: load_reference_slot(layout, layer, e) for e in range(c.num_experts)}
    return hidden, ids, weights, experts


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


EXACTNESS_PROMPTS = [[5, 17, 42, 9], [3, 99, 7], [120, 4, 4, 66, 8, 31], [200], [11, 12, 13], [77, 78]]
"""Prompts :func:`compare_with_transformers` runs (token ids of the tiny models' vocabulary)."""


def transformers_logits(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """A loaded ``transformers`` model's float32 logits ``[len(tokens), vocab]`` for one sequence."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([list(tokens)], device=device)).logits[0].float().cpu()


def compare_with_transformers(
    path: str | Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    policy: str = "runahead",
    requests: int = 4,
    tokens: int = 16,
    slots: int = 8,
    store: str = "disk",
    chunk: int = 256,
    grouped: bool | None = None,
) -> dict[str, Any]:
    """Run ``requests`` prompts at once through the runtime on ``device`` in ``dtype`` (``slots``
    cache slots, so experts are evicted and refetched) and ``transformers`` on the same device.

    Returns ``tokens_equal`` (every request's greedy tokens equal ``transformers``' ``generate`` in
    the same dtype), ``first_divergence`` (the earliest generated position where they differ, or
    None), ``logit_error`` (max |ours - transformers float32| over the generated steps, teacher-forced
    on our own tokens) and ``reference_error`` (the same for ``transformers`` in ``dtype``: how far
    that dtype alone moves the logits). In float32 ``reference_error`` is 0. ``logit_mean_error`` and
    ``reference_mean_error`` are the same as mean absolute differences (steadier than the max).
    """
    import asyncio

    from transformers import AutoModelForCausalLM

    from runahead.backends.torch import TorchBackend
    from runahead.jobs import RequestSpec
    from runahead.runtime import Runtime, RuntimeConfig
    from runahead.sampling import SamplingParams

    prompts = EXACTNESS_PROMPTS[:requests]
    backend = TorchBackend.open(
        str(path),
        cache_slots=slots,
        device=device,
        store=store,
        dtype=dtype,
        keep_logits=True,  # type: ignore[arg-type]
    )
    if grouped is not None:  # the experts' grouped products over the slot pool, on or off (pooled.py)
        backend.model.use_slot_pool(backend.slots.data, grouped=grouped)
    runtime = Runtime(backend, RuntimeConfig(cache_slots=slots, policy=policy, prefill_chunk=chunk))
    specs = [
        RequestSpec(i, tokens, prompt=tuple(p), sampling=SamplingParams(max_tokens=tokens))
        for i, p in enumerate(prompts)
    ]
    logits: dict[int, torch.Tensor] = {}
    close = backend.close_request

    def keep(request: int) -> None:
        if request in backend._requests:
            logits[request] = torch.stack(backend.logits_of(request)).float().cpu()
        close(request)

    backend.close_request = keep  # type: ignore[method-assign]
    try:
        ours = asyncio.run(runtime.run(specs))
    finally:
        backend.close()

    def load(kind: torch.dtype) -> Any:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=kind, attn_implementation="eager")
        return model.to(device).eval()

    same, exact = load(dtype), load(torch.float32)
    # the runtime does not stop at EOS, so neither may the reference (min_new_tokens would instead
    # forbid EOS, changing the argmax wherever the greedy choice is EOS)
    same.generation_config.eos_token_id = None
    divergence: int | None = None
    logit_error = reference_error = 0.0
    ours_diffs, reference_diffs = [], []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            mask = torch.ones_like(ids)
            out = same.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False)
        theirs = out[0, len(prompt) :].tolist()
        differ = [t for t, (a, b) in enumerate(zip(ours[i], theirs, strict=True)) if a != b]
        if differ and (divergence is None or differ[0] < divergence):
            divergence = differ[0]
        sequence = list(prompt) + ours[i]
        window = slice(len(prompt) - 1, len(sequence) - 1)
        truth = transformers_logits(exact, sequence)[window]
        ours_diffs.append((logits[i] - truth).abs().flatten())
        reference_diffs.append((transformers_logits(same, sequence)[window] - truth).abs().flatten())
        logit_error = max(logit_error, ours_diffs[-1].max().item())
        reference_error = max(reference_error, reference_diffs[-1].max().item())
    return {
        "tokens_equal": divergence is None,
        "first_divergence": divergence,
        "logit_error": logit_error,
        "reference_error": reference_error,
        "logit_mean_error": torch.cat(ours_diffs).mean().item(),
        "reference_mean_error": torch.cat(reference_diffs).mean().item(),
        "requests": len(prompts),
        "tokens": tokens,
    }


class TorchCalls(TorchDispatchMode):
    """Counts the torch operators run under it (``calls``, by operator): a group's host work on a GPU,
    where each call is a launch (tests/test_pooled.py, bench/group_calls.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))
