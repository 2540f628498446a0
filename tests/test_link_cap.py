"""The link cap (:class:`runahead.store.LinkCap`): every read of a store paced to a serial link of a
given bandwidth, through the real read path, with its bytes intact and the tokens unchanged."""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.store import DiskStore, HostStore, LinkCap, SlotPool, make_store

from storehelpers import layout_from_safetensors, o_direct_dir, write_experts

LAYERS, EXPERTS, H, INTER = 2, 4, 64, 32
EXPERT_BYTES = 3 * H * INTER * 4  # float32 gate, up and down


def test_reads_queue_on_one_link_in_the_order_they_start() -> None:
    cap = LinkCap(1000.0)  # bytes per second
    assert cap.reserve(500, now=0.0) == 0.5
    assert cap.reserve(500, now=0.1) == 1.0  # behind the first read, not beside it
    assert cap.reserve(250, now=0.2) == 1.25
    assert cap.reserve(100, now=5.0) == pytest.approx(5.1)  # an idle link carries it at once


@pytest.mark.parametrize("bad", [0.0, -1e9, math.inf, math.nan, "1e9", True])
def test_a_link_without_a_positive_finite_bandwidth_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="link bandwidth must be a positive number of bytes per second"):
        LinkCap(bad)


@pytest.fixture
def experts(tmp_path: Path) -> Iterator[tuple[object, dict[tuple[int, int], torch.Tensor]]]:
    where = o_direct_dir(tmp_path) or tmp_path  # buffered reads elsewhere: the cap paces them alike
    paths, expected = write_experts(where, layers=LAYERS, experts=EXPERTS, hidden=H, inter=INTER)
    yield layout_from_safetensors(paths, layers=LAYERS, experts=EXPERTS, hidden=H, inter=INTER), expected
    if where != tmp_path:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("kind", ["disk", "host"])
async def test_capped_reads_take_the_links_time_and_keep_their_bytes(experts: tuple, kind: str) -> None:
    layout, expected = experts
    bandwidth = 40 * EXPERT_BYTES  # 25 ms an expert: far slower than this machine's disk or memory
    keys = sorted(layout.ranges)
    loop = asyncio.get_running_loop()
    done: list[float] = []
    with make_store(kind, layout, link_bandwidth=bandwidth) as store:
        assert "link capped at" in repr(store)
        pool = SlotPool(len(keys), layout.slot_numel)

        async def read(i: int, key: tuple[int, int]) -> None:
            await store.read_into(*key, pool.slot(i))
            done.append(loop.time())

        start = loop.time()
        await asyncio.gather(*(read(i, key) for i, key in enumerate(keys)))  # two in flight at a time
        for i, key in enumerate(keys):
            assert torch.equal(pool.slot(i), expected[key])
        assert store.bytes_read == len(keys) * EXPERT_BYTES
    # one link: the n-th read to finish cannot finish before n experts' worth of link time
    for n, at in enumerate(sorted(done), start=1):
        assert at - start >= n * EXPERT_BYTES / bandwidth - 1e-6


def _loop_factories() -> list[Any]:
    """asyncio's loop, and uvloop's where it is installed (its clock and timers count whole ms)."""
    from runahead.loops import loop_factory

    return [None, *([loop_factory()] if loop_factory() is not None else [])]


@pytest.mark.parametrize("factory", _loop_factories(), ids=lambda f: "asyncio" if f is None else "uvloop")
@pytest.mark.parametrize("native", [True, False], ids=["c-readers", "python-threads"])
def test_a_read_on_an_idle_link_never_lands_before_its_link_time(
    experts: tuple, factory: Any, native: bool
) -> None:
    """A link time between two whole milliseconds, one read at a time (the link idle before each):
    every read lands no earlier than its bytes could cross, on any loop. Paced by the event loop,
    uvloop's millisecond clock and timers landed such reads up to 0.7 of their link time early."""
    from runahead.store.native import available

    if native and not available():
        pytest.skip("the C readers do not build here")
    layout, expected = experts
    link_time = 0.0014
    key = sorted(layout.ranges)[0]

    async def main() -> list[float]:
        took = []
        with HostStore(layout, link_bandwidth=EXPERT_BYTES / link_time, native=native) as store:
            pool = SlotPool(1, layout.slot_numel)
            for i in range(30):
                start = time.monotonic()
                landed = await store.read_into(*key, pool.slot(0))
                took.append(time.monotonic() - start)
                # dated by its reader, on the runtime's clock: after its link time, before the loop took it
                assert start + link_time - 1e-6 <= landed <= start + took[-1]
                spin = time.perf_counter()  # start the next read at another point of the millisecond
                while time.perf_counter() - spin < 0.0001 * (i % 9):
                    pass
            assert torch.equal(pool.slot(0), expected[key])
        return took

    with asyncio.Runner(loop_factory=factory) as runner:
        took = runner.run(main())
    assert min(took) >= link_time - 1e-6, sorted(took)[:3]


async def test_without_a_cap_nothing_is_paced(experts: tuple) -> None:
    layout, _ = experts
    for store in (DiskStore(layout), HostStore(layout)):
        with store:
            assert store._executor.link is None and "capped" not in repr(store)


def test_a_capped_bench_point_computes_the_same_tokens_and_every_read_takes_the_links_time(
    tmp_path: Path,
) -> None:
    from runahead.torchbench import TorchPoint, run_torch_point

    from modelhelpers import build_tiny_model, float32_expert_bytes

    path = build_tiny_model("qwen3_moe", tmp_path / "model")
    common = dict(
        policy="runahead", concurrency=2, cache_fraction=0.5, steps=4, warmup_steps=1, dtype="float32"
    )
    free = run_torch_point(TorchPoint(str(path), **common))  # type: ignore[arg-type]
    gbps = 0.002  # 2 MB/s
    capped = run_torch_point(TorchPoint(str(path), **common, link_gbps=gbps))  # type: ignore[arg-type]
    assert capped["link_gbps"] == gbps and free["link_gbps"] is None
    assert capped["token_digest"] == free["token_digest"]
    expert_bytes = float32_expert_bytes(path)
    # the link's busy time per step covers every read's transfer at the cap (the window clips the
    # reads that straddle its start: hence the margin)
    assert capped["fetch_s"] >= 0.9 * capped["fetches_per_step"] * expert_bytes / (gbps * 1e9) > 0
    assert capped["fetch_s"] > free["fetch_s"]
    for row in (free, capped):  # the compute thread's hand-offs: some time, less than the compute's
        assert row["handoff_us_per_group"] > 0 and 0 < row["handoff_share"] < 1
        # the event loop's own CPU: some, less than the whole process's (compute and reads included)
        assert 0 < row["loop_us_per_job"] < row["overhead_us_per_job"]
        # the compute thread ran for some of its time inside groups; the process kept a core or more busy
        assert 0 < row["compute_cpu_share"] <= 1 and row["cores_busy"] > 0


def test_a_bench_point_refuses_a_link_cap_that_is_not_a_positive_number() -> None:
    from runahead.torchbench import TorchPoint

    with pytest.raises(ValueError, match="link cap must be a positive number of GB/s, got 0"):
        TorchPoint("medium", "sync", 2, 0.3, 4, link_gbps=0.0)


def test_the_engine_paces_every_read_and_keeps_its_tokens(tmp_path: Path) -> None:
    """``Engine.open(link_bandwidth=...)`` (``runahead serve`` / ``generate --link-gbps``): the same
    tokens as without a cap, and every read of the run took at least its bytes at the cap."""
    from runahead.engine import Engine
    from runahead.sampling import SamplingParams

    from modelhelpers import build_tiny_model, float32_expert_bytes

    path = build_tiny_model("qwen3_moe", tmp_path / "model")
    expert_bytes = float32_expert_bytes(path)
    bandwidth = 100 * expert_bytes  # 10 ms an expert

    async def run(cap: float | None) -> tuple[list[list[int]], list]:
        async with await Engine.open(
            str(path), cache_fraction=0.4, dtype="float32", keep_records=True, link_bandwidth=cap
        ) as engine:
            params = SamplingParams(max_tokens=5)
            prompts = ([5, 17, 42], [3, 99], [120])
            done = await asyncio.gather(*(engine.complete(prompt, params) for prompt in prompts))
            return [c.token_ids for c in done], list(engine.runtime.recorder.fetches)

    free, _ = asyncio.run(run(None))
    capped, reads = asyncio.run(run(bandwidth))
    assert capped == free
    assert len(reads) > 0
    for read in reads:
        assert read.end - read.start >= expert_bytes / bandwidth - 1e-6


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_the_engine_refuses_a_bad_link_cap_before_it_loads_anything(tmp_path: Path, backend: str) -> None:
    """Named at once: the model folder does not even exist, and that is not what is reported."""
    from runahead.engine import Engine

    if backend == "mlx":
        pytest.importorskip("mlx.core")
    message = "link bandwidth must be a positive number of bytes per second, got 0$"
    with pytest.raises(ValueError, match=message):
        asyncio.run(Engine.open(str(tmp_path / "no-such-model"), backend=backend, link_bandwidth=0))


def test_the_loop_cpu_a_job_leaves_out_the_preload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``loop_cpu_s`` is the event loop's CPU over the run alone: a preload that burns 0.4 s of this
    thread's CPU before the run (as reading every expert in did, 5x the run's own) is not in it."""
    from runahead.runtime import Runtime
    from runahead.torchbench import TorchPoint, run_torch_point

    from modelhelpers import build_tiny_model

    preload = Runtime.preload
    burnt: list[float] = []

    async def slow_preload(self: Runtime, keys: Any) -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.4:
            pass
        burnt.append(time.thread_time() - start)
        await preload(self, keys)

    monkeypatch.setattr(Runtime, "preload", slow_preload)
    path = build_tiny_model("qwen3_moe", tmp_path / "model")
    row = run_torch_point(
        TorchPoint(str(path), "sync", 1, 1.0, 2, warmup_steps=0, dtype="float32", preload=True)
    )
    assert burnt and burnt[0] >= 0.4
    assert 0 < row["loop_cpu_s"] < 0.4
