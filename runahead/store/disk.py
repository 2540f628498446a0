"""The disk store: experts read from the model's safetensors files with ``O_DIRECT``."""

from __future__ import annotations

import logging
import mmap
from typing import Any

import torch

from runahead.backend import READS_IN_FLIGHT
from runahead.models.layout import ExpertLayout
from runahead.store.base import (
    ALIGNMENT,
    MEMORY_FILESYSTEMS,
    _check_slot,
    _CudaCopier,
    _Executor,
    _link_note,
    _plan,
    filesystem_type,
    validate_layout,
)
from runahead.store.files import _copy_run, _FileReader
from runahead.store.native import Plan, file_plan, native_reads, read

log = logging.getLogger("runahead.store")


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
    actually read, alignment padding included. ``link_bandwidth`` (bytes per second): reads are paced
    to a serial link of that rate (:class:`~runahead.store.link.LinkCap`), their payload bytes each.

    ``native``: reads into CPU slots run on C threads that never take the GIL
    (:mod:`runahead.store.native`: the ``preadv`` and the copies, not the Python threads above);
    None (default) where the library builds here, False never, True or an error saying why not.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        queue_depth: int = READS_IN_FLIGHT,
        direct: bool = True,
        alignment: int = ALIGNMENT,
        link_bandwidth: float | None = None,
        native: bool | None = None,
    ) -> None:
        validate_layout(layout)
        self.layout = layout
        self.queue_depth = queue_depth
        self.bytes_read = 0
        self.reads = 0
        self._plans = {key: _plan(layout, key) for key in layout.ranges}
        self._payload = {key: sum(r.nbytes for r in ranges) for key, ranges in layout.ranges.items()}
        largest = max((run.nbytes for plan in self._plans.values() for run in plan), default=0)
        self._files = _FileReader(
            (r.path for rs in layout.ranges.values() for r in rs), direct, alignment, largest + 2 * alignment
        )
        self._memory_backed = any(filesystem_type(path) in MEMORY_FILESYSTEMS for path in self._files.fds)
        self._executor = _Executor(queue_depth, "runahead-disk", link_bandwidth)
        self._native = native_reads(queue_depth, self._files, native)
        self._native_plans: dict[torch.dtype, dict[tuple[int, int], Plan | None]] = {}
        self._cuda = _CudaCopier()
        self._registered: set[int] = set()  # read buffers page-locked for DMA
        self._unpinnable: set[int] = set()
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
        return self._files.io_bytes + (0 if self._native is None else self._native.io_bytes)

    @property
    def native(self) -> bool:
        """True when reads into CPU slots run on C threads (:mod:`runahead.store.native`)."""
        return self._native is not None

    @property
    def memory_backed(self) -> bool:
        """True when an expert file lies on a memory filesystem (tmpfs...): even with O_DIRECT its
        reads run at memory speed, so they say nothing about a disk."""
        return self._memory_backed

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor, after: Any = None) -> float:
        """Read expert ``(layer, expert)`` from disk into ``slot``; see :meth:`ExpertStore.read_into`."""
        key = (layer, expert)
        if key not in self._plans:
            raise KeyError(f"expert ({layer}, {expert}) is not in the layout")
        flat = _check_slot(self.layout, slot)
        native, plan = self._native, None
        if native is not None and flat.device.type == "cpu":
            plan = self._native_plan(key, flat.dtype)
        carries = self._payload[key]
        if native is None or plan is None:
            landed = await self._executor.run(self._read_blocking, key, flat, after, carries=carries)
        else:
            landed = await read(self._executor, native, self._files, plan, flat.data_ptr(), carries)
        self.bytes_read += self._payload[key]
        self.reads += 1
        return landed

    def _native_plan(self, key: tuple[int, int], dtype: torch.dtype) -> Plan | None:
        """The C threads' plan for ``key`` into a slot of ``dtype`` (None: a conversion they do not
        make), made at the expert's first read: making every expert's at once held the event loop
        ~3 us an expert at the first read (the medium model's 1024 in 2.6-3.0 ms; ~30 ms for a
        40 x 256 model), while every request waited."""
        plans = self._native_plans.setdefault(dtype, {})
        try:
            return plans[key]
        except KeyError:
            assert self._native is not None
            plan = plans[key] = file_plan(self._plans[key], self._native.files, dtype)
            return plan

    def _read_blocking(self, key: tuple[int, int], slot: torch.Tensor, after: Any) -> None:
        stream = self._cuda.begin(slot.device, after) if slot.device.type == "cuda" else None
        for run in self._plans[key]:
            buf, base = self._files.read(run)
            if stream is None:
                _copy_run(buf, base, run, slot)
                continue
            pinned = self._register(buf)
            with torch.cuda.stream(stream):
                _copy_run(buf, base, run, slot, non_blocking=pinned)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            done.synchronize()  # the buffer is reused by this thread's next read

    def _register(self, buf: mmap.mmap) -> bool:
        """Page-lock a read buffer once, so host -> device copies from it are asynchronous DMA.

        Returns False where CUDA refuses (the copy is then a synchronous one from pageable memory),
        with one warning.
        """
        import ctypes

        ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        if ptr in self._registered:
            return True
        if ptr in self._unpinnable:
            return False
        with self._files._lock:
            if ptr not in self._registered and ptr not in self._unpinnable:
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                error = cudart.cudaHostRegister(ptr, len(buf), 0)
                if int(error) == 0:
                    self._registered.add(ptr)
                else:
                    self._unpinnable.add(ptr)
                    log.warning(
                        "cudaHostRegister of a %d-byte read buffer failed (CUDA error %d): expert "
                        "copies to the device go from pageable memory, synchronously",
                        len(buf),
                        int(error),
                    )
        return ptr in self._registered

    def close(self) -> None:
        """Wait for in-flight reads, then close files and buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown()
        if self._native is not None:
            self._native.close()
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
        mode += _link_note(self._executor)
        if self._native is not None:
            mode += ", reads on C threads"
        return f"DiskStore({len(self._plans)} experts, queue_depth={self.queue_depth}, {mode})"
