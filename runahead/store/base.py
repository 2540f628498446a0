"""Slots, the store protocol, layout checks and the worker pool the expert stores share."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from runahead.models.layout import ROLE_SETS, ExpertLayout, TensorRange, role_shape, stored_nbytes
from runahead.store.link import LinkCap, link_clock
from runahead.store.memory import huge_page_tensor

if TYPE_CHECKING:
    from runahead.store.native import NativeReads, Plan

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


class StoreClosed(RuntimeError):
    """A read was asked of a closed store: nothing more can be read (the runtime stops)."""


class StoreError(ValueError):
    """A layout range that does not match the layout's shapes, or a file that does not hold it."""


class SlotPool:
    """The expert cache's slot memory: one preallocated ``[num_slots, slot_numel]`` tensor.

    Created once by the backend; on CUDA it lives on the device. ``slot(i)`` is a view into it, so
    a store that writes the view writes the cache. For a ``stored`` layout (GGUF) the slots are
    bytes (``uint8``) holding experts as their file stores them (:meth:`for_layout`).
    """

    @classmethod
    def for_layout(
        cls,
        num_slots: int,
        layout: ExpertLayout,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> SlotPool:
        """Slots for ``layout``'s experts: in ``dtype``, or bytes as stored when ``layout.stored``."""
        return cls(num_slots, layout.slot_numel, torch.uint8 if layout.stored else dtype, device)

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
        self.data = (
            huge_page_tensor((num_slots, slot_numel), dtype)  # what the kernel streams: fewer TLB misses
            if self.device.type == "cpu"
            else torch.empty((num_slots, slot_numel), dtype=dtype, device=self.device)
        )
        # NOTE (views made once): ``data[i]`` is a torch call that lets go of the GIL, and the event
        # loop asks for a slot at every read while the compute thread runs Python: a call that lets
        # go of the GIL can then wait for it up to the switch interval (docs/results-torch.md).
        self._views = list(self.data.unbind(0))

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i`` as a contiguous 1-D view of ``slot_numel`` elements (no copy)."""
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range [0, {self.num_slots})")
        return self._views[i]

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

    async def read_into(self, layer: int, expert: int, slot: torch.Tensor, after: Any = None) -> float | None:
        """Fill ``slot`` (``slot_numel`` elements) with expert ``(layer, expert)`` in the slot format.

        Called by the backend's ``fetch``; returns when the bytes are in the slot, with the time they
        were (on ``time.monotonic``, as the reading thread saw it; None where the store cannot
        tell): the event loop may take a landing late, after a group it computed itself, and the
        runtime records the link's busy time from this. Never blocks the event loop. ``after``: a
        CUDA event the copy into a device slot must wait for (recorded after the last kernels that
        read the slot's previous expert); the copy stream waits, not the host.
        """
        ...

    def close(self) -> None:
        """Release threads, files and buffers. Idempotent; later reads raise ``RuntimeError``."""
        ...


# ---------------------------------------------------------------------------------------------
# Layout validation and read plans


def _strip_leading_ones(shape: Sequence[int], keep: int) -> tuple[int, ...]:
    dims = tuple(shape)
    while len(dims) > keep and dims[0] == 1:
        dims = dims[1:]
    return dims


def _where(r: TensorRange) -> str:
    return f"{r.path} at offset {r.offset} ({r.role})"


def validate_layout(layout: ExpertLayout, check_files: bool = True) -> None:
    """Check every expert's ranges against the layout's shapes; raise :class:`StoreError` if one is off.

    Each expert needs ``gate`` + ``up`` + ``down`` or ``gate_up`` + ``down``; each range's shape (leading
    1-dims ignored) must be the role's ``[I, H]`` / ``[H, I]`` / ``[2I, H]``, its dtype one of
    :data:`DTYPES` (of :data:`~runahead.models.layout.STORED_TYPES` for a stored layout, the same for
    every expert of a layer) and ``nbytes`` the shape's size in that type. With ``check_files``
    every range must lie inside its file (a truncated file is named). Called by the stores' constructors.
    """
    hidden, inter = layout.hidden_size, layout.intermediate_size
    sizes: dict[str, int] = {}
    for (layer, expert), ranges in layout.ranges.items():
        roles = tuple(sorted(r.role for r in ranges))
        if roles not in ROLE_SETS:
            raise StoreError(
                f"expert ({layer}, {expert}): ranges have roles {list(roles)}; expected one of "
                + ", ".join("+".join(s) for s in ROLE_SETS)
            )
        if layout.stored:
            kinds = tuple(sorted((r.role, r.dtype) for r in ranges))
            first = tuple(sorted((r.role, r.dtype) for r in layout.ranges[layer, 0]))
            if kinds != first:
                raise StoreError(f"expert ({layer}, {expert}): types {kinds} differ from expert 0's {first}")
        for r in ranges:
            if r.dtype not in DTYPES and not layout.stored:
                raise StoreError(
                    f"{_where(r)}: unsupported dtype {r.dtype!r}; expected one of {sorted(DTYPES)}"
                )
            want = role_shape(r.role, hidden, inter)
            found = _strip_leading_ones(r.shape, len(want))
            if found != want:
                raise StoreError(
                    f"{_where(r)}: expected shape {list(want)} for H={hidden}, I={inter}, "
                    f"found {list(r.shape)}"
                )
            if layout.stored:
                try:
                    want_bytes = stored_nbytes(r.dtype, want)
                except ValueError as exc:
                    raise StoreError(f"{_where(r)}: {exc}") from None
            else:
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
    parts: tuple[_Part, ...]  # each copy the run's bytes make into the slot


_Part = tuple[str, int, int, int, int]
"""One copy of a read into a slot: ``(file dtype, bytes, byte offset in the run, slot start, slot
stop)``; ranges back to back both in the file and in the slot, of one dtype, are one part."""


def _plan(layout: ExpertLayout, key: tuple[int, int]) -> tuple[_Read, ...]:
    """Group expert ``key``'s ranges into reads (same file and back to back -> one read), and each
    read's ranges into copies (back to back in the slot too, one dtype -> one copy: a Qwen3-MoE
    expert's gate and up lie so in both, so its read copies twice, not three times)."""
    ranges: Iterable[TensorRange] = layout.ranges[key]
    offsets = layout.part_offsets(key[0])
    reads: list[_Read] = []
    run: list[TensorRange] = []

    def flush() -> None:
        if run:
            start = run[0].offset
            parts: list[_Part] = []
            for r in run:
                lo, hi = offsets[r.role]
                if parts and parts[-1][0] == r.dtype and parts[-1][4] == lo:
                    dtype, nbytes, at, first, _ = parts[-1]  # this range follows the last part's
                    parts[-1] = (dtype, nbytes + r.nbytes, at, first, hi)
                else:
                    parts.append((r.dtype, r.nbytes, r.offset - start, lo, hi))
            reads.append(_Read(run[0].path, start, run[-1].offset + run[-1].nbytes - start, tuple(parts)))
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
    return slot if slot.dim() == 1 else slot.view(-1)  # dim() keeps the GIL; view lets go of it


# ---------------------------------------------------------------------------------------------
# Reading byte ranges


class _Landings:
    """Reads that landed on worker threads, handed to one event loop in batches.

    A read that lands while an earlier landing's wake-up is still queued on the loop joins that
    batch instead of waking the loop again, and no concurrent future is chained to an asyncio one
    per read: together they halve the event loop's CPU a read here (``bench/read_cost.py``,
    docs/results-torch.md). Reads kept in flight land close together.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._landed: deque[tuple[asyncio.Future[float], BaseException | None, float]] = deque()
        self._queued = False  # a wake-up is queued on the loop and has not run yet

    def add(self, future: asyncio.Future[float], error: BaseException | None, landed: float) -> None:
        """From a worker thread: ``future``'s read is done (or failed with ``error``) at ``landed``
        (seconds on :func:`link_clock`)."""
        self._landed.append((future, error, landed))
        if self._queued:
            return  # appended before the queued wake-up clears the flag: it delivers this one too
        self._queued = True
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these reads any more
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        self._queued = False  # first: a read landing from now on queues its own wake-up
        landed = self._landed
        while landed:
            settle(*landed.popleft())


def settle(future: asyncio.Future[float], error: BaseException | None, landed: float) -> None:
    """A read's outcome into its future, unless it was cancelled: done, its result the time the
    read landed (seconds on :func:`link_clock`), or failed with ``error``."""
    if future.cancelled():
        return
    if error is None:
        future.set_result(landed)
    else:
        future.set_exception(error)


_Work = tuple[_Landings, "asyncio.Future[float]", Callable[..., None], tuple[Any, ...], "float | None"]
"""A queued read: where it lands, its future, the blocking call with its arguments, and when on
:func:`link_clock` it may land at the earliest (None: as soon as the call returns)."""


class _ReadPool:
    """``size`` threads that run blocking reads; each read's completion comes back to the loop
    that asked for it, through that loop's :class:`_Landings`."""

    def __init__(self, size: int, name: str) -> None:
        self._work: SimpleQueue[_Work | None] = SimpleQueue()
        self._landings: _Landings | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=True) for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, fn: Callable[..., None], args: tuple[Any, ...], until: float | None = None
    ) -> asyncio.Future[float]:
        """Queue ``fn(*args)``; a future of the running loop, done when it has run and, where ``until``
        is given, :func:`link_clock` has reached it (a failed call lands at once), its result that
        moment on :func:`link_clock`. RuntimeError once the pool is shut down."""
        loop = asyncio.get_running_loop()
        landings = self._landings
        if landings is None or landings.loop is not loop:
            landings = self._landings = _Landings(loop)
        future: asyncio.Future[float] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the read pool is shut down")
            self._work.put((landings, future, fn, args, until))
        return future

    def _serve(self) -> None:
        work = self._work
        while (item := work.get()) is not None:
            landings, future, fn, args, until = item
            error: BaseException | None = None
            try:
                fn(*args)
            except BaseException as failed:  # handed to the reader, as a thread pool's future would
                error = failed
            else:
                if until is not None and (left := until - link_clock()) > 0:
                    time.sleep(left)  # the bytes are in; the link is still carrying them
            landings.add(future, error, link_clock())
            del item, future, error  # hold no reference while idle

    def shutdown(self) -> None:
        """Refuse new reads, let the queued ones run, and wait for the threads to end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._work.put(None)
        for thread in self._threads:
            thread.join()


class _Executor:
    """The store's pool of ``queue_depth`` read threads, shared by every store, and its link.

    ``link_bandwidth`` (bytes per second, or None for none): every read is paced by a
    :class:`LinkCap` of that bandwidth, given the bytes it carries (``run(..., carries=n)``).
    """

    def __init__(self, queue_depth: int, name: str, link_bandwidth: float | None = None) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self.link = None if link_bandwidth is None else LinkCap(link_bandwidth)
        self.pool: _ReadPool | None = _ReadPool(queue_depth, name)
        self.closing = False

    async def run(self, fn: Callable[..., None], *args: Any, carries: int = 0) -> float:
        """Run ``fn(*args)`` on the pool; return when it landed, on ``time.monotonic`` (the read's
        thread notes it: the event loop may take the landing much later, after a group it computed
        itself). If the caller is cancelled, wait for the read to land before re-raising, so the
        slot is no longer being written when the cancellation lands. With a link cap, return no
        earlier than the ``carries`` bytes could cross the link: the reader thread holds the read
        back until then (see :func:`link_clock`)."""
        pool = self.pool
        if pool is None or self.closing:
            raise StoreClosed("expert store is closed")
        return await self._land(lambda until: pool.submit(fn, args, until), carries)

    async def run_native(self, reads: NativeReads, plan: Plan, slot: int, carries: int = 0) -> float:
        """:meth:`run` for a read on C threads: ``plan`` into the slot at address ``slot``."""
        if self.closing:
            raise StoreClosed("expert store is closed")
        return await self._land(
            lambda until: reads.submit(plan, slot, 0 if until is None else round(until * 1e9)), carries
        )

    async def _land(self, submit: Callable[[float | None], asyncio.Future[float]], carries: int) -> float:
        until = None if self.link is None else self.link.reserve(carries, link_clock())
        try:
            fut = submit(until)
        except RuntimeError:  # shut down between the check and the submit, from another thread
            raise StoreClosed("expert store is closed") from None
        try:
            landed = await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    continue
                except Exception:
                    break
            raise
        return landed_on_monotonic(landed)

    def shutdown(self) -> None:
        self.closing = True  # refuse new reads at once; the ones in flight finish
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


_ONE_CLOCK = time.get_clock_info("monotonic").implementation == "clock_gettime(CLOCK_MONOTONIC)"
"""Whether ``time.monotonic`` is :func:`link_clock`'s ``CLOCK_MONOTONIC`` (Linux): then a landing
time needs no conversion."""


def landed_on_monotonic(landed: float) -> float:
    """A landing time read on :func:`link_clock` as the runtime's clock (``time.monotonic``) reads
    it: the same number where they are one clock; elsewhere now on the one less how long ago on the
    other, so the two need not share an origin.

    NOTE (the order of the two reads). A thread switch between them shifts the result by its
    length: reading ``link_clock`` first shifts it late, never early, so a read is never dated
    before its bytes could cross a capped link (the other order dated one 12 us early in a CI run)."""
    if _ONE_CLOCK:
        return landed
    ago = link_clock() - landed
    return time.monotonic() - max(0.0, ago)


def _link_note(executor: _Executor) -> str:
    """``, link capped at X GB/s`` for a store's repr, or nothing."""
    return "" if executor.link is None else f", link capped at {executor.link.bandwidth / 1e9:g} GB/s"


class _CudaCopier:
    """A dedicated copy stream per CUDA device; copies wait on an event in the calling (worker) thread.

    The streams are torch's non-blocking pool streams: they never wait for the compute stream
    implicitly, which is why a copy into a slot waits for the slot's fence (``after``) explicitly.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            return self._streams[device]

    def begin(self, device: torch.device, after: Any) -> torch.cuda.Stream:
        """The device's copy stream, made to wait (on the device) for the CUDA event ``after``."""
        stream = self.stream(device)
        if after is not None:
            stream.wait_event(after)
        return stream
