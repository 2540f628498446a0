"""Reading byte ranges of safetensors files, with ``O_DIRECT`` where the filesystem allows it."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Iterable

import torch

from runahead.store.base import ALIGNMENT, DTYPES, StoreError, _Read

log = logging.getLogger("runahead.store")


class _FileReader:
    """Opens each expert file once (``O_DIRECT`` when it can) and reads runs into per-thread buffers.

    Thread safe: ``os.preadv`` carries its own offset, and each thread has its own aligned buffer.
    A file whose filesystem refuses O_DIRECT, at open or at its first read (EINVAL: some overlay and
    network filesystems accept the flag but not the reads), is read buffered instead, with a warning
    on the ``runahead.store`` logger naming the file and ``reason`` saying why. On macOS, which has no
    ``O_DIRECT``, files are opened with ``F_NOCACHE`` instead (reads bypass the page cache; counted
    as direct).
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
        self._retired: list[int] = []  # O_DIRECT descriptors replaced by buffered ones
        self._lock = threading.Lock()
        o_direct = getattr(os, "O_DIRECT", 0)
        nocache = _F_NOCACHE if direct and not o_direct else None
        if direct and not o_direct and nocache is None:
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
                    self._refused(path, "open")
            if fd < 0:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    self.close()
                    raise StoreError(f"{path}: cannot open expert file: {exc}") from exc
                if nocache is not None:  # macOS: no O_DIRECT, but F_NOCACHE keeps reads off the page cache
                    import fcntl

                    fcntl.fcntl(fd, nocache, 1)
                    self.direct_paths.add(path)
            self.fds[path] = fd

    def _refused(self, path: str, when: str) -> None:
        """Note (once per file) that ``path``'s filesystem refused O_DIRECT at ``when``."""
        reason = f"O_DIRECT refused by the filesystem of {path} (EINVAL at {when}); using buffered reads"
        if not self.reason:
            self.reason = reason
        log.warning(
            "%s: reads of this file may come from the page cache, not the disk; bind-mount the model "
            "from a disk filesystem (not an overlay or tmpfs) to measure the disk",
            reason,
        )

    def reopen_buffered(self, path: str, fd: int | None = None) -> int:
        """Replace ``path``'s O_DIRECT descriptor (``fd``, or whichever it has) by a buffered one (once,
        thread safe); returns the buffered one. The old one stays open until :meth:`close`: another
        thread may be about to read it."""
        with self._lock:
            old = self.fds.get(path)
            if path in self.direct_paths and old is not None and fd in (None, old):
                try:
                    buffered = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise StoreError(f"{path}: cannot reopen expert file for buffered reads: {exc}") from exc
                self.fds[path] = buffered
                self.direct_paths.discard(path)
                self._retired.append(old)
                self._refused(path, "read")
            return self.fds[path]

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
            try:
                return self._read(fd, run, direct=True)
            except _DirectRefused:
                fd = self.reopen_buffered(run.path, fd)
        return self._read(fd, run, direct=False)

    def _read(self, fd: int, run: _Read, direct: bool) -> tuple[mmap.mmap, int]:
        if direct:
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
                    if direct and exc.errno == errno.EINVAL:
                        raise _DirectRefused from exc
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
        for fd in (*self.fds.values(), *self._retired):
            os.close(fd)
        self.fds.clear()
        self._retired.clear()
        with self._lock:
            for buf in self._buffers:
                buf.close()
            self._buffers.clear()


_F_NOCACHE: int | None = 48 if sys.platform == "darwin" else None
"""``fcntl``'s ``F_NOCACHE`` on macOS (``<sys/fcntl.h>``): reads of such a file bypass the unified
buffer cache, macOS's stand-in for ``O_DIRECT``; None elsewhere."""


class _DirectRefused(Exception):
    """An O_DIRECT read failed with EINVAL: the filesystem took the flag at open but not the read."""


def _copy_run(
    buf: mmap.mmap, base: int, run: _Read, slot: torch.Tensor, *, non_blocking: bool = False
) -> None:
    """Copy each range of ``run`` (``buf`` from byte ``base``) into its part of ``slot``, converting dtype.

    A byte (``uint8``) slot is a stored layout's: its ranges are copied as they are (quantized blocks).
    """
    for kind, nbytes, at, lo, hi in run.parts:
        dtype = torch.uint8 if slot.dtype == torch.uint8 else DTYPES[kind]
        src = torch.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=base + at)
        slot[lo:hi].copy_(src, non_blocking=non_blocking)
        del src  # release the buffer export before the buffer is reused or closed
