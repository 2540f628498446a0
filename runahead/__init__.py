"""runahead: runahead inference for mixture-of-experts models whose experts do not all fit on the device.

Requests whose experts are cached run ahead to later layers and reveal the experts they need next,
so the link fetches only experts known to be needed while the compute unit works on other
requests (the Bevy paper). Public names are imported lazily: ``import runahead`` pulls in neither
numpy nor torch nor mlx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Runtime": "runahead.runtime",
    "RuntimeConfig": "runahead.runtime",
    "SamplingParams": "runahead.sampling",
    "Engine": "runahead.engine",
    "RequestHandle": "runahead.runtime",
    "RequestSpec": "runahead.jobs",
    "ExpertKey": "runahead.jobs",
    "PolicyConfig": "runahead.policy",
    "parse_policy": "runahead.policy",
    "run_virtual": "runahead.clock",
    "Clock": "runahead.clock",
}

__all__ = [
    "Clock",
    "Engine",
    "ExpertKey",
    "PolicyConfig",
    "RequestHandle",
    "RequestSpec",
    "Runtime",
    "RuntimeConfig",
    "SamplingParams",
    "parse_policy",
    "run_virtual",
]

if TYPE_CHECKING:
    from runahead.clock import Clock, run_virtual
    from runahead.engine import Engine
    from runahead.jobs import ExpertKey, RequestSpec
    from runahead.policy import PolicyConfig, parse_policy
    from runahead.runtime import RequestHandle, Runtime, RuntimeConfig
    from runahead.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runahead' has no attribute {name!r}")
