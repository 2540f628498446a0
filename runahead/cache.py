"""The expert cache: which expert sits in which slot, who pins it, what is on its way.

Bookkeeping only (no tensors, no I/O): a backend owns the slot memory, the cache decides which
slot each expert uses. Every entry is in one of three states:

- ``WANTED``: a job pinned an expert that is neither resident nor being fetched; no slot yet.
- ``PENDING``: a fetch into its slot is in flight (so the expert is never fetched twice).
- ``RESIDENT``: in its slot, usable.

Pins are reference counts held by jobs from the moment they are issued until their compute ends.
Only ``RESIDENT`` entries with refcount zero are evictable, so a pinned expert is never evicted.
Prefetched experts enter with refcount zero; one evicted (or still unused at the end) before any
job pins it counts as a wasted prefetch. A prefetch made for a request (``holder``) is *held* for it
until that request's next job has pinned what it needs (:meth:`ExpertCache.release_prefetches`):
the eviction policy does not see it before then (LFU would otherwise pick a fresh prefetch, used
zero times, as the very next victim), and only a demand fetch that finds no other victim takes it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from runahead.eviction import EvictionPolicy, make_eviction
from runahead.jobs import ExpertKey


class EntryState(enum.Enum):
    WANTED = "wanted"
    PENDING = "pending"
    RESIDENT = "resident"


@dataclass(slots=True)
class Entry:
    """One expert the cache knows about."""

    state: EntryState
    refcount: int = 0
    slot: int | None = None
    prefetched_unused: bool = False
    holder: int | None = None
    """The request a prefetch is held for, until its next job is issued (None: not held)."""


@dataclass(slots=True)
class CacheStats:
    """Counters since the run began. Hits and misses count pins; fetches count reads started."""

    hits: int = 0
    misses: int = 0
    fetches: int = 0
    prefetches: int = 0
    evictions: int = 0
    wasted_prefetches: int = 0
    failed_fetches: int = 0


class CacheFullError(RuntimeError):
    """Raised when a job would need more distinct experts pinned at once than the cache has slots."""


class ExpertCache:
    """``slots`` expert entries with refcount pins, deduplicated fetches and lru/lfu eviction."""

    def __init__(self, slots: int, eviction: str | EvictionPolicy = "lfu") -> None:
        if slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {slots}")
        self.slots = slots
        self.eviction: EvictionPolicy = make_eviction(eviction) if isinstance(eviction, str) else eviction
        self.stats = CacheStats()
        self._entries: dict[ExpertKey, Entry] = {}
        self._free_slots = list(range(slots - 1, -1, -1))
        self._evictable = 0  # resident entries with refcount zero, not held
        self._holds: dict[int, list[ExpertKey]] = {}  # request -> prefetches held for it
        self._held_idle: dict[ExpertKey, None] = {}  # resident, unpinned, held: oldest first

    # -- queries ---------------------------------------------------------------------------------

    def state(self, key: ExpertKey) -> EntryState | None:
        """The entry's state, or None if the cache knows nothing of ``key``."""
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def is_resident(self, key: ExpertKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is EntryState.RESIDENT

    def slot_of(self, key: ExpertKey) -> int:
        """The slot of a resident or pending expert."""
        entry = self._entries[key]
        if entry.slot is None:
            raise KeyError(f"{key} has no slot (state {entry.state.value})")
        return entry.slot

    def refcount(self, key: ExpertKey) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.refcount

    def resident_keys(self) -> list[ExpertKey]:
        return [k for k, e in self._entries.items() if e.state is EntryState.RESIDENT]

    def pinned_slots(self, keys: Sequence[ExpertKey]) -> list[int] | None:
        """The slots of ``keys`` if every one is resident and pinned (a job ready to compute), else None."""
        entries, resident = self._entries, EntryState.RESIDENT
        slots = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state is not resident or entry.refcount < 1:
                return None
            slots.append(entry.slot)
        return slots  # type: ignore[return-value]  # a resident entry always has its slot

    def pinned_count(self) -> int:
        """Entries with a nonzero refcount (any state)."""
        return sum(1 for e in self._entries.values() if e.refcount)

    def can_reserve(self) -> bool:
        """Whether :meth:`reserve` would find a slot now (a free one or an evictable one)."""
        return bool(self._free_slots) or self._evictable > 0 or bool(self._held_idle)

    def is_idle(self) -> bool:
        """No pins and nothing in flight: what the cache looks like between runs."""
        return all(e.refcount == 0 and e.state is EntryState.RESIDENT for e in self._entries.values())

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, key: ExpertKey) -> bool:
        """Take one reference on ``key`` for a job; return True if it is resident (a hit).

        A miss leaves a ``WANTED`` (or already ``PENDING``) entry holding the pin until the fetcher
        reserves a slot for it.
        """
        self.eviction.touch(key)
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = Entry(EntryState.WANTED, refcount=1)
            self.stats.misses += 1
            return False
        if entry.holder is not None:
            self._unhold(key, entry)
        elif entry.refcount == 0 and entry.state is EntryState.RESIDENT:
            self._evictable -= 1  # the policy drops it lazily if it surfaces while pinned
        entry.refcount += 1
        entry.prefetched_unused = False
        if entry.state is EntryState.RESIDENT:
            self.stats.hits += 1
            return True
        self.stats.misses += 1
        return False

    def pin_all(self, keys: Sequence[ExpertKey]) -> tuple[ExpertKey, ...]:
        """Pin every key (one job's experts); return those that are not resident.

        The same as :meth:`pin` per key, written out because it runs for every expert of every job.
        """
        eviction = self.eviction
        touch_all = getattr(eviction, "touch_all", None)  # optional: a policy may only have touch
        if touch_all is not None:
            touch_all(keys)
        else:
            for key in keys:
                eviction.touch(key)
        entries, resident = self._entries, EntryState.RESIDENT
        missing = []
        evictable = self._evictable
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                entries[key] = Entry(EntryState.WANTED, refcount=1)
                missing.append(key)
                continue
            if entry.holder is not None:
                self._unhold(key, entry)
                if entry.state is not resident:
                    missing.append(key)
            elif entry.state is resident:
                if not entry.refcount:
                    evictable -= 1
            else:
                missing.append(key)
            entry.refcount += 1
            entry.prefetched_unused = False
        self._evictable = evictable
        stats = self.stats
        stats.misses += len(missing)
        stats.hits += len(keys) - len(missing)
        return tuple(missing)

    def unpin_all(self, keys: Iterable[ExpertKey]) -> None:
        """Release one reference on every key (the same as :meth:`unpin` per key, written out)."""
        entries, resident = self._entries, EntryState.RESIDENT
        freed = []  # became evictable, in order
        for key in keys:
            entry = entries[key]
            refcount = entry.refcount - 1
            if refcount > 0:
                entry.refcount = refcount
            elif refcount < 0:
                raise RuntimeError(f"unpin of {key} with refcount {entry.refcount}")
            else:
                entry.refcount = 0
                if entry.state is resident:
                    freed.append(key)
                elif entry.state is EntryState.WANTED:
                    del entries[key]  # its job went away before a fetch was started
        if freed:
            self._evictable += len(freed)
            eviction = self.eviction
            add_all = getattr(eviction, "add_all", None)  # optional, as touch_all
            if add_all is not None:
                add_all(freed)
            else:
                for key in freed:
                    eviction.add(key)

    def unpin(self, key: ExpertKey) -> None:
        """Release one reference. A resident entry whose count reaches zero becomes evictable."""
        entry = self._entries[key]
        if entry.refcount <= 0:
            raise RuntimeError(f"unpin of {key} with refcount {entry.refcount}")
        entry.refcount -= 1
        if entry.refcount:
            return
        if entry.state is EntryState.RESIDENT:
            self._evictable += 1
            self.eviction.add(key)
        elif entry.state is EntryState.WANTED:
            del self._entries[key]  # its job went away before a fetch was started

    # -- fetches ---------------------------------------------------------------------------------

    def reserve(self, key: ExpertKey, *, prefetch: bool = False, holder: int | None = None) -> int | None:
        """Give ``key`` a slot for a fetch about to start; return the slot, or None if none is free.

        A demand fetch turns a ``WANTED`` entry ``PENDING``; a prefetch creates a ``PENDING`` entry
        with no pins, held for request ``holder`` if given. Evicts the policy's victim among
        unpinned resident entries if no slot is free; a demand fetch that finds none takes the
        oldest held prefetch (a prefetch never does).
        """
        entry = self._entries.get(key)
        if prefetch:
            if entry is not None:
                raise RuntimeError(f"prefetch of {key}, which is already {entry.state.value}")
        elif entry is None or entry.state is not EntryState.WANTED:
            state = "unknown" if entry is None else entry.state.value
            raise RuntimeError(f"demand fetch of {key}, which is {state}, not wanted")
        slot = self._take_slot(last_resort=not prefetch)
        if slot is None:
            return None
        if entry is None:
            entry = self._entries[key] = Entry(
                EntryState.PENDING, slot=slot, prefetched_unused=True, holder=holder
            )
            if holder is not None:
                self._holds.setdefault(holder, []).append(key)
            self.stats.prefetches += 1
        else:
            entry.state, entry.slot = EntryState.PENDING, slot
        self.stats.fetches += 1
        return slot

    def complete(self, key: ExpertKey) -> None:
        """The fetch of ``key`` landed: it is resident (and evictable if nobody pins it)."""
        entry = self._entries[key]
        if entry.state is not EntryState.PENDING:
            raise RuntimeError(f"fetch completion for {key}, which is {entry.state.value}")
        entry.state = EntryState.RESIDENT
        if entry.refcount == 0:
            if entry.holder is not None:
                self._held_idle[key] = None
            else:
                self._evictable += 1
                self.eviction.add(key)

    def release_prefetches(self, request: int) -> None:
        """``request``'s next job has pinned its experts (or the request ended): the prefetches held
        for it become ordinary entries, evictable as the policy decides once unpinned."""
        entries = self._entries
        for key in self._holds.pop(request, ()):
            entry = entries.get(key)
            if entry is None or entry.holder != request:
                continue  # used (pinned) or evicted meanwhile
            entry.holder = None
            if key in self._held_idle:
                del self._held_idle[key]
                self._evictable += 1
                self.eviction.add(key)

    def _unhold(self, key: ExpertKey, entry: Entry) -> None:
        """A job pins a held prefetch: it is no longer held (nor idle)."""
        entry.holder = None
        self._held_idle.pop(key, None)

    def abort(self, key: ExpertKey) -> None:
        """The fetch of ``key`` failed: free its slot; the entry is ``WANTED`` again while pinned.

        Jobs still pinning it are failed by the caller; their unpins then forget the entry, so a
        later request fetches it afresh.
        """
        entry = self._entries[key]
        if entry.state is not EntryState.PENDING:
            raise RuntimeError(f"fetch failure for {key}, which is {entry.state.value}")
        assert entry.slot is not None
        self._free_slots.append(entry.slot)
        self.stats.failed_fetches += 1
        if entry.refcount:
            entry.state, entry.slot = EntryState.WANTED, None
        else:
            del self._entries[key]

    def warm(self, keys: Iterable[ExpertKey]) -> None:
        """Load ``keys`` as if fetched and used once, before any job runs (no cost is charged).

        Models the cache contents left by a prompt's prefill; evicts as a fetch would.
        """
        for key in keys:
            self.eviction.touch(key)
            entry = self._entries.get(key)
            if entry is not None:
                if entry.refcount == 0 and entry.state is EntryState.RESIDENT:
                    self.eviction.add(key)  # a use refreshes its recency
                continue
            slot = self._take_slot()
            if slot is None:
                raise CacheFullError("cannot warm the cache: every slot is pinned")
            self._entries[key] = Entry(EntryState.RESIDENT, slot=slot)
            self._evictable += 1
            self.eviction.add(key)

    def finish(self) -> None:
        """End of a run: prefetched experts never used count as wasted."""
        for entry in self._entries.values():
            if entry.prefetched_unused:
                entry.prefetched_unused = False
                self.stats.wasted_prefetches += 1

    def _is_evictable(self, key: Hashable) -> bool:
        entry = self._entries.get(key)  # type: ignore[call-overload]
        return (
            entry is not None
            and entry.refcount == 0
            and entry.state is EntryState.RESIDENT
            and entry.holder is None
        )

    def _take_slot(self, last_resort: bool = False) -> int | None:
        """A free slot, else the eviction policy's victim's, else (``last_resort``) the oldest
        held prefetch's, else None."""
        if self._free_slots:
            return self._free_slots.pop()
        if not self._evictable:
            if last_resort and self._held_idle:
                return self._evict_held()
            return None
        victim: Hashable | None = self.eviction.pop_victim(self._is_evictable)
        if victim is None:
            raise RuntimeError("eviction policy found no victim among evictable entries")
        assert isinstance(victim, ExpertKey)
        entry = self._entries.pop(victim)
        self._evictable -= 1
        self.stats.evictions += 1
        if entry.prefetched_unused:
            self.stats.wasted_prefetches += 1
        assert entry.slot is not None and entry.refcount == 0
        return entry.slot

    def _evict_held(self) -> int:
        key = next(iter(self._held_idle))
        del self._held_idle[key]
        entry = self._entries.pop(key)
        self.stats.evictions += 1
        if entry.prefetched_unused:
            self.stats.wasted_prefetches += 1
        assert entry.slot is not None and entry.refcount == 0
        return entry.slot


def admissible(slots: int, active_requests: int, experts_per_job: int) -> bool:
    """The deadlock rule: every active request's job may pin its experts without relying on sharing.

    Each request has at most one job in flight, pinning at most ``experts_per_job`` entries; if
    ``slots`` covers all of them, a blocked job always finds a slot for its next fetch.
    """
    return slots >= active_requests * experts_per_job
