"""Expert reads on C threads (``nativereads.c``): the stores' CPU path without Python reader threads.

On CPython a Python reader thread takes the GIL several times a read (its queue, the ``preadv``'s
return, each copy into the slot, the landing) and the event loop once more; a compute thread beside
it gives the GIL up at every torch call, so each of those takes is a wait for the compute, about
50 us of its CPU each (docs/results-torch.md, "GIL hand-offs"). Here the reads and the copies into
the slot run on C threads that never touch the interpreter: a finished read goes on a list, the
first one after the list was emptied writes one byte to a pipe, and the event loop, watching the
pipe (``loop.add_reader``), takes every finished read in one callback. A read then costs Python one
``submit`` call and a share of one callback.

``submit`` lets go of the GIL for its C call. The call wakes a reader thread, and on a machine with
few cores the woken reader may take the loop's core at once, until its copy ends: with the GIL kept,
the compute thread waited for the loop that whole time. On two cores a group reached the compute
thread 355 us (median) after the loop handed it over, against 82 us with the GIL let go, and the
bottleneck rule's hand-offs a group fell from 287-487 us to 157-186 (docs/results-torch.md, "The
readers' wake-up held the GIL"). ``drain`` wakes nobody and keeps it.

A :class:`NativeReads` serves one store: its files (a :class:`~runahead.store.files._FileReader`'s
descriptors, O_DIRECT where it opened them so) or its host image, and a :class:`Plan` per expert made
once (:func:`file_plan`, :func:`memory_plan`). Slots on the CPU only: a CUDA slot's copy goes
through a copy stream, on the Python path. The plan converts bfloat16 or float16 to float32 and
float32 to bfloat16 as torch's ``copy_`` does (round to nearest even); another pair of types, or no C
compiler, keeps the store on its Python reader threads. ``RUNAHEAD_NATIVE_READS=off`` does too (to compare).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import itertools
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from runahead import native
from runahead.store.base import ALIGNMENT, DTYPES, StoreError, _Executor, _Read, settle
from runahead.store.files import _FileReader

log = logging.getLogger("runahead.store")

SOURCE = Path(__file__).with_name("nativereads.c")

CONVERSIONS: dict[tuple[torch.dtype, torch.dtype], int] = {
    (torch.float32, torch.float32): 0,
    (torch.bfloat16, torch.bfloat16): 0,
    (torch.float16, torch.float16): 0,
    (torch.uint8, torch.uint8): 0,
    (torch.bfloat16, torch.float32): 1,
    (torch.float16, torch.float32): 2,
    (torch.float32, torch.bfloat16): 3,
}
"""(file dtype, slot dtype) pairs the C copy handles, and its conversion code (``CONV_*``)."""

AVX2_FLAGS = {"avx2", "fma", "f16c"}
"""CPU features (``/proc/cpuinfo``) for which the library is built with AVX2 (its conversions vectorise
wider); elsewhere it is built for the compiler's baseline."""

SHORT = -1
"""A completion's status when the file ended before the run did (``STATUS_SHORT``)."""

DRAIN = 256
"""Completions taken per C call when the loop drains."""


class Plan:
    """One expert's reads and copies as the C threads run them (``nativereads.c``, PLAN), made once.

    ``runs``: the file runs it reads (empty for a copy from memory), for error messages.
    """

    __slots__ = ("address", "runs", "table")

    def __init__(self, values: Sequence[int], runs: tuple[_Read, ...]) -> None:
        self.table = (ctypes.c_int64 * len(values))(*values)
        self.address = ctypes.addressof(self.table)
        self.runs = runs


def file_plan(reads: Sequence[_Read], files: dict[str, int], slot_dtype: torch.dtype) -> Plan | None:
    """The plan for an expert read as ``reads`` (its runs, :func:`~runahead.store.base._plan`) from
    the files numbered by ``files`` into a slot of ``slot_dtype``; None where a copy needs a
    conversion the C threads do not make."""
    values = [len(reads)]
    for run in reads:
        values += [files[run.path], run.offset, run.nbytes, len(run.parts)]
        for kind, nbytes, at, lo, _ in run.parts:
            source = torch.uint8 if slot_dtype == torch.uint8 else DTYPES[kind]
            conversion = CONVERSIONS.get((source, slot_dtype))
            if conversion is None:
                return None
            values += [conversion, at, lo * slot_dtype.itemsize, nbytes]
    return Plan(values, tuple(reads))


def memory_plan(address: int, nbytes: int) -> Plan:
    """The plan that copies ``nbytes`` from ``address`` into a slot (the host store's image)."""
    return Plan([1, -1, address, nbytes, 1, 0, 0, 0, nbytes], ())


class DirectRefused(Exception):
    """A read of ``path`` failed with EINVAL: if it was opened O_DIRECT, the filesystem took the flag
    but not the read (the store reopens it buffered and reads again)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: read refused (EINVAL)")
        self.path = path


class NativeReads:
    """``threads`` C reader threads over ``fds`` (path -> descriptor; ``direct``: those opened
    O_DIRECT, read in ``alignment`` blocks into buffers of ``buffer_size`` bytes).

    Raises ``OSError`` where the pool cannot start (use :func:`available` first).
    """

    def __init__(
        self,
        threads: int,
        fds: dict[str, int],
        direct: set[str],
        alignment: int,
        buffer_size: int,
    ) -> None:
        library = _library()
        if library is None:
            raise OSError(f"the native reader library is not available here: {_why_not()}")
        self._lib, self._blocking = library
        self.files = {path: i for i, path in enumerate(fds)}
        count = len(fds)
        descriptors = (ctypes.c_int * max(1, count))(*fds.values())
        directs = (ctypes.c_int * max(1, count))(*(int(p in direct) for p in fds))
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)  # a full pipe already wakes the loop
        handle = self._blocking.runahead_reads_open(
            threads, count, descriptors, directs, alignment, max(buffer_size, alignment), self._wake_write
        )
        if not handle:
            os.close(self._wake_read)
            os.close(self._wake_write)
            raise OSError("the native reader threads could not start")
        self._handle = handle
        self._waiting: dict[int, tuple[asyncio.Future[float], Plan]] = {}
        self._ids = itertools.count()  # next() is atomic: loops on two threads never share an id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._out = (ctypes.c_int64 * (4 * DRAIN))()
        self._closed = False
        self._calls = threading.Lock()  # a submit's C call (the GIL let go) against the pool's free
        self._draining = threading.Lock()  # ``_out`` is filled and read by one drain at a time
        self._freed = False
        self._final_io = 0

    @property
    def io_bytes(self) -> int:
        """Bytes read from the files by the C threads, alignment padding included."""
        return self._final_io if self._closed else int(self._lib.runahead_reads_io_bytes(self._handle))

    def set_file(self, path: str, fd: int, direct: bool) -> None:
        """Point ``path``'s reads at ``fd`` (a buffered reopen after O_DIRECT was refused)."""
        self._lib.runahead_reads_set_file(self._handle, self.files[path], fd, int(direct))

    def submit(self, plan: Plan, slot: int, until_ns: int = 0) -> asyncio.Future[float]:
        """Queue ``plan`` into the slot at address ``slot``; a future of the running loop, done when
        the bytes are in the slot and ``CLOCK_MONOTONIC`` has reached ``until_ns`` (0: no wait; a
        failed read lands at once). RuntimeError once the pool is closed."""
        if self._closed:  # first: a closed pool's pipe is closed, no loop may watch it
            raise RuntimeError("the native read pool is shut down")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._watch(loop)
        future: asyncio.Future[float] = loop.create_future()
        job = next(self._ids)
        self._waiting[job] = (future, plan)  # before the C call: a loop on another thread may drain it
        with self._calls:  # another thread's close may not free the pool under this call
            if self._freed:
                status = -1
            else:
                status = self._blocking.runahead_reads_submit(self._handle, job, plan.address, slot, until_ns)
        if status:
            del self._waiting[job]
            raise RuntimeError("the native read pool is shut down" if status < 0 else os.strerror(status))
        return future

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take completions on ``loop``, the last loop to submit. The one before gives the pipe up
        unless it is running on another thread (then both drain; each future is settled on its own
        loop)."""
        old = self._loop
        if old is not None and not old.is_closed() and not old.is_running():
            old.remove_reader(self._wake_read)
        loop.add_reader(self._wake_read, self._drain)
        self._loop = loop

    def _drain(self) -> None:
        """On a watching loop (or at close): empty the pipe, then settle every finished read's future."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        here = _running_loop()
        out = self._out
        with self._draining:  # one buffer: two loops draining at once would read each other's entries
            while n := self._lib.runahead_reads_drain(self._handle, out, DRAIN):
                for i in range(0, 4 * n, 4):
                    self._settle(out[i], out[i + 1], out[i + 2], out[i + 3], here)
                if n < DRAIN:
                    break

    def _settle(
        self, job: int, status: int, detail: int, landed_ns: int, here: asyncio.AbstractEventLoop | None
    ) -> None:
        """Settle ``job``'s future from the loop ``here`` (None: no loop runs on this thread), with
        the time it landed (``landed_ns`` on ``CLOCK_MONOTONIC``, as :func:`link_clock` reads it).

        NOTE (which thread may settle): two loops on two threads may both watch the pipe (one that
        submitted before the other took over still runs), so either may drain the other's reads. A
        future is settled directly only on its own loop's thread, or where no loop runs it at all;
        otherwise through ``call_soon_threadsafe``, which also wakes that loop: settled directly from
        another thread, its waiter would sleep in the selector for good.
        """
        future, plan = self._waiting.pop(job)
        error = None if status == 0 else self._error(plan, status, detail)
        loop = future.get_loop()
        if loop.is_closed():
            return  # nobody can await it any more
        if loop is here or (here is None and not loop.is_running()):
            settle(future, error, landed_ns / 1e9)
        else:  # its loop runs on another thread
            loop.call_soon_threadsafe(settle, future, error, landed_ns / 1e9)

    @staticmethod
    def _error(plan: Plan, status: int, detail: int) -> BaseException:
        if not 0 <= detail < len(plan.runs):  # a copy from memory cannot fail but for want of memory
            return OSError(status, os.strerror(status))
        run = plan.runs[detail]
        if status == SHORT:
            try:
                size = f"file has {os.stat(run.path).st_size} bytes"
            except OSError as error:
                size = f"cannot stat it: {error}"
            return StoreError(
                f"{run.path}: file is truncated: expected bytes {run.offset}..{run.offset + run.nbytes}, "
                + size
            )
        if status == errno.EINVAL:
            return DirectRefused(run.path)
        return StoreError(
            f"{run.path}: read of {run.nbytes} bytes at offset {run.offset} failed: "
            f"[Errno {status}] {os.strerror(status)}"
        )

    def close(self) -> None:
        """Let queued reads finish (a capped one at the end of its link time: at most the reads in
        flight times one read's link time), stop the threads and settle what they finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._blocking.runahead_reads_close(self._handle)  # joins the threads: the GIL is let go
        self._final_io = int(self._lib.runahead_reads_io_bytes(self._handle))
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running() and not _runs(loop):
            loop.call_soon_threadsafe(self._finish)  # the loop's own thread settles and unregisters
        else:
            self._finish()

    def _finish(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            self._drain()
            loop.remove_reader(self._wake_read)
        with self._calls:
            self._blocking.runahead_reads_free(self._handle)
            self._freed = True
        os.close(self._wake_read)
        os.close(self._wake_write)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The loop running on this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _runs(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is the one running on this thread."""
    return _running_loop() is loop


async def read(
    executor: _Executor, reads: NativeReads, files: _FileReader, plan: Plan, address: int, carries: int
) -> float:
    """``plan`` into the memory at ``address`` on ``reads``' threads, through ``executor`` (its link
    cap, its wait for a cancelled read); a file whose O_DIRECT reads the filesystem refuses is
    reopened buffered (once, in ``files``) and the read made again. Returns when it landed
    (:meth:`_Executor.run`)."""
    try:
        return await executor.run_native(reads, plan, address, carries=carries)
    except DirectRefused as refused:  # the filesystem took O_DIRECT at open, not at the read
        if refused.path in files.direct_paths:  # else a read beside this one reopened it
            reads.set_file(refused.path, files.reopen_buffered(refused.path), direct=False)
        try:
            return await executor.run_native(reads, plan, address, carries=carries)
        except DirectRefused:  # refused buffered too: not O_DIRECT's doing
            raise StoreError(f"{refused.path}: read failed: [Errno 22] Invalid argument") from None


def native_reads(
    threads: int, files: _FileReader | None = None, want: bool | None = None
) -> NativeReads | None:
    """C reader threads for a store reading ``files`` (None: one copying from memory only), or None:
    where ``want`` is False, or None and they are not available here (the store reads on Python
    threads). ``want`` True raises ``OSError`` where they are not."""
    if want is False or (want is None and not available()):
        return None
    try:
        if files is None:
            return NativeReads(threads, {}, set(), ALIGNMENT, 0)
        return NativeReads(
            threads, dict(files.fds), set(files.direct_paths), files.alignment, files.buffer_size
        )
    except OSError as error:
        if want:
            raise
        log.warning("native reads off for this store: %s; it reads on Python threads", error)
        return None


def available() -> bool:
    """Whether stores read through C threads here (the library builds, and not turned off)."""
    return _library() is not None


@functools.cache
def _library() -> tuple[ctypes.PyDLL, ctypes.CDLL] | None:
    """The reader library twice: calls that keep the GIL (short, wake no thread: drain, the counters)
    and calls that give it up (submit, which wakes a reader; open, close, which start and join
    threads); None where it is off or cannot be built, with the reason logged once."""
    if os.environ.get("RUNAHEAD_NATIVE_READS", "on").lower() in ("off", "0", "false", "no"):
        _REASON.append("RUNAHEAD_NATIVE_READS is off")
        log.info("native reads off: RUNAHEAD_NATIVE_READS is off; stores read on Python threads")
        return None
    try:
        vector = () if native.cpu_lacks(AVX2_FLAGS) else ("-mavx2", "-mfma", "-mf16c")
        path = str(native.build(SOURCE, ("-O3", "-shared", "-fPIC", "-pthread", *vector)))
        keeping, blocking = ctypes.PyDLL(path), ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as error:  # a missing compiler, a failed build or load
        _REASON.append(f"the reader library did not build ({error})")
        log.info("native reads off: %s; stores read on Python threads", _REASON[-1])
        return None
    _declare(keeping)
    _declare(blocking)
    return keeping, blocking


_REASON: list[str] = []


def _why_not() -> str:
    return _REASON[-1] if _REASON else "unknown"


def _declare(library: ctypes.CDLL) -> None:
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures: dict[str, tuple[list[object], object]] = {
        "runahead_reads_open": ([i32, i32, pointer, pointer, i64, i64, i32], pointer),
        "runahead_reads_submit": ([pointer, i64, pointer, pointer, i64], i32),
        "runahead_reads_drain": ([pointer, pointer, i64], i64),
        "runahead_reads_set_file": ([pointer, i32, i32, i32], None),
        "runahead_reads_io_bytes": ([pointer], i64),
        "runahead_reads_close": ([pointer], None),
        "runahead_reads_free": ([pointer], None),
    }
    for name, (arguments, result) in signatures.items():
        function: Callable[..., object] = getattr(library, name)
        function.argtypes = arguments  # type: ignore[attr-defined]
        function.restype = result  # type: ignore[attr-defined]
