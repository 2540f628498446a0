"""The host store: every expert kept in (pinned) host memory, copied into slots on demand."""

from __future__ import annotations

from typing import Any

import torch

from runahead.backend import READS_IN_FLIGHT
from runahead.models.layout import ExpertLayout
from runahead.store.base import (
    _check_slot,
    _CudaCopier,
    _Executor,
    _link_note,
    _plan,
    validate_layout,
)
from runahead.store.files import _copy_run, _FileReader
from runahead.store.memory import huge_page_tensor
from runahead.store.native import memory_plan, native_reads


class HostStore:
    """Keeps every expert's slot image in host memory; ``read_into`` copies host -> slot.

    Memory: needs **all experts in RAM** at once (``len(layout.ranges) * slot_numel * itemsize``
    bytes of ``dtype``), loaded once at construction (from the files, with O_DIRECT where the
    filesystem allows, so the page cache does not hold a second copy). The image is pinned when
    ``pin_memory`` is True (default: when CUDA is available), so copies into CUDA slots are
    asynchronous DMA on a dedicated copy stream; the executor thread waits on an event, never the
    event loop. On CPU the copy is a plain ``copy_`` in the executor thread.

    ``bytes_read`` counts bytes copied out of the host image (the link traffic); with
    ``link_bandwidth`` (bytes per second) each copy is paced to a serial link of that rate
    (:class:`~runahead.store.link.LinkCap`), so host memory can stand in for a slower device link.
    ``native``: copies into CPU slots of the image's dtype run on C threads, as
    :class:`~runahead.store.disk.DiskStore`'s reads do (None: where available).
    """

    def __init__(
        self,
        layout: ExpertLayout,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool | None = None,
        queue_depth: int = READS_IN_FLIGHT,
        link_bandwidth: float | None = None,
        native: bool | None = None,
    ) -> None:
        validate_layout(layout)
        self.layout = layout
        self.dtype = torch.uint8 if layout.stored else dtype  # a stored layout keeps the file's bytes
        self.queue_depth = queue_depth
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.bytes_read = 0
        self.reads = 0
        self._index = {key: i for i, key in enumerate(sorted(layout.ranges))}
        shape = (len(self._index), layout.slot_numel)
        self.image = (
            torch.empty(shape, dtype=self.dtype, pin_memory=True)  # CUDA's copies need it page-locked
            if self.pin_memory
            else huge_page_tensor(shape, self.dtype)  # what every read copies from
        )
        files = _FileReader((r.path for rs in layout.ranges.values() for r in rs), direct=True)
        try:
            for key, i in self._index.items():
                for run in _plan(layout, key):
                    buf, base = files.read(run)
                    _copy_run(buf, base, run, self.image[i])
        finally:
            files.close()
        self._slot_bytes = layout.slot_numel * self.image.element_size()
        self._executor = _Executor(queue_depth, "runahead-host", link_bandwidth)
        self._native = native_reads(queue_depth, None, native) if self.image.device.type == "cpu" else None
        base, stride = self.image.data_ptr(), self._slot_bytes
        self._native_plans = (
            []
            if self._native is None
            else [memory_plan(base + i * stride, stride) for i in range(len(self._index))]
        )
        self._cuda = _CudaCopier()
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Host memory held by the expert images."""
        return self.image.numel() * self.image.element_size()

    def host_view(self, layer: int, expert: int) -> torch.Tensor:
        """The expert's slot image in host memory (a view; e.g. for CPU-assisted compute)."""
        return self.image[self._index[(layer, expert)]]

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor, after: Any = None) -> float:
        """Copy expert ``(layer, expert)`` from host memory into ``slot`` (see ``ExpertStore.read_into``)."""
        key = (layer, expert)
        if key not in self._index:
            raise KeyError(f"expert ({layer}, {expert}) is not in the layout")
        flat = _check_slot(self.layout, slot)
        i = self._index[key]
        native = self._native
        if native is not None and flat.device.type == "cpu" and flat.dtype == self.dtype:
            landed = await self._executor.run_native(
                native, self._native_plans[i], flat.data_ptr(), carries=self._slot_bytes
            )
        else:
            landed = await self._executor.run(self._copy_blocking, i, flat, after, carries=self._slot_bytes)
        self.bytes_read += self._slot_bytes
        self.reads += 1
        return landed

    def _copy_blocking(self, i: int, slot: torch.Tensor, after: Any) -> None:
        src = self.image[i]
        if slot.device.type != "cuda":
            slot.copy_(src)
            return
        stream = self._cuda.begin(slot.device, after)
        with torch.cuda.stream(stream):
            slot.copy_(src, non_blocking=self.pin_memory)
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
        if self._native is not None:
            self._native.close()

    def __enter__(self) -> HostStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostStore({len(self._index)} experts, {self.nbytes / 2**20:.1f} MiB {self.dtype}, "
            f"pinned={self.pin_memory}, queue_depth={self.queue_depth}{_link_note(self._executor)})"
        )
