"""Eviction policies for the expert cache: which unpinned resident expert leaves first.

A policy keeps the candidates the cache hands it (``add`` when an entry's last pin is released)
and names a victim on demand. ``pop_victim`` takes the cache's ``evictable`` test and skips (and
forgets) entries that were pinned again since they were added, so the hot path, pinning an
expert, costs the policy nothing but a use count. A pinned entry can never be chosen. Pure and
deterministic: ties break by the order in which entries became candidates.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, _count_elements  # type: ignore[attr-defined]
from collections.abc import Callable, Hashable, Iterable
from itertools import filterfalse
from typing import Protocol

Evictable = Callable[[Hashable], bool]


class EvictionPolicy(Protocol):
    """The contract every eviction policy meets."""

    def touch(self, key: Hashable) -> None:
        """Record one use of ``key`` (called on every pin).

        A policy may also have ``touch_all(keys)`` and ``add_all(keys)``, the same as ``touch`` and
        ``add`` per key, in order, in one call (the cache uses them when present: they run for
        every job)."""

    def add(self, key: Hashable) -> None:
        """``key`` became a candidate (resident, refcount zero), or was used again as one."""

    def remove(self, key: Hashable) -> None:
        """``key`` is no longer a candidate. Unknown keys are ignored."""

    def pop_victim(self, evictable: Evictable | None = None) -> Hashable | None:
        """Remove and return the entry to evict, or None. Candidates failing ``evictable`` are dropped."""


class LRU:
    """Least recently used: the entry whose last pin was released longest ago goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        pass  # recency is the moment the entry becomes a candidate, i.e. the end of its last use

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        pass

    def add(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def add_all(self, keys: Iterable[Hashable]) -> None:
        order = self._order
        for key in keys:
            order[key] = None
            order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def pop_victim(self, evictable: Evictable | None = None) -> Hashable | None:
        while self._order:
            key, _ = self._order.popitem(last=False)
            if evictable is None or evictable(key):
                return key
        return None


_SEQ_BITS = 40
"""An LFU heap entry is one int, ``count << _SEQ_BITS | seq``: ordered as ``(count, seq)`` (sequence
numbers stay below ``2**40``), compared in C without building or comparing a tuple per step."""


class LFU:
    """Least frequently used, counting every use since the run began (counts survive eviction).

    Ties go to the entry that became a candidate first. A heap with lazy deletion: entries whose
    count went stale are re-pushed when they surface, so each operation is O(log n) amortized.
    """

    def __init__(self) -> None:
        self.counts: dict[Hashable, int] = {}
        self._heap: list[int] = []  # entries ``count << _SEQ_BITS | seq``
        self._key_of: dict[int, Hashable] = {}  # heap entry -> its key
        self._live: dict[Hashable, int] = {}  # candidate -> its current heap entry
        self._seq = 0

    def touch(self, key: Hashable) -> None:
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        _count_elements(self.counts, keys)  # touch() per key, in C: it runs for every job

    def add(self, key: Hashable) -> None:
        if key not in self._live:
            self._push(key)

    def add_all(self, keys: Iterable[Hashable]) -> None:
        live, heap, counts, key_of = self._live, self._heap, self.counts, self._key_of
        seq = self._seq
        for key in filterfalse(live.__contains__, keys):  # as add() and _push(), written out
            seq += 1
            entry = counts.get(key, 0) << _SEQ_BITS | seq
            live[key] = entry
            key_of[entry] = key
            heapq.heappush(heap, entry)
        self._seq = seq

    def remove(self, key: Hashable) -> None:
        self._live.pop(key, None)
        if len(self._heap) > 4 * len(self._live) + 64:
            live, key_of = self._live, self._key_of
            self._heap = [entry for entry in self._heap if live.get(key_of[entry]) == entry]
            self._key_of = {entry: key_of[entry] for entry in self._heap}
            heapq.heapify(self._heap)

    def pop_victim(self, evictable: Evictable | None = None) -> Hashable | None:
        heap, live, key_of = self._heap, self._live, self._key_of
        while heap:
            entry = heapq.heappop(heap)
            key = key_of.pop(entry)
            if live.get(key) != entry:
                continue
            del live[key]
            if evictable is not None and not evictable(key):
                continue  # pinned again since it was added; re-added when released
            if entry >> _SEQ_BITS != self.counts.get(key, 0):
                self._push(key)  # used since it was pushed: rank it by its current count
                continue
            return key
        return None

    def _push(self, key: Hashable) -> None:
        self._seq += 1
        entry = self.counts.get(key, 0) << _SEQ_BITS | self._seq
        self._live[key] = entry
        self._key_of[entry] = key
        heapq.heappush(self._heap, entry)


EVICTION_POLICIES: dict[str, type[LRU] | type[LFU]] = {"lru": LRU, "lfu": LFU}


def make_eviction(name: str) -> EvictionPolicy:
    """Build the eviction policy called ``name`` (``lru`` or ``lfu``)."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None
