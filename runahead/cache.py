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
from collections.abc import Iterable, KeysView, Sequence
from dataclasses import dataclass
from itertools import filterfalse

from runahead.eviction import EvictionPolicy, make_eviction
from runahead.jobs import ExpertId, ExpertKey, Job, expert_id, expert_key, expert_keys, job_ids


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

    NOTE (why the state lives in sets and dicts of ids, not in one record per expert): pinning and
    unpinning run for every expert of every job, so the bookkeeping is kept where the standard
    library's C code can do a whole job's experts in one call: pin counts in a dict (``_refs``,
    only pinned experts), resident and pending experts in dicts of their slots, and the evictable
    ones (resident, unpinned) in a set, all keyed by :data:`ExpertId` (an int hashes as itself).
    An expert's state follows: resident, pending, pinned and neither (``WANTED``), or unknown.

    Two faces, one state: the methods taking an :class:`ExpertKey` (what the tests, the runtime's
    warm-up and the backends use) turn it into its id and call the id-taking ones (``*_ids``,
    ``*_id``, :meth:`pin_jobs`, :meth:`pinned_slots`: the actors' hot path, once per job or group).
    The eviction policy sees ids.

    NOTE (the whole model resident). ``experts``, where the caller knows it, is how many experts the
    model has in all (every expert a job may pin). Once every one of them is resident, and no pin
    taken before is still held, nothing can ever be read or evicted again: a pin protects nothing
    and a use count orders no victim. From then on pins are not counted (:meth:`pin_ids` counts
    the hits and returns, :meth:`unpin_ids` returns, :meth:`pinned_slots` gives the slots), which
    is most of the bookkeeping a job costs when the model fits (issue 14: about a third of a job's
    CPU time in the zero-cost bench). What the runtime decides is unchanged; only
    :meth:`pinned_count` reads 0 and the eviction policy's counts stop.
    """

    def __init__(
        self, slots: int, eviction: str | EvictionPolicy = "lfu", *, experts: int | None = None
    ) -> None:
        if slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {slots}")
        if experts is not None and experts < 1:
            raise ValueError(f"a model has at least one expert, got experts={experts}")
        self.slots = slots
        self.eviction: EvictionPolicy = make_eviction(eviction) if isinstance(eviction, str) else eviction
        self.stats = CacheStats()
        self._refs: dict[ExpertId, int] = {}  # pinned experts (any state) -> pins
        self._resident: dict[ExpertId, int] = {}  # -> slot, in the order they landed
        self._pending: dict[ExpertId, int] = {}  # a read into the slot is in flight
        self._idle: set[ExpertId] = set()  # resident with no pins, not held: the evictable ones
        self._unused: set[ExpertId] = set()  # prefetched (pending or resident), never pinned since
        self._holder: dict[ExpertId, int] = {}  # a held prefetch -> the request it is held for
        self._holds: dict[int, list[ExpertId]] = {}  # request -> prefetches held for it
        self._held_idle: dict[ExpertId, None] = {}  # resident, unpinned, held: oldest first
        self._free_slots = list(range(slots - 1, -1, -1))
        self._experts = experts
        self._whole = False  # every expert resident, no earlier pin held: pins are not counted

    # -- by key ----------------------------------------------------------------------------------

    def state(self, key: ExpertKey) -> EntryState | None:
        """The entry's state, or None if the cache knows nothing of ``key``."""
        return self.state_id(expert_id(key))

    def is_resident(self, key: ExpertKey) -> bool:
        return expert_id(key) in self._resident

    def is_wanted(self, key: ExpertKey) -> bool:
        """Pinned by a job, with no read started (the state ``WANTED``)."""
        return self.is_wanted_id(expert_id(key))

    def slot_of(self, key: ExpertKey) -> int:
        """The slot of a resident or pending expert."""
        expert = expert_id(key)
        slot = self._resident.get(expert, self._pending.get(expert))
        if slot is None:
            raise KeyError(f"{key} has no slot (state {self._state_name(expert)})")
        return slot

    def refcount(self, key: ExpertKey) -> int:
        return self._refs.get(expert_id(key), 0)

    def resident_keys(self) -> list[ExpertKey]:
        """The resident experts, in the order they landed."""
        return list(expert_keys(self._resident))

    def pin(self, key: ExpertKey) -> bool:
        """Take one reference on ``key`` for a job; return True if it is resident (a hit).

        A miss leaves a ``WANTED`` (or already ``PENDING``) entry holding the pin until the fetcher
        reserves a slot for it.
        """
        return not self.pin_ids((expert_id(key),))

    def pin_all(self, keys: Sequence[ExpertKey]) -> tuple[ExpertKey, ...]:
        """Pin every key (:meth:`pin_ids`); return those not resident."""
        return expert_keys(self.pin_ids(tuple(map(expert_id, keys))))

    def unpin(self, key: ExpertKey) -> None:
        """Release one reference. A resident entry whose count reaches zero becomes evictable."""
        self.unpin_ids((expert_id(key),))

    def unpin_all(self, keys: Iterable[ExpertKey]) -> None:
        """Release one reference on every key, in order (:meth:`unpin_ids`)."""
        self.unpin_ids(tuple(map(expert_id, keys)))

    def reserve(self, key: ExpertKey, *, prefetch: bool = False, holder: int | None = None) -> int | None:
        """Give ``key`` a slot for a fetch about to start (:meth:`reserve_id`)."""
        return self.reserve_id(expert_id(key), prefetch=prefetch, holder=holder)

    def complete(self, key: ExpertKey) -> None:
        """The fetch of ``key`` landed (:meth:`complete_id`)."""
        self.complete_id(expert_id(key))

    def abort(self, key: ExpertKey) -> None:
        """The fetch of ``key`` failed (:meth:`abort_id`)."""
        self.abort_id(expert_id(key))

    def warm(self, keys: Iterable[ExpertKey]) -> None:
        """Load ``keys`` as if fetched and used once, before any job runs (no cost is charged).

        Models the cache contents left by a prompt's prefill; evicts as a fetch would.
        """
        self.warm_ids(map(expert_id, keys))

    def warm_ids(self, experts: Iterable[ExpertId]) -> None:
        """:meth:`warm` by id: each expert in turn is used once, loaded if absent (evicting as a
        fetch would), and refreshed as an eviction candidate if it was one."""
        eviction = self.eviction
        touch, add = eviction.touch, eviction.add
        resident, pending, refs, idle = self._resident, self._pending, self._refs, self._idle
        for expert in experts:
            touch(expert)
            if expert in resident or expert in pending or expert in refs:
                if expert in idle:
                    add(expert)  # a use refreshes its recency
                continue
            slot = self._take_slot()
            if slot is None:
                raise CacheFullError("cannot warm the cache: every slot is pinned")
            resident[expert] = slot
            idle.add(expert)
            add(expert)

    # -- queries by id ---------------------------------------------------------------------------

    @property
    def resident_ids(self) -> KeysView[ExpertId]:
        """The resident experts' ids: a live, read-only view (membership tests in C)."""
        return self._resident.keys()

    @property
    def pending_ids(self) -> KeysView[ExpertId]:
        """The ids of the experts being read (``PENDING``): a live, read-only view."""
        return self._pending.keys()

    @property
    def pinned_ids(self) -> KeysView[ExpertId]:
        """The ids of the experts some job has pinned, in any state: a live, read-only view."""
        return self._refs.keys()

    def state_id(self, expert: ExpertId) -> EntryState | None:
        """The state of the entry of id ``expert``, or None."""
        if expert in self._resident:
            return EntryState.RESIDENT
        if expert in self._pending:
            return EntryState.PENDING
        return EntryState.WANTED if expert in self._refs else None

    def is_resident_id(self, expert: ExpertId) -> bool:
        return expert in self._resident

    def is_wanted_id(self, expert: ExpertId) -> bool:
        """Pinned by a job, with no read started (the state ``WANTED``)."""
        return expert in self._refs and expert not in self._resident and expert not in self._pending

    def pinned_slots(self, experts: Sequence[ExpertId]) -> list[int | None] | None:
        """The slot of each of ``experts`` (None for one not resident) if every one is pinned, else None.

        Jobs are ready to compute when no slot is None. The caller looks for None only when it must
        (the sim compares the slots' contents with ``experts`` first, which a None fails): a scan
        of every slot for None costs about what a look-up does. With the whole model resident every
        expert counts as pinned (nothing can be evicted).
        """
        if not self._whole and not all(map(self._refs.__contains__, experts)):
            return None
        return list(map(self._resident.get, experts))

    @property
    def whole_model_resident(self) -> bool:
        """Every expert of the model is resident, and pins are no longer counted (the class NOTE)."""
        return self._whole

    def pinned_count(self) -> int:
        """Entries with a nonzero refcount (any state); 0 once the whole model is resident."""
        return len(self._refs)

    def can_reserve(self) -> bool:
        """Whether :meth:`reserve_id` would find a slot now (a free one or an evictable one)."""
        return bool(self._free_slots) or bool(self._idle) or bool(self._held_idle)

    def is_idle(self) -> bool:
        """No pins and nothing in flight: what the cache looks like between runs."""
        return not self._refs and not self._pending

    # -- pins by id ------------------------------------------------------------------------------

    def pin_ids(self, experts: Sequence[ExpertId]) -> tuple[ExpertId, ...]:
        """Pin every expert (one job's, or several jobs' in turn); return those not resident.

        One use each for the eviction policy, one pin each, as one pin per expert in turn would;
        none of it once the whole model is resident (see the class NOTE).
        """
        if self._whole or (not self._refs and len(self._resident) == self._experts):
            self._whole = True
            self.stats.hits += len(experts)
            return ()
        eviction = self.eviction
        touch_all = getattr(eviction, "touch_all", None)  # optional: a policy may only have touch
        if touch_all is not None:
            touch_all(experts)
        else:
            for expert in experts:
                eviction.touch(expert)
        _count_elements(self._refs, experts)
        if self._idle:
            self._idle.difference_update(experts)
        if self._holder:  # a job pins a held prefetch: it is no longer held (nor idle)
            holder, held_idle = self._holder, self._held_idle
            for expert in [expert for expert in experts if expert in holder]:
                del holder[expert]
                held_idle.pop(expert, None)
        if self._unused:
            self._unused.difference_update(experts)
        missing = tuple(filterfalse(self._resident.__contains__, experts))
        stats = self.stats
        stats.misses += len(missing)
        stats.hits += len(experts) - len(missing)
        return missing

    def pin_jobs(self, jobs: Sequence[Job]) -> list[tuple[ExpertId, ...]]:
        """Pin every job's experts, job after job, in one :meth:`pin_ids`; each job's missing ones.

        The same as one :meth:`pin_ids` per job: a pin never changes what is resident.
        """
        flat = self.pin_ids(job_ids(jobs))
        if not flat:
            return [()] * len(jobs)
        absent = set(flat).__contains__
        return [tuple(filter(absent, job.ids)) for job in jobs]

    def unpin_jobs(self, jobs: Sequence[Job]) -> None:
        """Release every job's experts, job after job, in one :meth:`unpin_ids` (a computed group's)."""
        if not self._whole:  # nothing was counted once the whole model is resident
            self.unpin_ids(job_ids(jobs))

    def unpin_ids(self, experts: Iterable[ExpertId]) -> None:
        """Release one reference on every expert, in order (the same as one release per expert).

        A resident entry whose count reaches zero becomes evictable; a ``WANTED`` one is forgotten
        (its jobs went away before a read was started). Nothing to release once the whole model is
        resident: its pins were not counted.
        """
        if self._whole:
            return
        # One Python loop on purpose: C passes over the ids (two counts, map / compress) were tried
        # three times, fewer bytecodes but more CPU a job each time (docs/tried.md, issue 14).
        refs, resident = self._refs, self._resident
        freed: list[ExpertId] = []  # became evictable, in order
        try:  # ``_refs`` holds only pinned experts: one without pins is a KeyError
            for expert in experts:
                count = refs[expert] - 1
                if count:
                    refs[expert] = count
                else:
                    del refs[expert]
                    if expert in resident:
                        freed.append(expert)
        except KeyError:
            raise RuntimeError(f"unpin of {expert_key(expert)} with refcount 0") from None
        if freed:
            self._idle.update(freed)
            eviction = self.eviction
            add_all = getattr(eviction, "add_all", None)  # optional, as touch_all
            if add_all is not None:
                add_all(freed)
            else:
                for expert in freed:
                    eviction.add(expert)

    # -- fetches by id ---------------------------------------------------------------------------

    def reserve_id(
        self, expert: ExpertId, *, prefetch: bool = False, holder: int | None = None
    ) -> int | None:
        """Give ``expert`` a slot for a fetch about to start; return the slot, or None if none is free.

        A demand fetch turns a ``WANTED`` entry ``PENDING``; a prefetch creates a ``PENDING`` entry
        with no pins, held for request ``holder`` if given. Evicts the policy's victim among
        unpinned resident entries if no slot is free; a demand fetch that finds none takes the
        oldest held prefetch (a prefetch never does).
        """
        if prefetch:
            if (state := self.state_id(expert)) is not None:
                raise RuntimeError(f"prefetch of {expert_key(expert)}, which is already {state.value}")
        elif not self.is_wanted_id(expert):
            raise RuntimeError(
                f"demand fetch of {expert_key(expert)}, which is {self._state_name(expert)}, not wanted"
            )
        slot = self._take_slot(last_resort=not prefetch)
        if slot is None:
            return None
        self._pending[expert] = slot
        if prefetch:
            self._unused.add(expert)
            if holder is not None:
                self._holder[expert] = holder
                self._holds.setdefault(holder, []).append(expert)
            self.stats.prefetches += 1
        self.stats.fetches += 1
        return slot

    def complete_id(self, expert: ExpertId) -> None:
        """The fetch of ``expert`` landed: it is resident (and evictable if nobody pins it)."""
        slot = self._pending.pop(expert, None)
        if slot is None:
            what = self._state_name(expert)
            raise RuntimeError(f"fetch completion for {expert_key(expert)}, which is {what}")
        self._resident[expert] = slot
        if expert not in self._refs:
            if expert in self._holder:
                self._held_idle[expert] = None
            else:
                self._idle.add(expert)
                self.eviction.add(expert)

    def release_prefetches(self, request: int) -> None:
        """``request``'s next job has pinned its experts (or the request ended): the prefetches held
        for it become ordinary entries, evictable as the policy decides once unpinned."""
        holder = self._holder
        for expert in self._holds.pop(request, ()):
            if holder.get(expert) != request:
                continue  # used (pinned) or evicted meanwhile
            del holder[expert]
            if expert in self._held_idle:
                del self._held_idle[expert]
                self._idle.add(expert)
                self.eviction.add(expert)

    def abort_id(self, expert: ExpertId) -> None:
        """The fetch of ``expert`` failed: free its slot; the entry is ``WANTED`` again while pinned.

        Jobs still pinning it are failed by the caller; their unpins then forget the entry, so a
        later request fetches it afresh.
        """
        slot = self._pending.pop(expert, None)
        if slot is None:
            raise RuntimeError(f"fetch failure for {expert_key(expert)}, which is {self._state_name(expert)}")
        self._free_slots.append(slot)
        self.stats.failed_fetches += 1
        if expert not in self._refs:  # forgotten, with its prefetch marks
            self._unused.discard(expert)
            self._holder.pop(expert, None)

    def finish(self) -> None:
        """End of a run: prefetched experts never used count as wasted."""
        self.stats.wasted_prefetches += len(self._unused)
        self._unused.clear()

    def _state_name(self, expert: ExpertId) -> str:
        state = self.state_id(expert)
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
        expert: ExpertId | None = self.eviction.pop_victim(self._idle.__contains__)  # type: ignore[assignment]
        if expert is None:  # the policy holds the ids the cache gave it
            raise RuntimeError("eviction policy found no victim among evictable entries")
        self._idle.remove(expert)
        slot = self._resident.pop(expert)
        self.stats.evictions += 1
        if expert in self._unused:
            self._unused.remove(expert)
            self.stats.wasted_prefetches += 1
        return slot

    def _evict_held(self) -> int:
        expert = next(iter(self._held_idle))
        del self._held_idle[expert], self._holder[expert]
        self.stats.evictions += 1
        if expert in self._unused:
            self._unused.remove(expert)
            self.stats.wasted_prefetches += 1
        return self._resident.pop(expert)


def admissible(slots: int, active_requests: int, experts_per_job: int) -> bool:
    """The deadlock rule: every active request's job may pin its experts without relying on sharing.

    Each request has at most one job in flight, pinning at most ``experts_per_job`` entries; if
    ``slots`` covers all of them, a blocked job always finds a slot for its next fetch.
    """
    return slots >= active_requests * experts_per_job
