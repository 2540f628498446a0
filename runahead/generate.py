"""Generation with a real model: K concurrent copies of a prompt through the runtime.

What ``runahead generate`` calls. The engine API for async apps (streaming, continuous batching)
builds on the same pieces.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from runahead import loops
from runahead.runtime import Runtime
from runahead.sampling import SamplingParams
from runahead.specs import ModelSpec

if TYPE_CHECKING:
    pass


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
    backend: str = "torch",
    link_bandwidth: float | None = None,
    threads: int | str = "auto",
    reads_in_flight: int | None = None,
    inline_compute: bool = True,
) -> list[Completion]:
    """Run ``concurrency`` copies of the prompt at once; copy ``i`` samples with seed ``seed + i``.

    With ``on_text``, the first copy's text is passed along as it is generated. ``backend``: ``torch``
    or ``mlx``. ``link_bandwidth``, ``threads``, ``reads_in_flight`` (None: the default) and
    ``inline_compute``: as for
    :meth:`runahead.engine.Engine.open`.
    """
    from runahead.engine import Engine

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")

    async def run() -> list[Completion]:
        engine = await Engine.open(
            model,
            backend=backend,
            device=device,
            dtype=dtype,
            store=store,
            cache_fraction=cache_fraction,
            policy=policy,
            step_barrier=step_barrier,
            record_selections=bool(record_trace),
            keep_records=timeline is not None,
            batch_invariant=batch_invariant,
            link_bandwidth=link_bandwidth,
            threads=threads,
            reads_in_flight=reads_in_flight,
            inline_compute=inline_compute,
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
                save_trace(engine.runtime, record_trace, model=Path(model).name, folder=model)
            if timeline is not None:
                from runahead.timeline import write_chrome_trace

                write_chrome_trace(engine.runtime.recorder, timeline)
            return completions

    return loops.run(run())


def save_trace(
    runtime: Runtime, path: str | Path, *, model: str = "", folder: str | Path | None = None
) -> None:
    """Write the experts each request selected at each decode step and layer as a routing trace file.

    With the model's ``folder``, the trace also carries its :class:`~runahead.specs.ModelSpec`, so
    ``runahead bench --trace`` replays it on the sim without a hand-written spec.
    """
    from runahead.trace import RoutingTrace

    config = runtime.backend.model.config  # type: ignore[attr-defined]
    spec = recorded_spec(folder, model) if folder is not None else None
    trace = RoutingTrace.from_recorder(
        runtime.recorder.selections, runtime.backend.num_layers, config.num_experts, model=model, spec=spec
    )
    trace.save(path)


def recorded_spec(folder: str | Path, name: str) -> ModelSpec:
    """The :class:`~runahead.specs.ModelSpec` of a recorded model: its shape and its files' precision,
    as the sim parses it (:func:`runahead.models.simspec.spec_from_folder`), under ``name``."""
    from runahead.models.simspec import spec_from_folder

    spec = spec_from_folder(folder)
    return replace(
        spec, name=name, sources=tuple(f"recorded by runahead generate from {s}" for s in spec.sources)
    )
