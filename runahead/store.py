"""Expert stores: where a backend's ``fetch`` gets an expert's bytes from, and the slots they go into.

A store fills one cache slot (a flat tensor in the slot format of :mod:`runahead.models.layout`:
``gate [I, H]``, ``up [I, H]``, ``down [H, I]`` back to back, in the slot's dtype) with one routed
expert. Two stores:

- :class:`DiskStore` reads the expert's byte ranges straight from the safetensors files with
  ``O_DIRECT`` (so it measures the disk, not the page cache), converts and copies into the slot;
- :class:`HostStore` keeps every expert's slot image in host memory (pinned when CUDA is around)
  and copies host -> slot.

Both run their blocking work (I/O, conversion, copies) on a dedicated thread pool of
``queue_depth`` workers, so ``await store.read_into(...)`` never blocks the asyncio event loop and
up to ``queue_depth`` reads proceed at once. :class:`SlotPool` is the preallocated slot memory.
"""

from __future__ import annotations

import asyncio
import errno
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from runahead.models.layout import ExpertLayout, TensorRange

__all__ = [
    "DTYPES",
    "DiskStore",
    "ExpertStore",
    "HostStore",
    "SlotPool",
    "StoreError",
    "make_store",
    "validate_layout",
]

DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""Safetensors dtype names the stores read, and their torch dtypes."""

ALIGNMENT = 4096
"""O_DIRECT alignment of offsets, lengths and buffers: covers 512-byte and 4 KiB logical blocks."""

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
"""Filesystems whose "disk" is memory: tmpfs accepts O_DIRECT since Linux 6.6, but reads stay memory reads."""


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` from ``/proc/self/mounts`` (Linux), else ``""``."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return ""
    real = os.path.realpath(path)
    best, kind = "", ""
    for mount, fstype in mounts:
        mount = mount.replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind


class StoreError(ValueError):
    """A layout range that does not match the layout's shapes, or a file that does not hold it."""


class SlotPool:
    """The expert cache's slot memory: one preallocated ``[num_slots, slot_numel]`` tensor.

    Created once by the backend; on CUDA it lives on the device. ``slot(i)`` is a view into it, so
    a store that writes the view writes the cache.
    """

    def __init__(
        self,
        num_slots: int,
        slot_numel: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_slots < 1 or slot_numel < 1:
            raise ValueError(
                f"SlotPool needs num_slots >= 1 and slot_numel >= 1, got {num_slots}, {slot_numel}"
            )
        self.num_slots = num_slots
        self.slot_numel = slot_numel
        self.dtype = dtype
        self.device = torch.device(device)
        self.data = torch.empty((num_slots, slot_numel), dtype=dtype, device=self.device)

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i`` as a contiguous 1-D view of ``slot_numel`` elements (no copy)."""
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range [0, {self.num_slots})")
        return self.data[i]

    @property
    def nbytes(self) -> int:
        """Bytes of slot memory held."""
        return self.data.numel() * self.data.element_size()


@runtime_checkable
class ExpertStore(Protocol):
    """Where experts come from. ``read_into`` may be awaited several times concurrently."""

    bytes_read: int
    """Bytes moved over the link by completed reads (see each store for what that counts)."""

    reads: int
    """Completed ``read_into`` calls."""

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor) -> None:
        """Fill ``slot`` (``slot_numel`` elements) with expert ``(layer, expert)`` in the slot format.

        Called by the backend's ``fetch``; returns when the bytes are in the slot. Never blocks the
        event loop.
        """
        ...

    def close(self) -> None:
        """Release threads, files and buffers. Idempotent; later reads raise ``RuntimeError``."""
        ...


# ---------------------------------------------------------------------------------------------
# Layout validation and read plans


def _expected_shape(role: str, hidden: int, inter: int) -> tuple[int, int]:
    return {
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
        "gate_up": (2 * inter, hidden),
    }[role]


def _strip_leading_ones(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(shape)
    while len(dims) > 2 and dims[0] == 1:
        dims = dims[1:]
    return dims


def _where(r: TensorRange) -> str:
    return f"{r.path} at offset {r.offset} ({r.role})"


def validate_layout(layout: ExpertLayout, check_files: bool = True) -> None:
    """Check every expert's ranges against the layout's shapes; raise :class:`StoreError` if one is off.

    Each expert needs ``gate`` + ``up`` + ``down`` or ``gate_up`` + ``down``; each range's shape (leading
    1-dims ignored) must be the role's ``[I, H]`` / ``[H, I]`` / ``[2I, H]``, its dtype one of
    :data:`DTYPES` and ``nbytes`` the shape's size. With ``check_files`` every range must lie inside its
    file (a truncated file is named). Called by the stores' constructors.
    """
    hidden, inter = layout.hidden_size, layout.intermediate_size
    sizes: dict[str, int] = {}
    for (layer, expert), ranges in layout.ranges.items():
        roles = sorted(r.role for r in ranges)
        if roles not in (["down", "gate", "up"], ["down", "gate_up"]):
            raise StoreError(
                f"expert ({layer}, {expert}): ranges have roles {roles}; "
                "expected gate+up+down or gate_up+down"
            )
        for r in ranges:
            if r.dtype not in DTYPES:
                raise StoreError(
                    f"{_where(r)}: unsupported dtype {r.dtype!r}; expected one of {sorted(DTYPES)}"
                )
            want = _expected_shape(r.role, hidden, inter)
            found = _strip_leading_ones(r.shape)
            if found != want:
                raise StoreError(
                    f"{_where(r)}: expected shape {list(want)} for H={hidden}, I={inter}, "
                    f"found {list(r.shape)}"
                )
            want_bytes = math.prod(want) * DTYPES[r.dtype].itemsize
            if r.nbytes != want_bytes:
                raise StoreError(
                    f"{_where(r)}: expected {want_bytes} bytes ({r.dtype} {list(want)}), found {r.nbytes}"
                )
            if r.offset < 0:
                raise StoreError(f"{_where(r)}: negative offset")
            if check_files:
                if r.path not in sizes:
                    try:
                        sizes[r.path] = os.stat(r.path).st_size
                    except OSError as exc:
                        raise StoreError(f"{r.path}: cannot stat expert file: {exc}") from exc
                if r.offset + r.nbytes > sizes[r.path]:
                    raise StoreError(
                        f"{_where(r)}: file is truncated: range ends at byte {r.offset + r.nbytes}, "
                        f"file has {sizes[r.path]} bytes"
                    )


@dataclass(frozen=True, slots=True)
class _Read:
    """One read call: a run of adjacent ranges of one expert in one file, and where each goes."""

    path: str
    offset: int  # first byte of the run
    nbytes: int  # bytes of the run
    parts: tuple[tuple[TensorRange, int, int, int], ...]  # (range, byte offset in run, slot start, slot stop)


def _plan(layout: ExpertLayout, ranges: Iterable[TensorRange]) -> tuple[_Read, ...]:
    """Group one expert's ranges into reads: same file and back to back -> one read."""
    offsets = layout.offsets()
    reads: list[_Read] = []
    run: list[TensorRange] = []

    def flush() -> None:
        if run:
            start = run[0].offset
            parts = tuple((r, r.offset - start, *offsets[r.role]) for r in run)
            reads.append(_Read(run[0].path, start, run[-1].offset + run[-1].nbytes - start, parts))
            run.clear()

    for r in sorted(ranges, key=lambda r: (r.path, r.offset)):
        if run and (r.path != run[-1].path or r.offset != run[-1].offset + run[-1].nbytes):
            flush()
        run.append(r)
    flush()
    return tuple(reads)


def _check_slot(layout: ExpertLayout, slot: torch.Tensor) -> torch.Tensor:
    if slot.numel() != layout.slot_numel or not slot.is_contiguous():
        raise ValueError(
            f"slot must be a contiguous tensor of {layout.slot_numel} elements, "
            f"got shape {list(slot.shape)} (contiguous={slot.is_contiguous()})"
        )
    return slot.view(-1)


# ---------------------------------------------------------------------------------------------
# Reading byte ranges


class _FileReader:
    """Opens each expert file once (``O_DIRECT`` when it can) and reads runs into per-thread buffers.

    Thread safe: ``os.preadv`` carries its own offset, and each thread has its own aligned buffer.
    """

    def __init__(
        self, paths: Iterable[str], direct: bool, alignment: int = ALIGNMENT, buffer_size: int = 0
    ) -> None:
        self.alignment = alignment
        self.buffer_size = buffer_size  # first buffer size: the largest read, so buffers never grow
        self.fds: dict[str, int] = {}
        self.direct_paths: set[str] = set()
        self.reason = "" if direct else "buffered reads requested (direct=False)"
        self.io_bytes = 0  # bytes read from files, alignment padding included
        self._local = threading.local()
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()
        o_direct = getattr(os, "O_DIRECT", 0)
        if direct and not o_direct:
            self.reason = "O_DIRECT is not available on this platform; using buffered reads"
        for path in sorted(set(paths)):
            fd = -1
            if direct and o_direct:
                try:
                    fd = os.open(path, os.O_RDONLY | o_direct)
                    self.direct_paths.add(path)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        self.close()
                        raise StoreError(f"{path}: cannot open expert file: {exc}") from exc
                    if not self.reason:
                        self.reason = (
                            f"O_DIRECT refused by the filesystem of {path} (EINVAL); using buffered reads"
                        )
            if fd < 0:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    self.close()
                    raise StoreError(f"{path}: cannot open expert file: {exc}") from exc
            self.fds[path] = fd

    @property
    def direct(self) -> bool:
        """True when every file is read with O_DIRECT."""
        return bool(self.fds) and len(self.direct_paths) == len(self.fds)

    def _buffer(self, size: int) -> mmap.mmap:
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            new = mmap.mmap(
                -1, max(size, self.buffer_size, 2 * len(buf) if buf is not None else 0)
            )  # page aligned
            with self._lock:
                if buf is not None:
                    self._buffers.remove(buf)
                    buf.close()
                self._buffers.append(new)
            self._local.buf = buf = new
        return buf

    def read(self, run: _Read) -> tuple[mmap.mmap, int]:
        """Read ``run`` into this thread's buffer; returns the buffer and where the run starts in it.

        The buffer is reused by this thread's next read: copy out of it before reading again.
        """
        fd = self.fds[run.path]
        if run.path in self.direct_paths:
            a = self.alignment
            start = run.offset - run.offset % a
            stop = -(-(run.offset + run.nbytes) // a) * a
        else:
            start, stop = run.offset, run.offset + run.nbytes
        need = run.offset + run.nbytes - start  # bytes that must arrive; the rest is padding past EOF
        buf = self._buffer(stop - start)
        view = memoryview(buf)
        got = 0
        try:
            while got < need:
                try:
                    n = os.preadv(fd, [view[got : stop - start]], start + got)
                except OSError as exc:
                    raise StoreError(
                        f"{run.path}: read of {stop - start - got} bytes at offset {start + got} "
                        f"failed: {exc}"
                    ) from exc
                if n == 0:
                    break
                got += n
        finally:
            view.release()
        with self._lock:
            self.io_bytes += got
        if got < need:
            raise StoreError(
                f"{run.path}: file is truncated: expected bytes {run.offset}..{run.offset + run.nbytes}, "
                f"file ends at {start + got}"
            )
        return buf, run.offset - start

    def close(self) -> None:
        """Close the files and free the buffers. Idempotent."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        with self._lock:
            for buf in self._buffers:
                buf.close()
            self._buffers.clear()


def _copy_run(
    buf: mmap.mmap, base: int, run: _Read, slot: torch.Tensor, *, non_blocking: bool = False
) -> None:
    """Copy each range of ``run`` (``buf`` from byte ``base``) into its part of ``slot``, converting dtype."""
    for r, at, lo, hi in run.parts:
        dtype = DTYPES[r.dtype]
        src = torch.frombuffer(buf, dtype=dtype, count=r.nbytes // dtype.itemsize, offset=base + at)
        slot[lo:hi].copy_(src, non_blocking=non_blocking)
        del src  # release the buffer export before the buffer is reused or closed


class _Executor:
    """The store's thread pool of ``queue_depth`` workers, shared by both stores."""

    def __init__(self, queue_depth: int, name: str) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=queue_depth, thread_name_prefix=name
        )

    async def run(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the pool. If the caller is cancelled, wait for the thread to finish
        before re-raising, so the slot is no longer being written when the cancellation lands."""
        if self.pool is None:
            raise RuntimeError("expert store is closed")
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    continue
                except Exception:
                    break
            raise

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class _CudaCopier:
    """A dedicated copy stream per CUDA device; copies wait on an event in the calling (worker) thread."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            return self._streams[device]


# ---------------------------------------------------------------------------------------------
# Stores


class DiskStore:
    """Reads experts from their safetensors files with ``O_DIRECT``, one executor thread per queue slot.

    Each file is opened once (``O_RDONLY | O_DIRECT``); an expert's ranges that are back to back in
    one file are read with one ``os.preadv`` of the aligned superset (offset down, length up to
    :data:`ALIGNMENT`) into a page-aligned per-thread ``mmap`` buffer, then viewed with
    ``torch.frombuffer``, converted to the slot dtype and copied into their part of the slot. Where a
    file's filesystem refuses O_DIRECT (EINVAL, e.g. tmpfs) or the platform lacks it, reads are
    buffered and ``direct`` is False with the reason in ``direct_reason`` — such reads may come from
    the page cache (memory speed), not the disk. ``memory_backed`` flags files on tmpfs, which
    accepts O_DIRECT on recent kernels but is memory all the same.

    ``bytes_read`` counts the experts' payload bytes (the ranges' ``nbytes``); ``io_bytes`` the bytes
    actually read, alignment padding included.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        queue_depth: int = 2,
        direct: bool = True,
        alignment: int = ALIGNMENT,
    ) -> None:
        validate_layout(layout)
        self.layout = layout
        self.queue_depth = queue_depth
        self.bytes_read = 0
        self.reads = 0
        self._plans = {key: _plan(layout, ranges) for key, ranges in layout.ranges.items()}
        self._payload = {key: sum(r.nbytes for r in ranges) for key, ranges in layout.ranges.items()}
        largest = max((run.nbytes for plan in self._plans.values() for run in plan), default=0)
        self._files = _FileReader(
            (r.path for rs in layout.ranges.values() for r in rs), direct, alignment, largest + 2 * alignment
        )
        self._memory_backed = any(filesystem_type(path) in MEMORY_FILESYSTEMS for path in self._files.fds)
        self._executor = _Executor(queue_depth, "runahead-disk")
        self._cuda = _CudaCopier()
        self._registered: set[int] = set()
        self._closed = False

    @property
    def direct(self) -> bool:
        """True when every expert file is read with O_DIRECT (bypassing the page cache)."""
        return self._files.direct

    @property
    def direct_reason(self) -> str:
        """Why reads are buffered (empty when ``direct``)."""
        return "" if self.direct else self._files.reason

    @property
    def io_bytes(self) -> int:
        """Bytes read from the files, alignment padding included."""
        return self._files.io_bytes

    @property
    def memory_backed(self) -> bool:
        """True when an expert file lies on a memory filesystem (tmpfs...): even with O_DIRECT its
        reads run at memory speed, so they say nothing about a disk."""
        return self._memory_backed

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor) -> None:
        """Read expert ``(layer, expert)`` from disk into ``slot``; see :meth:`ExpertStore.read_into`."""
        key = (layer, expert)
        if key not in self._plans:
            raise KeyError(f"expert ({layer}, {expert}) is not in the layout")
        flat = _check_slot(self.layout, slot)
        await self._executor.run(self._read_blocking, key, flat)
        self.bytes_read += self._payload[key]
        self.reads += 1

    def _read_blocking(self, key: tuple[int, int], slot: torch.Tensor) -> None:
        cuda = slot.device.type == "cuda"
        for run in self._plans[key]:
            buf, base = self._files.read(run)
            if not cuda:
                _copy_run(buf, base, run, slot)
                continue
            self._register(buf)
            stream = self._cuda.stream(slot.device)
            with torch.cuda.stream(stream):
                _copy_run(buf, base, run, slot, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            done.synchronize()  # the buffer is reused by this thread's next read

    def _register(self, buf: mmap.mmap) -> None:
        """Page-lock a read buffer once so host -> device copies from it are true DMA (best effort)."""
        import ctypes

        ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        if ptr in self._registered:
            return
        with self._files._lock:
            if ptr not in self._registered:
                torch.cuda.cudart().cudaHostRegister(ptr, len(buf), 0)  # type: ignore[no-untyped-call]
                self._registered.add(ptr)

    def close(self) -> None:
        """Wait for in-flight reads, then close files and buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown()
        if self._registered:
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
            self._registered.clear()
        self._files.close()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else f"buffered ({self.direct_reason})"
        if self.memory_backed:
            mode += ", memory-backed files"
        return f"DiskStore({len(self._plans)} experts, queue_depth={self.queue_depth}, {mode})"


class HostStore:
    """Keeps every expert's slot image in host memory; ``read_into`` copies host -> slot.

    Memory: needs **all experts in RAM** at once (``len(layout.ranges) * slot_numel * itemsize``
    bytes of ``dtype``), loaded once at construction (from the files, with O_DIRECT where the
    filesystem allows, so the page cache does not hold a second copy). The image is pinned when
    ``pin_memory`` is True (default: when CUDA is available), so copies into CUDA slots are
    asynchronous DMA on a dedicated copy stream; the executor thread waits on an event, never the
    event loop. On CPU the copy is a plain ``copy_`` in the executor thread.

    ``bytes_read`` counts bytes copied out of the host image (the link traffic).
    """

    def __init__(
        self,
        layout: ExpertLayout,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool | None = None,
        queue_depth: int = 2,
    ) -> None:
        validate_layout(layout)
        self.layout = layout
        self.dtype = dtype
        self.queue_depth = queue_depth
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.bytes_read = 0
        self.reads = 0
        self._index = {key: i for i, key in enumerate(sorted(layout.ranges))}
        self.image = torch.empty(
            (len(self._index), layout.slot_numel), dtype=dtype, pin_memory=self.pin_memory
        )
        files = _FileReader((r.path for rs in layout.ranges.values() for r in rs), direct=True)
        try:
            for key, i in self._index.items():
                for run in _plan(layout, layout.ranges[key]):
                    buf, base = files.read(run)
                    _copy_run(buf, base, run, self.image[i])
        finally:
            files.close()
        self._slot_bytes = layout.slot_numel * self.image.element_size()
        self._executor = _Executor(queue_depth, "runahead-host")
        self._cuda = _CudaCopier()
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Host memory held by the expert images."""
        return self.image.numel() * self.image.element_size()

    def host_view(self, layer: int, expert: int) -> torch.Tensor:
        """The expert's slot image in host memory (a view; e.g. for CPU-assisted compute)."""
        return self.image[self._index[(layer, expert)]]

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor) -> None:
        """Copy expert ``(layer, expert)`` from host memory into ``slot`` (see ``ExpertStore.read_into``)."""
        key = (layer, expert)
        if key not in self._index:
            raise KeyError(f"expert ({layer}, {expert}) is not in the layout")
        flat = _check_slot(self.layout, slot)
        await self._executor.run(self._copy_blocking, self._index[key], flat)
        self.bytes_read += self._slot_bytes
        self.reads += 1

    def _copy_blocking(self, i: int, slot: torch.Tensor) -> None:
        src = self.image[i]
        if slot.device.type != "cuda":
            slot.copy_(src)
            return
        stream = self._cuda.stream(slot.device)
        with torch.cuda.stream(stream):
            slot.copy_(src, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        done.synchronize()

    def close(self) -> None:
        """Wait for in-flight copies and stop the threads. Idempotent. The host image is kept until
        the store is garbage collected (``host_view`` tensors may still refer to it)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown()

    def __enter__(self) -> HostStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostStore({len(self._index)} experts, {self.nbytes / 2**20:.1f} MiB {self.dtype}, "
            f"pinned={self.pin_memory}, queue_depth={self.queue_depth})"
        )


def make_store(
    kind: Literal["disk", "host"],
    layout: ExpertLayout,
    *,
    queue_depth: int = 2,
    direct: bool = True,
    dtype: torch.dtype = torch.float32,
    pin_memory: bool | None = None,
) -> DiskStore | HostStore:
    """Build the expert store named ``kind``: ``"disk"`` (:class:`DiskStore`, uses ``direct``) or
    ``"host"`` (:class:`HostStore`, uses ``dtype`` and ``pin_memory``). Called by the backend when it
    opens a model."""
    if kind == "disk":
        return DiskStore(layout, queue_depth=queue_depth, direct=direct)
    if kind == "host":
        return HostStore(layout, dtype=dtype, pin_memory=pin_memory, queue_depth=queue_depth)
    raise ValueError(f"unknown expert store {kind!r}; expected 'disk' or 'host'")
