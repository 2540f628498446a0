"""The stores' C reader threads (:mod:`runahead.store.native`): exact type conversions, batched
wake-ups, cancellation, closing with reads queued, one failed read among good ones, and the switch.

The store tests (``tests/test_store.py``) run every store test on these threads and on the Python
ones; this file holds what only the C threads do."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runahead.store import DiskStore, HostStore, SlotPool, StoreError, native
from runahead.store.base import StoreClosed
from runahead.store.native import CONVERSIONS, NativeReads, Plan

from storehelpers import layout_from_safetensors, o_direct_dir, write_experts

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native reader library does not build here"
)

H, INTER, LAYERS, EXPERTS = 64, 32, 2, 8


def model(directory: Path, hidden: int = H, inter: int = INTER):  # type: ignore[no-untyped-def]
    paths, expected = write_experts(directory, hidden=hidden, inter=inter, layers=LAYERS, experts=EXPERTS)
    return layout_from_safetensors(
        paths, layers=LAYERS, experts=EXPERTS, hidden=hidden, inter=inter
    ), expected


def converted(source: torch.Tensor, target: torch.dtype, conversion: int, piece: int = 0) -> torch.Tensor:
    """``source`` copied into a ``target`` tensor by the C threads' ``conversion`` (from memory), in
    one copy, or in copies of ``piece`` values each (too few for a vector pass: the scalar path)."""
    out = torch.empty(source.numel(), dtype=target)
    n, size, wide = source.numel(), source.element_size(), out.element_size()
    step = piece or n
    parts = [(conversion, i * size, i * wide, min(step, n - i) * size) for i in range(0, n, step)]
    values = [1, -1, source.data_ptr(), source.nbytes, len(parts)] + [v for part in parts for v in part]
    reads = NativeReads(1, {}, set(), 4096, 0)
    plan = Plan(values, ())

    async def run() -> None:
        await reads.submit(plan, out.data_ptr())

    try:
        asyncio.run(run())
    finally:
        reads.close()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit for bit, except that any NaN matches any NaN (torch's vectorised and scalar
    conversions give NaN different payloads themselves)."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a[~nan].view(bits), b[~nan].view(bits))


@pytest.mark.parametrize("piece", [0, 7], ids=["vector", "scalar"])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
def test_every_half_width_value_widens_as_torch_does(source: torch.dtype, piece: int) -> None:
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(source)
    same_bits(converted(values, torch.float32, CONVERSIONS[source, torch.float32], piece), values.float())


@pytest.mark.parametrize("piece", [0, 7], ids=["vector", "scalar"])
def test_float32_narrows_to_bfloat16_as_torch_does(piece: int) -> None:
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=generator, dtype=torch.int64)
    ties = (
        torch.arange(-(2**15), 2**15, dtype=torch.int64) << 16
    ) | 0x8000  # exactly half-way, every high half
    edges = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan")]
    )
    values = torch.cat(
        [random_bits.to(torch.int32).view(torch.float32), ties.to(torch.int32).view(torch.float32), edges]
    )
    same_bits(
        converted(values, torch.bfloat16, CONVERSIONS[torch.float32, torch.bfloat16]), values.bfloat16()
    )


async def test_a_float32_file_into_bfloat16_slots(tmp_path: Path) -> None:
    layout, expected = model(tmp_path)
    with DiskStore(layout) as store:
        assert store.native
        pool = SlotPool(len(layout.ranges), layout.slot_numel, dtype=torch.bfloat16)
        keys = sorted(layout.ranges)
        await asyncio.gather(*(store.read_into(*key, pool.slot(i)) for i, key in enumerate(keys)))
    for i, key in enumerate(keys):
        assert torch.equal(pool.slot(i), expected[key].bfloat16())


async def test_an_experts_plan_is_made_at_its_own_first_read(tmp_path: Path) -> None:
    """Not every expert's at the store's first read: that held the event loop ~3 us an expert."""
    layout, expected = model(tmp_path)
    keys = sorted(layout.ranges)
    pool = SlotPool(2, layout.slot_numel)
    with DiskStore(layout) as store:
        assert store.native
        await store.read_into(*keys[0], pool.slot(0))
        assert list(store._native_plans[torch.float32]) == [keys[0]]
        await store.read_into(*keys[-1], pool.slot(1))
        await store.read_into(*keys[0], pool.slot(0))  # the plan made before, used again
        assert list(store._native_plans[torch.float32]) == [keys[0], keys[-1]]
    assert torch.equal(pool.slot(0), expected[keys[0]])
    assert torch.equal(pool.slot(1), expected[keys[-1]])


async def test_reads_that_land_together_wake_the_loop_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, expected = model(tmp_path)
    drains = 0
    drain = NativeReads._drain

    def counted(self: NativeReads) -> None:
        nonlocal drains
        drains += 1
        drain(self)

    monkeypatch.setattr(NativeReads, "_drain", counted)
    keys = sorted(layout.ranges)
    pool = SlotPool(len(keys), layout.slot_numel)
    with DiskStore(layout, queue_depth=4) as store:
        tasks = [asyncio.create_task(store.read_into(*key, pool.slot(i))) for i, key in enumerate(keys)]
        await asyncio.sleep(0)  # every read submitted
        time.sleep(0.3)  # the loop busy while the C threads finish them all
        await asyncio.gather(*tasks)
        assert drains == 1  # closing drains once more
    for i, key in enumerate(keys):
        assert torch.equal(pool.slot(i), expected[key])


async def test_cancelled_reads_leave_the_others_and_the_store_whole(tmp_path: Path) -> None:
    """Reads queued behind one thread, half of them cancelled while queued: each cancelled read
    returns only once its slot is written (nothing writes a slot after its read is given up), the
    others deliver their bytes, and the store goes on reading."""
    layout, expected = model(tmp_path, hidden=512, inter=256)
    keys = sorted(layout.ranges)
    pool = SlotPool(len(keys), layout.slot_numel)
    with DiskStore(layout, queue_depth=1) as store:
        tasks = [asyncio.create_task(store.read_into(*key, pool.slot(i))) for i, key in enumerate(keys)]
        await asyncio.sleep(0)
        for task in tasks[1::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for i, (key, result) in enumerate(zip(keys, results, strict=True)):
            if i % 2:
                assert isinstance(result, asyncio.CancelledError)
            else:
                assert isinstance(result, float)  # when it landed
            assert torch.equal(pool.slot(i), expected[key])  # cancelled ones too: written before returning
        pool.data.zero_()
        await store.read_into(*keys[1], pool.slot(1))
        assert torch.equal(pool.slot(1), expected[keys[1]])


async def test_a_failed_read_fails_alone(direct_dir_or_tmp: Path) -> None:
    layout, expected = model(direct_dir_or_tmp)
    keys = sorted(layout.ranges)
    last = max(keys, key=lambda k: max(r.offset for r in layout.ranges[k]))
    victim = layout.ranges[last][0].path
    pool = SlotPool(len(keys), layout.slot_numel)
    with DiskStore(layout) as store:
        os.truncate(victim, max(r.offset for r in layout.ranges[last]) + 10)
        results = await asyncio.gather(
            *(store.read_into(*key, pool.slot(i)) for i, key in enumerate(keys)), return_exceptions=True
        )
    for i, (key, result) in enumerate(zip(keys, results, strict=True)):
        if key == last:
            assert isinstance(result, StoreError) and "truncated" in str(result) and victim in str(result)
        elif layout.ranges[key][0].path != victim or max(
            r.offset for r in layout.ranges[key]
        ) < os.path.getsize(victim):
            assert isinstance(result, float) and torch.equal(pool.slot(i), expected[key])


async def test_closing_with_reads_queued_finishes_them_and_refuses_new_ones(tmp_path: Path) -> None:
    layout, expected = model(tmp_path, hidden=512, inter=256)
    keys = sorted(layout.ranges)
    pool = SlotPool(len(keys), layout.slot_numel)
    store = DiskStore(layout, queue_depth=1)
    tasks = [asyncio.create_task(store.read_into(*key, pool.slot(i))) for i, key in enumerate(keys)]
    await asyncio.sleep(0)
    store.close()  # from the loop: the queued reads run, their futures settle
    await asyncio.gather(*tasks)
    for i, key in enumerate(keys):
        assert torch.equal(pool.slot(i), expected[key])
    with pytest.raises(StoreClosed):
        await store.read_into(*keys[0], pool.slot(0))


def test_a_close_on_another_thread_never_frees_the_pool_under_a_submit() -> None:
    """``submit`` lets go of the GIL for its C call, so another thread can close and free the pool
    meanwhile: here a loop on a second thread submits copies as fast as it can, and the main
    thread's own loop submits one (the pool now watches that loop) and closes the pool from it, so
    the pool is freed at once on the main thread, not handed to the submitting loop. Every submit
    either queues a read that lands (bytes in place) or is refused as shut down; twenty times over.
    A C call into the freed pool would not show here (its memory still reads as closing): the lock
    around submit's call and the free (``NativeReads._calls``) rules that out by construction."""
    import threading

    from runahead.store.native import memory_plan

    source = torch.arange(4096, dtype=torch.uint8)
    plan = memory_plan(source.data_ptr(), 4096)
    for _ in range(20):
        reads = NativeReads(2, {}, set(), 4096, 4096)
        loop = asyncio.new_event_loop()
        outcomes: list[str] = []
        started = threading.Event()

        async def submit_all(
            reads: NativeReads = reads, outcomes: list[str] = outcomes, started: threading.Event = started
        ) -> None:
            slots = [torch.zeros(4096, dtype=torch.uint8) for _ in range(200)]
            futures = []
            for i, slot in enumerate(slots):
                try:
                    futures.append((slot, reads.submit(plan, slot.data_ptr())))
                except RuntimeError as error:
                    assert "shut down" in str(error)
                    outcomes.append("refused")
                    break
                if i == 20:
                    started.set()
                await asyncio.sleep(0)
            started.set()
            for slot, future in futures:
                await future
                assert torch.equal(slot, source)
                outcomes.append("landed")

        async def close_here(reads: NativeReads = reads) -> None:
            slot = torch.zeros(4096, dtype=torch.uint8)
            await reads.submit(plan, slot.data_ptr())  # this loop is the one the pool watches now
            assert torch.equal(slot, source)
            reads.close()  # on this loop's thread: the pool is freed here, at once

        thread = threading.Thread(target=lambda: loop.run_until_complete(submit_all()))  # noqa: B023
        thread.start()
        started.wait(5)
        asyncio.run(asyncio.wait_for(close_here(), 10))  # a read never settled fails, not hangs
        thread.join(10)
        assert not thread.is_alive()
        loop.close()
        assert "landed" in outcomes


def test_one_store_serves_one_loop_after_another(tmp_path: Path) -> None:
    layout, expected = model(tmp_path)
    slot = SlotPool(1, layout.slot_numel).slot(0)
    with DiskStore(layout) as disk, HostStore(layout) as host:
        for store in (disk, host, disk, host):
            slot.zero_()
            asyncio.run(store.read_into(1, 3, slot))
            assert torch.equal(slot, expected[(1, 3)])


def test_the_switch_and_the_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, _ = model(tmp_path)
    with DiskStore(layout, native=False) as store:
        assert not store.native and "C threads" not in repr(store)
    with DiskStore(layout) as store:
        assert store.native and "reads on C threads" in repr(store)
    code = "from runahead.store import native; print(native.available())"
    off = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "RUNAHEAD_NATIVE_READS": "off"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert off.stdout.strip() == "False"
    monkeypatch.setattr(native, "_library", lambda: None)
    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.raises(OSError, match="not available here"):
        DiskStore(layout, native=True)
    with DiskStore(layout) as store:
        assert not store.native


@pytest.fixture
def direct_dir_or_tmp(tmp_path: Path) -> Path:
    return o_direct_dir(tmp_path) or tmp_path


def test_the_readers_summary_reads_the_kept_rows_and_refuses_rows_whose_tokens_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import shutil

    from benchhelpers import BENCH, load_bench_script

    script = load_bench_script("ab_summary")
    kept = BENCH / "results" / "native-reads"
    monkeypatch.setattr(sys, "argv", ["ab_summary", str(kept)])
    script.main()
    table = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert len(table) == 1 + 16  # header, then 3 points x (3 or 2 policies) x 2 readers
    assert sum("| C threads |" in line for line in table) == 8
    copy = tmp_path / "rows"
    shutil.copytree(kept / "host50-on-1", copy / "host50-on-1")
    rows = [json.loads(line) for line in (copy / "host50-on-1" / "results.jsonl").read_text().splitlines()]
    rows[-1]["token_digest"] = "not sync's"
    (copy / "host50-on-1" / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setattr(sys, "argv", ["ab_summary", str(copy)])
    with pytest.raises(ValueError, match="tokens differ"):
        script.main()


def test_every_c_source_ships_in_the_package() -> None:
    """A C source missing from the package data builds in a checkout and is absent from a wheel (the
    docker images install one): there the library would not build and the readers would fall back."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "runahead"
    ]
    sources = sorted(p.relative_to(root / "runahead") for p in (root / "runahead").rglob("*.c"))
    assert Path("store/nativereads.c") in sources and Path("models/qkernel.c") in sources
    for source in sources:
        assert any(source.match(pattern) for pattern in globs), (
            f"runahead/{source} is not in the package data"
        )
