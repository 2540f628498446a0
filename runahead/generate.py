"""Generation with a real model: K concurrent copies of a prompt through the runtime.

What ``runahead generate`` calls. The engine API for async apps (streaming, continuous batching)
builds on the same pieces.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from runahead.runtime import Runtime
from runahead.sampling import SamplingParams


@dataclass(slots=True)
class Completion:
    """One request's result."""

    request: int
    token_ids: list[int]
    text: str | None


def generate(
    model: str,
    prompt: str | list[int],
    sampling: SamplingParams,
    *,
    policy: str = "runahead",
    device: str = "cpu",
    dtype: str = "auto",
    store: str = "disk",
    cache_fraction: float = 0.3,
    concurrency: int = 1,
    step_barrier: bool = True,
    record_trace: str | Path | None = None,
    on_text: Callable[[str], None] | None = None,
    timeline: str | Path | None = None,
    batch_invariant: bool = False,
) -> list[Completion]:
    """Run ``concurrency`` copies of the prompt at once; copy ``i`` samples with seed ``seed + i``.

    With ``on_text``, the first copy's text is passed along as it is generated.
    """
    from runahead.engine import Engine

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")

    async def run() -> list[Completion]:
        engine = await Engine.open(
            model,
            device=device,
            dtype=dtype,
            store=store,
            cache_fraction=cache_fraction,
            policy=policy,
            step_barrier=step_barrier,
            record_selections=bool(record_trace),
            keep_records=timeline is not None,
            batch_invariant=batch_invariant,
        )
        async with engine:
            ids = engine.encode(prompt)

            async def one(i: int) -> Completion:
                params = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
                tokens = []
                async for chunk in engine.generate(ids, params):
                    tokens.append(chunk.token_id)
                    if on_text is not None and i == 0:
                        on_text(chunk.text)
                text = engine.decode(tokens) if engine.tokenizer is not None else None
                return Completion(i, tokens, text)

            completions = list(await asyncio.gather(*(one(i) for i in range(concurrency))))
            if record_trace:
                save_trace(engine.runtime, record_trace, model=Path(model).name)
            if timeline is not None:
                from runahead.timeline import write_chrome_trace

                write_chrome_trace(engine.runtime.recorder, timeline)
            return completions

    return asyncio.run(run())


def save_trace(runtime: Runtime, path: str | Path, *, model: str = "") -> None:
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
    num_experts = runtime.backend.model.config.num_experts  # type: ignore[attr-defined]
    RoutingTrace.from_selections(selections, num_experts, model=model).save(path)
