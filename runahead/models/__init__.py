"""MoE model architectures split into the runtime's jobs, and their loader.

``runahead.models.layout`` is plain data (no torch); everything else here needs torch and is
imported lazily, so importing this package (or the layout) stays light. Architectures are found
by the ``model_type`` of a ``config.json`` through :data:`ARCHITECTURES`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runahead.models.base import MoEModel

ARCHITECTURES: dict[str, str] = {
    "qwen3_moe": "runahead.models.qwen3_moe:Qwen3MoeModel",
    "mixtral": "runahead.models.mixtral:MixtralModel",
    "olmoe": "runahead.models.olmoe:OlmoeModel",
    "qwen2_moe": "runahead.models.qwen2_moe:Qwen2MoeModel",
    "qwen3_5_moe": "runahead.models.qwen3_5_moe:Qwen3_5MoeModel",
    "qwen3_5_moe_text": "runahead.models.qwen3_5_moe:Qwen3_5MoeModel",
    "gemma4": "runahead.models.gemma4:Gemma4Model",
    "gemma4_text": "runahead.models.gemma4:Gemma4Model",
    "gpt_oss": "runahead.models.gpt_oss:GptOssModel",
}
"""``model_type`` -> ``"module:class"`` of its :class:`~runahead.models.base.MoEModel` subclass."""

_LAZY = {
    "MoEConfig": "runahead.models.base",
    "MoEModel": "runahead.models.base",
    "KVCache": "runahead.models.base",
    "RequestState": "runahead.models.state",
    "ModelLoadError": "runahead.models.base",
    "load_model": "runahead.models.loader",
    "load_reference_slot": "runahead.models.loader",
    "load_tokenizer": "runahead.models.loader",
    "ExpertLayout": "runahead.models.layout",
    "TensorRange": "runahead.models.layout",
}

__all__ = ["ARCHITECTURES", "get_architecture", *_LAZY]


def get_architecture(model_type: str) -> type[MoEModel]:
    """The model class for ``model_type``; :class:`ModelLoadError` naming the supported ones if unknown."""
    target = ARCHITECTURES.get(model_type)
    if target is None:
        from runahead.models.base import ModelLoadError

        raise ModelLoadError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    module, name = target.split(":")
    cls: type[MoEModel] = getattr(import_module(module), name)
    return cls


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runahead.models' has no attribute {name!r}")
