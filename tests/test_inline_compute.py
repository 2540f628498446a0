"""Groups computed on the event loop's thread (``InlineCompute``) once the link has started its reads.

A real backend hands each group to its compute thread; once every read the link can start has
started (reads may still be in flight: they land on the store's threads), the scheduler asks it to
compute a decode group on the loop's thread instead. These tests run a tiny saved model through the
runtime and watch every group: which path took it, what the link was doing then, which thread ran
it, and that the tokens are the compute thread's (and transformers'); and that a read landing
during such a group is recorded when its reader saw it land, not when the loop took it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from runahead.actors.fetcher import ExpertFetcher
from runahead.backend import InlineCompute
from runahead.backends.torch import TorchBackend
from runahead.jobs import ExpertKey, Group, JobResult, RequestSpec
from runahead.metrics import Recorder
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
    whether it held a prompt chunk, whether the link had a read still to start when it was handed
    over, and whether a read was in flight then."""

    def __init__(self, backend: TorchBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.groups: list[tuple[str, bool, bool, bool, bool]] = []
        self.runtime: Runtime | None = None
        self.settled: list[bool] = []  # what the link said each time the scheduler asked
        loop_thread = threading.get_ident()
        inline, threaded = backend.compute_inline, backend.compute
        asked = ExpertFetcher.settled

        def settled(fetcher: ExpertFetcher) -> bool:
            self.settled.append(asked(fetcher))
            return self.settled[-1]

        monkeypatch.setattr(ExpertFetcher, "settled", settled)

        def to_start() -> bool:  # the link said it had a read to start when last asked
            return bool(self.settled) and not self.settled[-1]

        def in_flight() -> bool:
            assert self.runtime is not None
            return bool(self.runtime.cache.pending_ids)

        def compute_inline(group: Group) -> list[JobResult]:
            on_loop = threading.get_ident() == loop_thread
            self.groups.append(("inline", on_loop, _has_prompt(group), to_start(), in_flight()))
            return inline(group)

        async def compute(group: Group) -> Sequence[JobResult]:
            self.groups.append(("thread", False, _has_prompt(group), to_start(), in_flight()))
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
def test_a_group_is_computed_on_the_loop_only_once_the_link_has_started_its_reads(
    model: tuple[Path, list[list[int]]], policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = model
    tokens, watch, runtime = _run(
        path, monkeypatch, slots=6, policy=policy
    )  # 6 of 24 experts: reads all along
    assert tokens == dict(enumerate(expected))
    assert watch.count("inline") > 0 and watch.count("thread") > 0  # both paths taken
    for where, on_loop, prompt, to_start, _ in watch.groups:
        if where == "inline":  # on the loop's thread, a decode group, every read started
            assert on_loop and not prompt and not to_start
        else:  # the thread took it only for a prompt chunk or a link with a read to start
            assert prompt or to_start
    assert runtime.recorder.inline_groups == watch.count("inline")


def test_reads_landing_during_an_inline_group_end_when_they_landed(
    model: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read in flight while the loop computes a group lands on the store's thread; the loop takes
    it after the group, but the read's record (and the link's busy time) ends when it landed."""
    taken: list[tuple[float, float]] = []  # (the record's end, when the loop recorded it)
    record = Recorder.fetch

    def fetch(recorder: Recorder, start: float, end: float, key: ExpertKey, prefetch: bool) -> None:
        taken.append((end, time.monotonic()))
        record(recorder, start, end, key, prefetch)

    monkeypatch.setattr(Recorder, "fetch", fetch)
    path, expected = model
    tokens, watch, runtime = _run(path, monkeypatch, slots=6)
    assert tokens == dict(enumerate(expected))
    assert any(where == "inline" and in_flight for where, *_, in_flight in watch.groups)
    assert all(f.start <= f.end for f in runtime.recorder.fetches)
    assert all(end <= at for end, at in taken)
    # a read that landed during an inline group was taken after the group: its end is its landing
    inline_spans = [(c.start, c.end) for c in runtime.recorder.computes]
    late = [(end, at) for end, at in taken if any(s < end < e < at for s, e in inline_spans)]
    assert late


def test_every_decode_group_of_a_resident_model_is_computed_on_the_loop(
    model: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = model
    tokens, watch, runtime = _run(path, monkeypatch, slots=LAYERS * EXPERTS, preload=True)
    assert tokens == dict(enumerate(expected))
    assert runtime.cache.stats.misses == 0  # the preload read every expert: none was missing in the run
    assert watch.count("inline") > 0
    assert all(prompt for where, _, prompt, *_ in watch.groups if where == "thread")  # prompts only
    assert all(not prompt for where, _, prompt, *_ in watch.groups if where == "inline")


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
