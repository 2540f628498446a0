"""Eviction policies for the expert cache: which unpinned resident expert leaves first.

A policy only sees *evictable* entries (resident, refcount zero): the cache adds an entry when its
last pin is released and removes it when it is pinned again, so a pinned entry can never be chosen.
Pure and deterministic: ties break by the order in which entries became evictable.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol


class EvictionPolicy(Protocol):
    """The contract every eviction policy meets."""

    def touch(self, key: Hashable) -> None:
        """Record one use of ``key`` (called on every pin, evictable or not)."""

    def add(self, key: Hashable) -> None:
        """``key`` became evictable (resident with refcount zero)."""

    def remove(self, key: Hashable) -> None:
        """``key`` is no longer evictable (pinned again). Unknown keys are ignored."""

    def pop_victim(self) -> Hashable | None:
        """Remove and return the entry to evict, or None when nothing is evictable."""

    def __len__(self) -> int: ...


class LRU:
    """Least recently used: the entry whose last pin was released longest ago goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        pass  # recency is the moment the entry becomes evictable, i.e. its last use

    def add(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Hashable | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._order)


class LFU:
    """Least frequently used, counting every use since the run began (counts survive eviction).

    Ties go to the entry that became evictable first. A heap with lazy deletion keeps each
    operation O(log n), which matters with thousands of slots.
    """

    def __init__(self) -> None:
        self.counts: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, Hashable]] = []
        self._live: dict[Hashable, int] = {}  # evictable key -> sequence number of its heap entry
        self._seq = 0

    def touch(self, key: Hashable) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def add(self, key: Hashable) -> None:
        self._seq += 1
        self._live[key] = self._seq
        heapq.heappush(self._heap, (self.counts.get(key, 0), self._seq, key))

    def remove(self, key: Hashable) -> None:
        self._live.pop(key, None)
        if len(self._heap) > 4 * len(self._live) + 64:
            self._heap = [item for item in self._heap if self._live.get(item[2]) == item[1]]
            heapq.heapify(self._heap)

    def pop_victim(self) -> Hashable | None:
        while self._heap:
            _, seq, key = heapq.heappop(self._heap)
            if self._live.get(key) == seq:
                del self._live[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._live)


EVICTION_POLICIES = {"lru": LRU, "lfu": LFU}


def make_eviction(name: str) -> EvictionPolicy:
    """Build the eviction policy called ``name`` (``lru`` or ``lfu``)."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}") from None
