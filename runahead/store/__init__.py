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

from typing import Literal

import torch

from runahead.backend import READS_IN_FLIGHT
from runahead.models.layout import ExpertLayout
from runahead.store.base import (
    ALIGNMENT,
    DTYPES,
    MEMORY_FILESYSTEMS,
    ExpertStore,
    SlotPool,
    StoreClosed,
    StoreError,
    filesystem_type,
    validate_layout,
)
from runahead.store.disk import DiskStore
from runahead.store.host import HostStore
from runahead.store.link import LinkCap

__all__ = [
    "ALIGNMENT",
    "DTYPES",
    "MEMORY_FILESYSTEMS",
    "DiskStore",
    "ExpertStore",
    "HostStore",
    "LinkCap",
    "SlotPool",
    "StoreClosed",
    "StoreError",
    "filesystem_type",
    "make_store",
    "validate_layout",
]


def make_store(
    kind: Literal["disk", "host"],
    layout: ExpertLayout,
    *,
    queue_depth: int = READS_IN_FLIGHT,
    direct: bool = True,
    dtype: torch.dtype = torch.float32,
    pin_memory: bool | None = None,
    link_bandwidth: float | None = None,
) -> DiskStore | HostStore:
    """Build the expert store named ``kind``: ``"disk"`` (:class:`DiskStore`, uses ``direct``) or
    ``"host"`` (:class:`HostStore`, uses ``dtype`` and ``pin_memory``); ``link_bandwidth`` (bytes per
    second) paces either to a link of that rate (:class:`LinkCap`). Called by the backend when it
    opens a model."""
    if kind == "disk":
        return DiskStore(layout, queue_depth=queue_depth, direct=direct, link_bandwidth=link_bandwidth)
    if kind == "host":
        return HostStore(
            layout, dtype=dtype, pin_memory=pin_memory, queue_depth=queue_depth, link_bandwidth=link_bandwidth
        )
    raise ValueError(f"unknown expert store {kind!r}; expected 'disk' or 'host'")
