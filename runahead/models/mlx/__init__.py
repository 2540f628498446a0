"""MoE architectures on MLX: the compute of :mod:`runahead.models` for the ``mlx`` backend.

The architectures' descriptions (config parsing, weight names) are the same classes the torch
models use (:func:`runahead.models.get_architecture`); this package adds MLX compute beside them,
one file per architecture over a shared :mod:`runahead.models.mlx.base`. Expert weights reach the
compute only as slot pools (:mod:`runahead.models.mlx.slots`); checkpoints (Hugging Face folders
and mlx-lm's own quantized format) load through :mod:`runahead.models.mlx.checkpoint`. Importing
this package imports MLX.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runahead.models.mlx.base import MLXModel

MLX_ARCHITECTURES: dict[str, str] = {
    "qwen3_moe": "runahead.models.mlx.qwen3_moe:Qwen3MoeMLX",
    "mixtral": "runahead.models.mlx.mixtral:MixtralMLX",
    "olmoe": "runahead.models.mlx.olmoe:OlmoeMLX",
    "qwen2_moe": "runahead.models.mlx.qwen2_moe:Qwen2MoeMLX",
    "qwen3_5_moe": "runahead.models.mlx.qwen3_5_moe:Qwen3_5MoeMLX",
    "qwen3_5_moe_text": "runahead.models.mlx.qwen3_5_moe:Qwen3_5MoeMLX",
    "gemma4": "runahead.models.mlx.gemma4:Gemma4MLX",
    "gemma4_text": "runahead.models.mlx.gemma4:Gemma4MLX",
    "gpt_oss": "runahead.models.mlx.gpt_oss:GptOssMLX",
}
"""``model_type`` -> ``"module:class"`` of its :class:`~runahead.models.mlx.base.MLXModel`."""


def mlx_architecture(model_type: str) -> type[MLXModel]:
    """The MLX model class for ``model_type``; ``ModelLoadError`` naming the supported ones if absent."""
    target = MLX_ARCHITECTURES.get(model_type)
    if target is None:
        from runahead.models.description import ModelLoadError

        raise ModelLoadError(
            f"model_type {model_type!r} has no MLX implementation yet; the mlx backend runs: "
            f"{', '.join(sorted(MLX_ARCHITECTURES))} (the torch backend runs more)"
        )
    module, name = target.split(":")
    cls: type[MLXModel] = getattr(import_module(module), name)
    return cls
