"""Generation with a real model: K concurrent copies of a prompt through the runtime.

What ``runahead generate`` calls. The engine API for async apps (streaming, continuous batching)
builds on the same pieces.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runahead.jobs import RequestSpec
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams


@dataclass(slots=True)
class Completion:
    """One request's result."""

    request: int
    token_ids: list[int]
    text: str | None


def generate(
    model: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    policy: str = "runahead",
    device: str = "cpu",
    store: str = "disk",
    cache_fraction: float = 0.3,
    concurrency: int = 1,
    step_barrier: bool = True,
    record_trace: str | Path | None = None,
    tokenizer: Any = None,
) -> list[Completion]:
    """Run ``concurrency`` copies of the prompt at once; copy ``i`` samples with seed ``seed + i``."""
    from runahead.backends.torch import TorchBackend
    from runahead.models.loader import read_config

    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not 0 < cache_fraction <= 1:
        raise ValueError(f"cache fraction must lie in (0, 1], got {cache_fraction}")
    config = read_config(model)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    top_k = int(config["num_experts_per_tok"])
    slots = max(top_k, round(cache_fraction * config["num_hidden_layers"] * experts))
    backend = TorchBackend.open(model, cache_slots=slots, device=device, store=store)  # type: ignore[arg-type]
    runtime = Runtime(
        backend,
        RuntimeConfig(
            cache_slots=slots, policy=policy, step_barrier=step_barrier, record_selections=bool(record_trace)
        ),
    )
    specs = []
    for i in range(concurrency):
        params = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
        specs.append(
            RequestSpec(
                i,
                sampling.max_tokens,
                prompt=tuple(prompt_ids),
                sampling=params,
                stop_tokens=sampling.stop_token_ids,
            )
        )
    try:
        tokens = asyncio.run(runtime.run(specs))
    finally:
        backend.close()
    if record_trace:
        save_trace(runtime, experts, record_trace, model=Path(model).name)
    return [
        Completion(i, tokens[i], tokenizer.decode(tokens[i]) if tokenizer is not None else None)
        for i in range(concurrency)
    ]


def save_trace(runtime: Runtime, num_experts: int, path: str | Path, *, model: str = "") -> None:
    """Write the experts each request selected at each decode step and layer as a routing trace file.

    Prefill passes are left out: a prompt chunk selects the union of its tokens' experts.
    """
    from runahead.trace import RoutingTrace

    layers = runtime.backend.num_layers
    selections = []
    for request in sorted(runtime.recorder.selections):
        steps: dict[int, list[tuple[int, ...]]] = {}
        for step, layer, experts in runtime.recorder.selections[request]:
            steps.setdefault(step, [()] * layers)[layer] = experts
        selections.append([steps[s] for s in sorted(steps)])
    if not selections or not any(selections):
        raise ValueError("no decode step was recorded: the trace needs at least two generated tokens")
    RoutingTrace.from_selections(selections, num_experts, model=model).save(path)
