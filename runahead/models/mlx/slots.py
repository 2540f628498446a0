"""The expert cache in MLX memory: one fixed pool of slots per expert tensor, and reads into it.

Each tensor of an expert (``gate.weight``, ``gate.scales``, ``gate.biases``, ``up...``, ``down...``)
has one pool ``[num_slots, *shape]``; slot ``s`` of every pool holds one expert, so a group's routed
experts are one gathered matmul over slot indices (``mx.gather_mm`` / ``mx.gather_qmm``).

Writing a slot: MLX arrays are values, and ``pool[s] = expert`` is a slice update that MLX performs
in place when nothing else holds the pool's buffer (measured: 0.05-0.2 ms for a 0.5 MiB expert
into pools of 32 MiB and 256 MiB, versus ~2 ms to stack just 8 experts from per-slot arrays and
~90 ms to stack 64; ``bench/mlx_slots.py``). If a pending computation still held the pool, the
update would copy the whole pool instead. So slot writes happen only on the compute thread, between
groups, when every earlier group has been evaluated: a fetch reads the expert's bytes on the
store's worker threads into host buffers and queues them (:meth:`SlotPools.stage`); the next
compute installs whatever is queued (:meth:`SlotPools.install`) before it builds its graph. A slot
is only refilled once its expert is unpinned, and the group that read it was evaluated before its
pins were released, so nothing reads a slot that a later write changes.

Reads use the torch backend's file reader (``O_DIRECT`` on Linux, buffered elsewhere) on a pool of
``queue_depth`` worker threads; the event loop only awaits them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from runahead.backend import READS_IN_FLIGHT
from runahead.models.mlx.checkpoint import Checkpoint, Piece
from runahead.models.mlx.ggufq import GGUF_QUANT, repack
from runahead.store.base import ALIGNMENT, _Executor, _Read
from runahead.store.files import _FileReader
from runahead.store.native import Plan, file_plan, native_reads, read

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}
"""How a host buffer holds each file dtype (bfloat16 as its raw 16 bits, viewed back in MLX)."""


class SlotPools:
    """Slot pools for every expert tensor of a checkpoint, with staged writes (see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint, num_slots: int, dtype: Any) -> None:
        if num_slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.dtype = dtype  # of the float pools (quantized weights are uint32 whatever it is)
        self.pools: dict[str, mx.array] = {}
        for fmt in checkpoint.formats.values():
            for part, shape, file_dtype in fmt.tensors:
                kind = mx.uint32 if file_dtype == "U32" else dtype
                self.pools[f"{fmt.name}.{part}"] = mx.zeros((num_slots, *shape), dtype=kind)
        mx.eval(list(self.pools.values()))
        self._staged: dict[int, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()
        self.installs = 0

    @property
    def nbytes(self) -> int:
        """Bytes of slot memory held."""
        return sum(p.nbytes for p in self.pools.values())

    def stage(self, slot: int, tensors: dict[str, np.ndarray]) -> None:
        """Queue host buffers for ``slot`` (replacing any still queued); installed by the next compute."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        with self._lock:
            self._staged[slot] = tensors

    def install(self) -> None:
        """Write every staged expert into its slot, in place (compute thread only, between groups)."""
        with self._lock:
            staged, self._staged = self._staged, {}
        if not staged:
            return
        for slot, tensors in staged.items():
            for name, host in tensors.items():
                pool = self.pools[name]
                value = mx.array(host)
                if host.dtype == np.uint16 and pool.dtype != mx.uint16:
                    value = value.view(mx.bfloat16)
                pool[slot] = value.astype(pool.dtype) if value.dtype != pool.dtype else value
                self.pools[name] = pool
        mx.eval(list(self.pools.values()))
        self.installs += len(staged)


class ExpertReader:
    """Reads one expert's pieces from the checkpoint's files into host buffers, on worker threads."""

    def __init__(
        self,
        experts: Mapping[tuple[int, int], tuple[Piece, ...]],
        queue_depth: int = READS_IN_FLIGHT,
        direct: bool = True,
        link_bandwidth: float | None = None,
        native: bool | None = None,
    ) -> None:
        self.experts = experts
        largest = max((p.nbytes for pieces in experts.values() for p in pieces), default=0)
        self._files = _FileReader(
            (p.path for pieces in experts.values() for p in pieces),
            direct,
            ALIGNMENT,
            largest + 2 * ALIGNMENT,
        )
        self._executor = _Executor(queue_depth, "runahead-mlx-read", link_bandwidth)
        # C threads read a float or MLX-quantized checkpoint's experts (:mod:`runahead.store.native`);
        # a GGUF's quantized pieces are repacked in numpy on the Python threads as they land
        plain = all(p.dtype not in GGUF_QUANT for pieces in experts.values() for p in pieces)
        self._native = native_reads(queue_depth, self._files, native) if plain else None
        self._plans: dict[tuple[int, int], tuple[Plan, int]] = {}
        self.bytes_read = 0
        self.reads = 0
        self._closed = False

    @property
    def direct(self) -> bool:
        """True when every expert file is read with O_DIRECT (bypassing the page cache)."""
        return self._files.direct

    async def read(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Expert ``(layer, expert)``'s tensors as host arrays (one per pool); never blocks the loop."""
        pieces = self.experts.get((layer, expert))
        if pieces is None:
            raise KeyError(f"expert ({layer}, {expert}) is not in the checkpoint")
        out: dict[str, np.ndarray] = {}
        nbytes = sum(p.nbytes for p in pieces)
        if self._native is None:
            await self._executor.run(self._read_blocking, pieces, out, carries=nbytes)
        else:
            plan, total = self._native_plan((layer, expert), pieces)
            buffer = np.empty(total, dtype=np.uint8)  # every piece back to back, each viewed below
            await read(self._executor, self._native, self._files, plan, buffer.ctypes.data, nbytes)
            at = 0
            for piece in pieces:
                view = buffer[at : at + piece.nbytes].view(NUMPY_DTYPES[piece.dtype])
                out[piece.pool.replace(".gguf", ".weight")] = view.reshape(piece.shape)
                at += piece.nbytes
        self.bytes_read += nbytes
        self.reads += 1
        return out

    async def carry(self, layer: int, expert: int) -> None:
        """Take as long as expert ``(layer, expert)``'s bytes take over the capped link (the host
        store's fetch, whose bytes are already in memory); returns at once without a cap."""
        if self._executor.link is not None:
            nbytes = sum(p.nbytes for p in self.experts[layer, expert])
            await self._executor.run(_nothing, carries=nbytes)

    def _native_plan(self, key: tuple[int, int], pieces: tuple[Piece, ...]) -> tuple[Plan, int]:
        """The C threads' plan for an expert's pieces into one buffer, back to back, and its size."""
        made = self._plans.get(key)
        if made is None:
            runs, at = [], 0
            for piece in pieces:
                part = ("U8", piece.nbytes, 0, at, at + piece.nbytes)  # bytes as stored
                runs.append(_Read(piece.path, piece.offset, piece.nbytes, (part,)))
                at += piece.nbytes
            plan = file_plan(runs, self._native.files, torch.uint8)  # type: ignore[union-attr]
            assert plan is not None  # a byte copy needs no conversion
            made = self._plans[key] = (plan, at)
        return made

    def _read_blocking(self, pieces: tuple[Piece, ...], out: dict[str, np.ndarray]) -> None:
        for piece in pieces:
            buf, base = self._files.read(_Read(piece.path, piece.offset, piece.nbytes, ()))
            if piece.dtype in GGUF_QUANT:  # a GGUF block type: repacked as MLX affine quantization
                raw = np.frombuffer(buf, dtype=np.uint8, count=piece.nbytes, offset=base)
                matrix = piece.pool.partition(".")[0]
                shape = (piece.shape[0], piece.shape[1])
                weight, scales, biases = repack(piece.dtype, raw, shape)
                out.update(
                    {f"{matrix}.weight": weight, f"{matrix}.scales": scales, f"{matrix}.biases": biases}
                )
                del raw
                continue
            kind = NUMPY_DTYPES[piece.dtype]
            view = np.frombuffer(buf, dtype=kind, count=piece.nbytes // np.dtype(kind).itemsize, offset=base)
            pool = piece.pool.replace(".gguf", ".weight")  # a GGUF float expert: its weight
            out[pool] = view.reshape(piece.shape).copy()  # the buffer is reused by the next read
            del view

    def close(self) -> None:
        """Wait for reads in flight, then close the files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown()
        if self._native is not None:
            self._native.close()
        self._files.close()


def _nothing() -> None:
    """A worker's no-op: a paced transfer whose bytes are already where they go."""
