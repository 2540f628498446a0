"""Groups computed on the event loop's thread (``InlineCompute``) while the link has nothing to read.

A real backend hands each group to its compute thread; while no read is in flight or waiting, the
scheduler asks it to compute a decode group on the loop's thread instead. These tests run a tiny
saved model through the runtime and watch every group: which path took it, what the link was doing
then, which thread ran it, and that the tokens are the compute thread's (and transformers').
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from runahead.actors.fetcher import ExpertFetcher
from runahead.backend import InlineCompute
from runahead.backends.torch import TorchBackend
from runahead.jobs import ExpertKey, Group, JobResult, RequestSpec
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams

from modelhelpers import EXPERTS, LAYERS, build_tiny_model, reference_greedy

TOKENS = 12
PROMPTS = [(5, 17, 42, 9), (3, 99, 7), (120, 4, 4, 66, 8, 31), (200,)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("inline"))
    return path, reference_greedy(path, PROMPTS, TOKENS)


class Watch:
    """Every group the backend computed: the path (inline or the thread), the thread that ran it,
    whether it held a prompt chunk, and whether a read was in flight when it was handed over."""

    def __init__(self, backend: TorchBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.groups: list[tuple[str, bool, bool, bool]] = []
        self.runtime: Runtime | None = None
        self.idle: list[bool] = []  # what the link said each time the scheduler asked
        loop_thread = threading.get_ident()
        inline, threaded = backend.compute_inline, backend.compute
        asked = ExpertFetcher.idle

        def idle(fetcher: ExpertFetcher) -> bool:
            self.idle.append(asked(fetcher))
            return self.idle[-1]

        monkeypatch.setattr(ExpertFetcher, "idle", idle)

        def reading() -> bool:  # a read in flight, or the link said it had work when last asked
            assert self.runtime is not None
            return bool(self.runtime.cache.pending_ids) or not self.idle[-1]

        def compute_inline(group: Group) -> list[JobResult]:
            self.groups.append(
                ("inline", threading.get_ident() == loop_thread, _has_prompt(group), reading())
            )
            return inline(group)

        async def compute(group: Group) -> Sequence[JobResult]:
            self.groups.append(("thread", False, _has_prompt(group), bool(self.idle) and reading()))
            return await threaded(group)

        backend.compute_inline = compute_inline  # type: ignore[method-assign]
        backend.compute = compute  # type: ignore[method-assign]

    def count(self, path: str) -> int:
        return sum(1 for group in self.groups if group[0] == path)


def _has_prompt(group: Group) -> bool:
    return any(job.prefill for job in group.jobs)


def _run(
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    slots: int,
    policy: str = "runahead",
    inline: bool = True,
    preload: bool = False,
) -> tuple[dict[int, list[int]], Watch, Runtime]:
    backend = TorchBackend.open(str(path), cache_slots=slots, store="disk")
    watch = Watch(backend, monkeypatch)
    runtime = Runtime(backend, RuntimeConfig(cache_slots=slots, policy=policy, inline_compute=inline))
    watch.runtime = runtime
    specs = [
        RequestSpec(i, TOKENS, prompt=prompt, sampling=SamplingParams(max_tokens=TOKENS))
        for i, prompt in enumerate(PROMPTS)
    ]

    async def main() -> dict[int, list[int]]:
        if preload:
            await runtime.preload(ExpertKey(layer, e) for layer in range(LAYERS) for e in range(EXPERTS))
        return await runtime.run(specs)

    try:
        tokens = asyncio.run(main())
    finally:
        backend.close()
    return tokens, watch, runtime


def test_the_torch_backend_computes_inline_and_mlx_does_not() -> None:
    assert issubclass(TorchBackend, InlineCompute)
    mlx_backend = pytest.importorskip("runahead.backends.mlx")  # MLX's streams are thread-local
    assert not issubclass(mlx_backend.MLXBackend, InlineCompute)


@pytest.mark.parametrize("policy", ["runahead", "sync", "runahead/grouping=opportunistic"])
def test_a_group_is_computed_on_the_loop_only_while_the_link_has_nothing_to_read(
    model: tuple[Path, list[list[int]]], policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = model
    tokens, watch, runtime = _run(
        path, monkeypatch, slots=6, policy=policy
    )  # 6 of 24 experts: reads all along
    assert tokens == dict(enumerate(expected))
    assert watch.count("inline") > 0 and watch.count("thread") > 0  # both paths taken
    for where, on_loop, prompt, reading in watch.groups:
        if where == "inline":  # on the loop's thread, a decode group, nothing to read
            assert on_loop and not prompt and not reading
        else:  # the thread took it only for a prompt chunk or a link with work
            assert prompt or reading
    assert runtime.recorder.inline_groups == watch.count("inline")


def test_every_decode_group_of_a_resident_model_is_computed_on_the_loop(
    model: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = model
    tokens, watch, runtime = _run(path, monkeypatch, slots=LAYERS * EXPERTS, preload=True)
    assert tokens == dict(enumerate(expected))
    assert runtime.cache.stats.misses == 0  # the preload read every expert: none was missing in the run
    assert watch.count("inline") > 0
    assert all(prompt for where, _, prompt, _ in watch.groups if where == "thread")  # prompts only
    assert all(not prompt for where, _, prompt, _ in watch.groups if where == "inline")


def test_inline_compute_off_keeps_every_group_on_the_compute_thread(
    model: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = model
    tokens, watch, runtime = _run(path, monkeypatch, slots=LAYERS * EXPERTS, preload=True, inline=False)
    assert tokens == dict(enumerate(expected))
    assert watch.count("inline") == 0 and runtime.recorder.inline_groups == 0
    assert watch.count("thread") == len(watch.groups) > 0


def test_the_loop_runs_other_tasks_between_inline_groups(model: tuple[Path, list[list[int]]]) -> None:
    path, _ = model
    backend = TorchBackend.open(str(path), cache_slots=LAYERS * EXPERTS, store="disk")
    runtime = Runtime(backend, RuntimeConfig(cache_slots=LAYERS * EXPERTS))
    seen: list[int] = []  # inline groups computed so far, each time the other task ran

    async def main() -> Any:
        await runtime.preload(ExpertKey(layer, e) for layer in range(LAYERS) for e in range(EXPERTS))
        done = False

        async def other() -> None:
            while not done:
                seen.append(runtime.recorder.inline_groups)
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(other())
        try:
            return await runtime.run([RequestSpec(0, TOKENS, prompt=PROMPTS[0])])
        finally:
            done = True
            await ticker

    try:
        asyncio.run(main())
    finally:
        backend.close()
    inline = runtime.recorder.inline_groups
    assert inline >= TOKENS  # one request, every expert resident: its decode groups ran inline
    # the other task ran between the groups, not only before and after them
    assert len(set(seen)) >= inline // 2
