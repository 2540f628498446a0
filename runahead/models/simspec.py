"""A sim :class:`~runahead.specs.ModelSpec` from a Hugging Face folder's ``config.json`` (no weights needed).

The torch backend and the sim then read one description of the model: the architecture's
:meth:`~runahead.models.description.ModelDescription.parse_config` gives the layer layout and shapes,
:meth:`~runahead.models.description.ModelDescription.weight_shapes` the exact non-expert parameters.
So ``runahead bench --backend sim --model <folder>`` simulates the model a user owns on a profile.
Weights are counted at the config's dtype (``torch_dtype`` / ``dtype``; bf16 if absent); a GGUF
file's routed experts at their stored type's bits per weight (Q4_0: 4.5), so a simulated fetch
moves the bytes the disk store reads.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from runahead.specs import ModelSpec

BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}


def spec_from_folder(path: str | Path) -> ModelSpec:
    """The sim's spec of the model in ``path`` (a folder with ``config.json``, or a ``.gguf`` file).

    Raises ``ValueError`` when the layer layout is not one the sim models (full-attention layers
    every ``n``-th layer, the others all sliding-window or all linear attention).
    """
    from runahead.models import get_architecture
    from runahead.models.loader import read_config, text_config

    raw = text_config(read_config(path))
    arch = get_architecture(str(raw.get("model_type")))
    config = arch.parse_config(raw)
    kinds = config.layer_types or ("full_attention",) * config.num_layers
    full = [k == "full_attention" for k in kinds]
    interval = next(
        (
            n
            for n in range(1, config.num_layers + 1)
            if full == [(i + 1) % n == 0 for i in range(config.num_layers)]
        ),
        None,
    )
    local = {k for k in kinds if k != "full_attention"}
    if interval is None or len(local) > 1:
        raise ValueError(f"{path}: layer layout {list(kinds)} is not one the sim models")
    la = config.linear_attention
    linear_state = 0
    if local == {"linear_attention"} and la is not None:
        linear_state = 4 * (
            la.value_heads * la.key_dim * la.value_dim + la.conv_channels * (la.conv_kernel - 1)
        )
    window = config.window(kinds.index("sliding_attention")) if "sliding_attention" in local else None
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    dense = int(getattr(config, "dense_mlp_size", 0))
    spec = ModelSpec(
        name=Path(path).name,
        num_layers=config.num_layers,
        num_experts=config.num_experts,
        top_k=config.top_k,
        hidden_size=config.hidden_size,
        expert_width=config.intermediate_size,
        vocab_size=config.vocab_size,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        bits_per_weight=float(raw.get("expert_bits_per_weight") or BITS.get(dtype, 16.0)),
        kv_bytes_per_element=BITS.get(dtype, 16.0) / 8,
        num_shared_experts=1 if config.shared_expert_size else 0,
        shared_expert_width=config.shared_expert_size,
        dense_mlp_width=dense,
        full_attention_interval=interval if local else 1,
        sliding_window=(window or 0) if local == {"sliding_attention"} else 0,
        linear_state_bytes=linear_state,
        sources=(f"{_source(path)} (parsed as {arch.model_type})",),
    )
    # Non-expert layer weights the head shape does not count (linear attention, norms, biases, gates).
    shapes = arch.weight_shapes(config)
    layer_params = sum(math.prod(s) for key, s in shapes.items() if key.split(".")[0].isdigit())
    modelled = config.num_layers * (spec.attention_params_per_layer + spec.ffn_shared_params_per_layer)
    other = max(0, round((layer_params - modelled) / config.num_layers))
    return replace(spec, other_params_per_layer=other)


def _source(path: str | Path) -> str:
    """Where the config was read: a GGUF's metadata or a folder's ``config.json``."""
    return f"{path} metadata" if str(path).endswith(".gguf") else str(Path(path) / "config.json")
