"""Expert stores: slots filled from real safetensors files (O_DIRECT, buffered, host), concurrency,
a responsive event loop, and clear errors for truncated or mismatched files."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runahead.models.layout import ExpertLayout
from runahead.store import (
    DiskStore,
    ExpertStore,
    HostStore,
    SlotPool,
    StoreError,
    filesystem_type,
    make_store,
    native,
)

from storehelpers import layout_from_safetensors, o_direct_dir, write_experts

H, INTER, LAYERS, EXPERTS = 64, 32, 2, 4
DTYPE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@pytest.fixture(autouse=True, params=["native", "python"])
def readers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: stores reading on C threads (where the library builds here) and on Python
    threads."""
    if request.param == "python":
        monkeypatch.setattr(native, "available", lambda: False)
    elif not native.available():
        pytest.skip("the native reader library does not build here")
    return str(request.param)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that supports O_DIRECT (skips when this machine has none)."""
    found = o_direct_dir(tmp_path)
    if found is None:
        pytest.skip("no writable directory here supports O_DIRECT (tmp_path, /var/tmp, home, repo)")
    yield found
    if found != tmp_path:
        shutil.rmtree(found, ignore_errors=True)


def model(
    directory: Path, dtype: str = "F32", stacked: bool = False, hidden: int = H, inter: int = INTER
) -> tuple[ExpertLayout, dict[tuple[int, int], torch.Tensor]]:
    paths, expected = write_experts(
        directory,
        hidden=hidden,
        inter=inter,
        dtype=DTYPE[dtype],
        stacked=stacked,
        layers=LAYERS,
        experts=EXPERTS,
    )
    layout = layout_from_safetensors(paths, layers=LAYERS, experts=EXPERTS, hidden=hidden, inter=inter)
    return layout, expected


def build(kind: str, layout: ExpertLayout) -> DiskStore | HostStore:
    if kind == "host":
        return HostStore(layout, dtype=torch.float32)
    return DiskStore(layout, direct=kind == "direct")


async def fill_all(store: ExpertStore, layout: ExpertLayout) -> SlotPool:
    pool = SlotPool(len(layout.ranges), layout.slot_numel)
    for i, (layer, expert) in enumerate(sorted(layout.ranges)):
        await store.read_into(layer, expert, pool.slot(i))
    return pool


def test_slot_pool_views_write_through() -> None:
    pool = SlotPool(3, 10, dtype=torch.bfloat16)
    assert pool.data.shape == (3, 10) and pool.data.dtype == torch.bfloat16
    assert pool.nbytes == 60
    pool.slot(1).fill_(2.0)
    assert torch.equal(pool.data[1], torch.full((10,), 2.0, dtype=torch.bfloat16))
    with pytest.raises(IndexError):
        pool.slot(3)


@pytest.mark.parametrize("kind", ["direct", "buffered", "host"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
async def test_slots_equal_the_file_tensors(direct_dir: Path, kind: str, stacked: bool, dtype: str) -> None:
    layout, expected = model(direct_dir, dtype, stacked)
    assert len(layout.ranges) == LAYERS * EXPERTS
    with build(kind, layout) as store:
        pool = await fill_all(store, layout)
        for i, key in enumerate(sorted(layout.ranges)):
            # bf16/f16 -> f32 widening is exact
            assert torch.equal(pool.slot(i), expected[key].float()), key
        assert store.reads == LAYERS * EXPERTS
        if kind == "direct":
            assert isinstance(store, DiskStore)
            assert store.direct, store.direct_reason
            payload = sum(r.nbytes for rs in layout.ranges.values() for r in rs)
            assert store.bytes_read == payload
            assert store.io_bytes >= payload
        if kind == "buffered":
            assert isinstance(store, DiskStore) and not store.direct
            assert "direct=False" in store.direct_reason


def test_adjacent_ranges_of_an_expert_are_read_in_one_call(tmp_path: Path) -> None:
    layout, _ = model(tmp_path, "F32", stacked=False)
    with DiskStore(layout, direct=False) as store:
        # save_file lays down/gate/up of one expert back to back: one read per expert; gate and up
        # lie back to back in the slot too (gate | up | down): one copy, and down's another
        offsets = layout.part_offsets(0)
        (gate_lo, gate_hi), (up_lo, up_hi) = offsets["gate"], offsets["up"]
        assert gate_hi == up_lo
        for plan in store._plans.values():
            assert len(plan) == 1 and len(plan[0].parts) == 2
            down, joined = plan[0].parts
            assert down[3:] == offsets["down"]
            assert joined == ("F32", (up_hi - gate_lo) * 4, joined[2], gate_lo, up_hi)


async def test_host_store_keeps_bf16_images(direct_dir: Path) -> None:
    layout, expected = model(direct_dir, "BF16", stacked=True)
    with HostStore(layout, dtype=torch.bfloat16, pin_memory=False) as store:
        assert store.nbytes == LAYERS * EXPERTS * layout.slot_numel * 2
        assert "all experts" in (HostStore.__doc__ or "").lower()
        assert torch.equal(store.host_view(1, 2), expected[(1, 2)])
        pool = SlotPool(1, layout.slot_numel, dtype=torch.bfloat16)
        await store.read_into(1, 3, pool.slot(0))
        assert torch.equal(pool.slot(0), expected[(1, 3)])
        assert store.bytes_read == layout.slot_numel * 2


@pytest.mark.parametrize("kind", ["direct", "host"])
async def test_concurrent_reads_are_correct(direct_dir: Path, kind: str) -> None:
    layout, expected = model(direct_dir, "BF16")
    keys = sorted(layout.ranges)
    with build(kind, layout) as store:
        pool = SlotPool(len(keys), layout.slot_numel)
        await asyncio.gather(*(store.read_into(*key, pool.slot(i)) for i, key in enumerate(keys)))
        for i, key in enumerate(keys):
            assert torch.equal(pool.slot(i), expected[key].float())
        assert store.reads == len(keys)


async def test_event_loop_stays_responsive_during_reads(direct_dir: Path) -> None:
    """A ticker yielding with ``sleep(0)`` keeps ticking while 24 MiB of O_DIRECT reads are in flight."""
    layout, expected = model(direct_dir, "F32", hidden=1024, inter=512)  # 6 MiB per expert
    keys = [(0, e) for e in range(EXPERTS)]
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    with DiskStore(layout, queue_depth=2) as store:
        pool = SlotPool(len(keys), layout.slot_numel)
        tick_task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = ticks
        await asyncio.gather(*(store.read_into(*key, pool.slot(i)) for i, key in enumerate(keys)))
        during = ticks - start
        done = True
        await tick_task
        assert store.direct, store.direct_reason
    assert during >= 10, f"event loop ticked only {during} times during the reads"
    for i, key in enumerate(keys):
        assert torch.equal(pool.slot(i), expected[key])


def test_o_direct_is_used_on_a_real_disk(direct_dir: Path) -> None:
    layout, _ = model(direct_dir)
    store = DiskStore(layout)
    try:
        assert store.direct, store.direct_reason
        assert store.direct_reason == ""
        assert not store.memory_backed
        assert "O_DIRECT" in repr(store)
    finally:
        store.close()


async def test_falls_back_to_buffered_reads_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, expected = model(tmp_path)
    real_open = os.open

    def refuse_direct(path: str, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    with DiskStore(layout) as store:
        assert not store.direct
        assert "EINVAL" in store.direct_reason or "not available" in store.direct_reason
        pool = await fill_all(store, layout)
    for i, key in enumerate(sorted(layout.ranges)):
        assert torch.equal(pool.slot(i), expected[key])


async def test_open_refusal_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    layout, _ = model(tmp_path)
    real_open = os.open

    def refuse_direct(path: str, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    with caplog.at_level("WARNING", logger="runahead.store"), DiskStore(layout):
        pass
    assert any("EINVAL at open" in r.getMessage() and "bind-mount" in r.getMessage() for r in caplog.records)


async def test_falls_back_when_o_direct_reads_fail_with_einval(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, readers: str
) -> None:
    """Some filesystems (overlays, FUSE) take O_DIRECT at open and refuse the reads: the store
    reopens such a file buffered, says so once, and the read still delivers the right bytes."""
    import fcntl

    if readers == "native":
        pytest.skip("os.preadv is the Python threads' call; the C threads' EINVAL is tested below")

    layout, expected = model(direct_dir)
    real_preadv = os.preadv

    def refuse_direct_reads(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct_reads)
    with caplog.at_level("WARNING", logger="runahead.store"), DiskStore(layout, queue_depth=3) as store:
        assert store.direct  # the open succeeded
        pool = await fill_all(store, layout)
        assert not store.direct
        assert "EINVAL at read" in store.direct_reason
    for i, key in enumerate(sorted(layout.ranges)):
        assert torch.equal(pool.slot(i), expected[key])
    warnings = [r for r in caplog.records if "EINVAL at read" in r.getMessage()]
    assert len(warnings) == len({r.path for rs in layout.ranges.values() for r in rs})  # once per file


async def test_unaligned_o_direct_reads_fall_back_to_buffered(
    direct_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real EINVAL, on either reader: O_DIRECT reads at offsets that are not block aligned (a store
    told its alignment is 1 byte) are refused by the filesystem; the store reopens the files
    buffered, says so once per file, and delivers the right bytes."""
    layout, expected = model(direct_dir)
    keys = sorted(layout.ranges)
    pool = SlotPool(len(keys), layout.slot_numel)
    with caplog.at_level("WARNING", logger="runahead.store"), DiskStore(layout, alignment=1) as store:
        assert store.direct
        # all at once: reads beside the first refused one are refused too, and must read again
        await asyncio.gather(*(store.read_into(*key, pool.slot(i)) for i, key in enumerate(keys)))
        assert not store.direct and "EINVAL at read" in store.direct_reason
    for i, key in enumerate(keys):
        assert torch.equal(pool.slot(i), expected[key])
    warnings = [r for r in caplog.records if "EINVAL at read" in r.getMessage()]
    assert len(warnings) == len({r.path for rs in layout.ranges.values() for r in rs})


async def test_model_on_an_overlay_filesystem(tmp_path: Path) -> None:
    """A model inside a container's own filesystem (overlayfs, as Docker's overlay2 lays images):
    reads are O_DIRECT where overlayfs passes the flag through (Linux 6.x over ext4), else buffered
    with a warning; either way the bytes are right. Needs permission to mount (skips otherwise)."""
    import subprocess

    lower, upper, work, merged = (tmp_path / name for name in ("lower", "upper", "work", "merged"))
    for folder in (lower, upper, work, merged):
        folder.mkdir()
    layout, expected = model(lower)
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    mounted = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an overlay here: {mounted.stderr.decode().strip()}")
    try:
        ranges = {
            key: tuple(dataclasses.replace(r, path=r.path.replace(str(lower), str(merged))) for r in rs)
            for key, rs in layout.ranges.items()
        }
        overlaid = dataclasses.replace(layout, ranges=ranges)
        assert filesystem_type(ranges[(0, 0)][0].path) == "overlay"
        with DiskStore(overlaid) as store:
            pool = await fill_all(store, overlaid)
            assert store.direct or "EINVAL" in store.direct_reason
        for i, key in enumerate(sorted(layout.ranges)):
            assert torch.equal(pool.slot(i), expected[key])
    finally:
        subprocess.run(["umount", str(merged)], check=False)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm (tmpfs) on this machine")
async def test_tmpfs_is_never_passed_off_as_a_disk(tmp_path: Path) -> None:
    """tmpfs refuses O_DIRECT (older kernels: buffered fallback with a reason) or accepts it (Linux
    >= 6.6): either way the store says its reads are not disk reads."""
    directory = Path("/dev/shm") / f"runahead-store-{os.getpid()}-{tmp_path.name}"
    directory.mkdir()
    try:
        layout, expected = model(directory)
        with DiskStore(layout) as store:
            assert store.memory_backed
            assert "memory-backed" in repr(store)
            if not store.direct:
                assert "EINVAL" in store.direct_reason or "not available" in store.direct_reason
            pool = await fill_all(store, layout)
        assert torch.equal(pool.slot(0), expected[sorted(layout.ranges)[0]])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("kind", ["direct", "host"])
def test_truncated_file_is_named_at_construction(direct_dir: Path, kind: str) -> None:
    layout, _ = model(direct_dir)
    victim = Path(layout.ranges[(1, 3)][0].path)
    os.truncate(victim, victim.stat().st_size - 100)
    with pytest.raises(StoreError, match="truncated") as info:
        build(kind, layout)
    assert str(victim) in str(info.value)


async def test_file_truncated_after_opening_fails_the_read_naming_the_file(direct_dir: Path) -> None:
    layout, _ = model(direct_dir)
    key = max(layout.ranges, key=lambda k: max(r.offset for r in layout.ranges[k]))
    victim = Path(layout.ranges[key][0].path)
    with DiskStore(layout) as store:
        os.truncate(victim, max(r.offset for r in layout.ranges[key]) + 10)
        with pytest.raises(StoreError, match="truncated") as info:
            await store.read_into(*key, SlotPool(1, layout.slot_numel).slot(0))
    assert str(victim) in str(info.value)


def with_range(layout: ExpertLayout, key: tuple[int, int], index: int, **changes: object) -> ExpertLayout:
    ranges = dict(layout.ranges)
    rs = list(ranges[key])
    rs[index] = dataclasses.replace(rs[index], **changes)  # type: ignore[arg-type]
    ranges[key] = tuple(rs)
    return dataclasses.replace(layout, ranges=ranges)


@pytest.mark.parametrize("kind", ["direct", "host"])
def test_mismatched_ranges_are_rejected_with_file_offset_and_sizes(tmp_path: Path, kind: str) -> None:
    layout, _ = model(tmp_path)
    r = layout.ranges[(0, 1)][0]
    bad_dtype = with_range(layout, (0, 1), 0, dtype="BF16")  # BF16 claimed, F32-sized bytes
    with pytest.raises(StoreError) as info:
        build(kind, bad_dtype)
    message = str(info.value)
    assert r.path in message and str(r.offset) in message
    assert str(r.nbytes // 2) in message and str(r.nbytes) in message
    bad_shape = with_range(layout, (0, 1), 0, shape=(INTER + 1, H))
    with pytest.raises(StoreError, match=r"expected shape \[\d+, \d+\].*found \[33, 64\]"):
        build(kind, bad_shape)
    bad_dtype_name = with_range(layout, (0, 1), 0, dtype="I8")
    with pytest.raises(StoreError, match="unsupported dtype 'I8'"):
        build(kind, bad_dtype_name)
    missing_role = dataclasses.replace(layout, ranges={**layout.ranges, (0, 1): layout.ranges[(0, 1)][:2]})
    with pytest.raises(StoreError, match=r"expert \(0, 1\).*roles"):
        build(kind, missing_role)


async def test_bad_slots_and_keys_are_rejected(tmp_path: Path) -> None:
    layout, _ = model(tmp_path)
    with DiskStore(layout, direct=False) as store:
        with pytest.raises(ValueError, match="contiguous"):
            await store.read_into(0, 0, torch.empty(layout.slot_numel + 1))
        with pytest.raises(KeyError):
            await store.read_into(5, 0, torch.empty(layout.slot_numel))


@pytest.mark.parametrize("kind", ["direct", "host"])
async def test_close_is_idempotent_and_later_reads_fail(direct_dir: Path, kind: str) -> None:
    layout, _ = model(direct_dir)
    store = build(kind, layout)
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        await store.read_into(0, 0, torch.empty(layout.slot_numel))


async def test_cancelled_read_returns_after_the_slot_is_written(direct_dir: Path) -> None:
    layout, expected = model(direct_dir, hidden=1024, inter=512)
    with DiskStore(layout, queue_depth=1) as store:
        slot = SlotPool(1, layout.slot_numel).slot(0)
        task = asyncio.create_task(store.read_into(0, 1, slot))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert torch.equal(slot, expected[(0, 1)])  # the thread finished before the cancel landed


def test_make_store(tmp_path: Path) -> None:
    layout, _ = model(tmp_path)
    with make_store("disk", layout, direct=False) as disk:
        assert isinstance(disk, DiskStore) and isinstance(disk, ExpertStore)
    with make_store("host", layout, dtype=torch.bfloat16, pin_memory=False) as host:
        assert isinstance(host, HostStore) and host.image.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown expert store"):
        make_store("nvme", layout)  # type: ignore[arg-type]
