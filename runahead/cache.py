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
from collections import _count_elements  # type: ignore[attr-defined]
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import filterfalse

from runahead.eviction import EvictionPolicy, make_eviction
from runahead.jobs import ExpertKey, Job


class EntryState(enum.Enum):
    WANTED = "wanted"
    PENDING = "pending"
    RESIDENT = "resident"


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
    """``slots`` expert entries with refcount pins, deduplicated fetches and lru/lfu eviction.

    NOTE (why the state lives in sets and dicts, not in one record per expert): pinning and
    unpinning run for every expert of every job, so the bookkeeping is kept where the standard
    library's C code can do a whole job's keys in one call: pin counts in a dict (``_refs``, only
    pinned keys), resident and pending experts in dicts of their slots, and the evictable ones
    (resident, unpinned) in a set. An expert's state follows: resident, pending, pinned and
    neither (``WANTED``), or unknown.
    """

    def __init__(self, slots: int, eviction: str | EvictionPolicy = "lfu") -> None:
        if slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {slots}")
        self.slots = slots
        self.eviction: EvictionPolicy = make_eviction(eviction) if isinstance(eviction, str) else eviction
        self.stats = CacheStats()
        self._refs: dict[ExpertKey, int] = {}  # pinned experts (any state) -> pins
        self._resident: dict[ExpertKey, int] = {}  # -> slot, in the order they landed
        self._pending: dict[ExpertKey, int] = {}  # a read into the slot is in flight
        self._idle: set[ExpertKey] = set()  # resident with no pins, not held: the evictable ones
        self._unused: set[ExpertKey] = set()  # prefetched (pending or resident), never pinned since
        self._holder: dict[ExpertKey, int] = {}  # a held prefetch -> the request it is held for
        self._holds: dict[int, list[ExpertKey]] = {}  # request -> prefetches held for it
        self._held_idle: dict[ExpertKey, None] = {}  # resident, unpinned, held: oldest first
        self._free_slots = list(range(slots - 1, -1, -1))

    # -- queries ---------------------------------------------------------------------------------

    def state(self, key: ExpertKey) -> EntryState | None:
        """The entry's state, or None if the cache knows nothing of ``key``."""
        if key in self._resident:
            return EntryState.RESIDENT
        if key in self._pending:
            return EntryState.PENDING
        return EntryState.WANTED if key in self._refs else None

    def is_resident(self, key: ExpertKey) -> bool:
        return key in self._resident

    def is_wanted(self, key: ExpertKey) -> bool:
        """Pinned by a job, with no read started (the state ``WANTED``)."""
        return key in self._refs and key not in self._resident and key not in self._pending

    def slot_of(self, key: ExpertKey) -> int:
        """The slot of a resident or pending expert."""
        slot = self._resident.get(key, self._pending.get(key))
        if slot is None:
            raise KeyError(f"{key} has no slot (state {self._state_name(key)})")
        return slot

    def refcount(self, key: ExpertKey) -> int:
        return self._refs.get(key, 0)

    def resident_keys(self) -> list[ExpertKey]:
        """The resident experts, in the order they landed."""
        return list(self._resident)

    def pinned_slots(self, keys: Sequence[ExpertKey]) -> list[int] | None:
        """The slots of ``keys`` if every one is resident and pinned (a job ready to compute), else None."""
        slots = list(map(self._resident.get, keys))
        if None in slots or not all(map(self._refs.__contains__, keys)):
            return None
        return slots  # type: ignore[return-value]  # no None in it

    def pinned_count(self) -> int:
        """Entries with a nonzero refcount (any state)."""
        return len(self._refs)

    def can_reserve(self) -> bool:
        """Whether :meth:`reserve` would find a slot now (a free one or an evictable one)."""
        return bool(self._free_slots) or bool(self._idle) or bool(self._held_idle)

    def is_idle(self) -> bool:
        """No pins and nothing in flight: what the cache looks like between runs."""
        return not self._refs and not self._pending

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, key: ExpertKey) -> bool:
        """Take one reference on ``key`` for a job; return True if it is resident (a hit).

        A miss leaves a ``WANTED`` (or already ``PENDING``) entry holding the pin until the fetcher
        reserves a slot for it.
        """
        return not self.pin_all((key,))

    def pin_all(self, keys: Sequence[ExpertKey]) -> tuple[ExpertKey, ...]:
        """Pin every key (one job's experts, or several jobs' in turn); return those not resident.

        The same as :meth:`pin` per key: one use each for the eviction policy, one pin each.
        """
        eviction = self.eviction
        touch_all = getattr(eviction, "touch_all", None)  # optional: a policy may only have touch
        if touch_all is not None:
            touch_all(keys)
        else:
            for key in keys:
                eviction.touch(key)
        _count_elements(self._refs, keys)
        if self._idle:
            self._idle.difference_update(keys)
        if self._holder:  # a job pins a held prefetch: it is no longer held (nor idle)
            holder, held_idle = self._holder, self._held_idle
            for key in [key for key in keys if key in holder]:
                del holder[key]
                held_idle.pop(key, None)
        if self._unused:
            self._unused.difference_update(keys)
        missing = tuple(filterfalse(self._resident.__contains__, keys))
        stats = self.stats
        stats.misses += len(missing)
        stats.hits += len(keys) - len(missing)
        return missing

    def pin_jobs(self, jobs: Sequence[Job]) -> list[tuple[ExpertKey, ...]]:
        """Pin every job's keys, job after job, in one :meth:`pin_all`; each job's missing keys.

        The same as one :meth:`pin_all` per job: a pin never changes what is resident.
        """
        flat = self.pin_all([key for job in jobs for key in job.keys])
        if not flat:
            return [()] * len(jobs)
        absent = set(flat).__contains__
        return [tuple(filter(absent, job.keys)) for job in jobs]

    def unpin_all(self, keys: Iterable[ExpertKey]) -> None:
        """Release one reference on every key, in order (the same as :meth:`unpin` per key).

        A resident entry whose count reaches zero becomes evictable; a ``WANTED`` one is forgotten
        (its jobs went away before a read was started).
        """
        refs, resident = self._refs, self._resident
        freed = []  # became evictable, in order
        for key in keys:
            count = refs.get(key, 0)
            if count > 1:
                refs[key] = count - 1
            elif count == 1:
                del refs[key]
                if key in resident:
                    freed.append(key)
            else:
                raise RuntimeError(f"unpin of {key} with refcount 0")
        if freed:
            self._idle.update(freed)
            eviction = self.eviction
            add_all = getattr(eviction, "add_all", None)  # optional, as touch_all
            if add_all is not None:
                add_all(freed)
            else:
                for key in freed:
                    eviction.add(key)

    def unpin(self, key: ExpertKey) -> None:
        """Release one reference. A resident entry whose count reaches zero becomes evictable."""
        self.unpin_all((key,))

    # -- fetches ---------------------------------------------------------------------------------

    def reserve(self, key: ExpertKey, *, prefetch: bool = False, holder: int | None = None) -> int | None:
        """Give ``key`` a slot for a fetch about to start; return the slot, or None if none is free.

        A demand fetch turns a ``WANTED`` entry ``PENDING``; a prefetch creates a ``PENDING`` entry
        with no pins, held for request ``holder`` if given. Evicts the policy's victim among
        unpinned resident entries if no slot is free; a demand fetch that finds none takes the
        oldest held prefetch (a prefetch never does).
        """
        state = self.state(key)
        if prefetch:
            if state is not None:
                raise RuntimeError(f"prefetch of {key}, which is already {state.value}")
        elif state is not EntryState.WANTED:
            raise RuntimeError(f"demand fetch of {key}, which is {self._state_name(key)}, not wanted")
        slot = self._take_slot(last_resort=not prefetch)
        if slot is None:
            return None
        self._pending[key] = slot
        if prefetch:
            self._unused.add(key)
            if holder is not None:
                self._holder[key] = holder
                self._holds.setdefault(holder, []).append(key)
            self.stats.prefetches += 1
        self.stats.fetches += 1
        return slot

    def complete(self, key: ExpertKey) -> None:
        """The fetch of ``key`` landed: it is resident (and evictable if nobody pins it)."""
        slot = self._pending.pop(key, None)
        if slot is None:
            raise RuntimeError(f"fetch completion for {key}, which is {self._state_name(key)}")
        self._resident[key] = slot
        if key not in self._refs:
            if key in self._holder:
                self._held_idle[key] = None
            else:
                self._idle.add(key)
                self.eviction.add(key)

    def release_prefetches(self, request: int) -> None:
        """``request``'s next job has pinned its experts (or the request ended): the prefetches held
        for it become ordinary entries, evictable as the policy decides once unpinned."""
        holder = self._holder
        for key in self._holds.pop(request, ()):
            if holder.get(key) != request:
                continue  # used (pinned) or evicted meanwhile
            del holder[key]
            if key in self._held_idle:
                del self._held_idle[key]
                self._idle.add(key)
                self.eviction.add(key)

    def abort(self, key: ExpertKey) -> None:
        """The fetch of ``key`` failed: free its slot; the entry is ``WANTED`` again while pinned.

        Jobs still pinning it are failed by the caller; their unpins then forget the entry, so a
        later request fetches it afresh.
        """
        slot = self._pending.pop(key, None)
        if slot is None:
            raise RuntimeError(f"fetch failure for {key}, which is {self._state_name(key)}")
        self._free_slots.append(slot)
        self.stats.failed_fetches += 1
        if key not in self._refs:  # forgotten, with its prefetch marks
            self._unused.discard(key)
            self._holder.pop(key, None)

    def warm(self, keys: Iterable[ExpertKey]) -> None:
        """Load ``keys`` as if fetched and used once, before any job runs (no cost is charged).

        Models the cache contents left by a prompt's prefill; evicts as a fetch would.
        """
        for key in keys:
            self.eviction.touch(key)
            if key in self._resident or key in self._pending or key in self._refs:
                if key in self._idle:
                    self.eviction.add(key)  # a use refreshes its recency
                continue
            slot = self._take_slot()
            if slot is None:
                raise CacheFullError("cannot warm the cache: every slot is pinned")
            self._resident[key] = slot
            self._idle.add(key)
            self.eviction.add(key)

    def finish(self) -> None:
        """End of a run: prefetched experts never used count as wasted."""
        self.stats.wasted_prefetches += len(self._unused)
        self._unused.clear()

    def _state_name(self, key: ExpertKey) -> str:
        state = self.state(key)
        return "unknown" if state is None else state.value

    def _take_slot(self, last_resort: bool = False) -> int | None:
        """A free slot, else the eviction policy's victim's, else (``last_resort``) the oldest
        held prefetch's, else None."""
        if self._free_slots:
            return self._free_slots.pop()
        if not self._idle:
            if last_resort and self._held_idle:
                return self._evict_held()
            return None
        victim = self.eviction.pop_victim(self._idle.__contains__)
        if victim is None:
            raise RuntimeError("eviction policy found no victim among evictable entries")
        assert isinstance(victim, ExpertKey)
        self._idle.remove(victim)
        slot = self._resident.pop(victim)
        self.stats.evictions += 1
        if victim in self._unused:
            self._unused.remove(victim)
            self.stats.wasted_prefetches += 1
        return slot

    def _evict_held(self) -> int:
        key = next(iter(self._held_idle))
        del self._held_idle[key], self._holder[key]
        self.stats.evictions += 1
        if key in self._unused:
            self._unused.remove(key)
            self.stats.wasted_prefetches += 1
        return self._resident.pop(key)


def admissible(slots: int, active_requests: int, experts_per_job: int) -> bool:
    """The deadlock rule: every active request's job may pin its experts without relying on sharing.

    Each request has at most one job in flight, pinning at most ``experts_per_job`` entries; if
    ``slots`` covers all of them, a blocked job always finds a slot for its next fetch.
    """
    return slots >= active_requests * experts_per_job
