"""The expert cache: pins, deduplicated fetches, eviction order, wasted prefetches, the deadlock rule."""

from collections.abc import Iterable

import pytest

from runahead.cache import EntryState, ExpertCache, admissible
from runahead.eviction import LFU, LRU, make_eviction
from runahead.jobs import ExpertKey, Job, expert_id, expert_keys

A, B, C, D = (ExpertKey(0, e) for e in range(4))


def fetch(cache: ExpertCache, key: ExpertKey) -> int:
    slot = cache.reserve(key)
    assert slot is not None
    cache.complete(key)
    return slot


def fetch_wanted(cache: ExpertCache, keys: Iterable[ExpertKey], victims: list[ExpertKey]) -> None:
    """Read every key still ``WANTED`` that finds a slot, noting the keys each read evicted."""
    for key in keys:
        if cache.state(key) is EntryState.WANTED:
            before = set(cache.resident_keys())
            if cache.reserve(key) is None:
                continue
            victims.extend(sorted(before - set(cache.resident_keys())))
            cache.complete(key)


def test_miss_then_fetch_then_hit() -> None:
    cache = ExpertCache(2)
    assert cache.pin(A) is False
    assert cache.state(A) is EntryState.WANTED
    fetch(cache, A)
    assert cache.is_resident(A)
    cache.unpin(A)
    assert cache.pin(A) is True
    assert (cache.stats.hits, cache.stats.misses, cache.stats.fetches) == (1, 1, 1)


def test_a_pending_expert_is_shared_not_fetched_twice() -> None:
    cache = ExpertCache(2)
    cache.pin(A)
    cache.reserve(A)
    assert cache.pin(A) is False  # second job waits on the same read
    assert cache.refcount(A) == 2
    with pytest.raises(RuntimeError, match="not wanted"):
        cache.reserve(A)
    cache.complete(A)
    assert cache.stats.fetches == 1


def test_pinned_entries_are_never_evicted() -> None:
    cache = ExpertCache(2)
    for key in (A, B):
        cache.pin(key)
        fetch(cache, key)
    cache.pin(C)
    assert cache.reserve(C) is None  # both slots pinned
    assert not cache.can_reserve()
    cache.unpin(B)
    assert cache.can_reserve()
    cache.reserve(C)
    assert cache.is_resident(A) and cache.state(B) is None


def test_lru_evicts_least_recently_released() -> None:
    cache = ExpertCache(3, "lru")
    cache.warm([A, B, C])
    for key in (A, C, B):  # use A, then C, then B: A is least recent
        cache.pin(key)
        cache.unpin(key)
    cache.pin(D)
    cache.reserve(D)
    assert cache.state(A) is None and cache.is_resident(B) and cache.is_resident(C)


def test_lfu_evicts_least_used_ties_by_age() -> None:
    cache = ExpertCache(3, "lfu")
    cache.warm([A, B, C])  # one use each
    for key in (A, A, C):
        cache.pin(key)
        cache.unpin(key)
    cache.pin(D)
    cache.reserve(D)
    assert cache.state(B) is None  # B used once; A 3x, C 2x
    cache.complete(D)
    cache.unpin(D)
    cache.pin(B)
    cache.reserve(B)
    assert cache.state(D) is None  # D used once, C twice


def test_lfu_counts_uses_made_while_pinned() -> None:
    policy = LFU()
    for key in "ab":
        policy.touch(key)
        policy.add(key)
    policy.touch("a")
    policy.touch("a")  # "a" was used again after it became a candidate
    assert policy.pop_victim() == "b"
    assert policy.pop_victim() == "a"
    assert policy.pop_victim() is None


def test_policies_skip_candidates_pinned_again() -> None:
    for policy in (LRU(), LFU()):
        policy.add("a")
        policy.add("b")
        assert policy.pop_victim(lambda key: key != "a") == "b"
        assert policy.pop_victim(lambda key: True) is None  # "a" was dropped, to be re-added on release


def test_unknown_eviction_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_eviction("mru")


def test_prefetch_evicted_unused_is_wasted_and_used_is_not() -> None:
    cache = ExpertCache(2)
    cache.reserve(A, prefetch=True)
    cache.complete(A)
    cache.reserve(B, prefetch=True)
    cache.complete(B)
    cache.pin(B)  # B is used
    cache.pin(C)
    cache.reserve(C)  # evicts A, unused
    assert cache.stats.prefetches == 2
    assert cache.stats.wasted_prefetches == 1
    cache.finish()
    assert cache.stats.wasted_prefetches == 1


def test_prefetch_still_unused_at_the_end_is_wasted() -> None:
    cache = ExpertCache(2)
    cache.reserve(A, prefetch=True)
    cache.complete(A)
    cache.finish()
    assert cache.stats.wasted_prefetches == 1


def test_held_prefetch_is_not_the_next_victim() -> None:
    """LFU would evict a fresh prefetch (used zero times) first; one held for a request is skipped."""
    cache = ExpertCache(3)
    cache.warm([A, B])
    cache.reserve(C, prefetch=True, holder=7)
    cache.complete(C)
    cache.pin(D)
    cache.reserve(D)  # the policy's victim, not the held prefetch
    assert cache.is_resident(C)
    assert {cache.is_resident(A), cache.is_resident(B)} == {True, False}
    cache.pin(C)  # request 7's job uses it: no longer held, and not wasted
    cache.release_prefetches(7)
    cache.unpin(C)
    cache.finish()
    assert cache.stats.wasted_prefetches == 0


def test_released_prefetch_goes_to_the_policy_and_demand_takes_held_ones_last() -> None:
    cache = ExpertCache(2)
    cache.reserve(A, prefetch=True, holder=1)
    cache.reserve(B, prefetch=True, holder=2)
    assert cache.reserve(C, prefetch=True, holder=3) is None  # a prefetch never evicts a held one
    cache.complete(A)
    cache.complete(B)
    assert cache.reserve(C, prefetch=True) is None
    assert cache.can_reserve()  # a demand fetch may still take one
    cache.release_prefetches(2)  # request 2's next job did not use B
    cache.pin(C)
    cache.reserve(C)  # evicts B (released, in the policy) before A (held)
    assert cache.is_resident(A) and not cache.is_resident(B)
    cache.pin(D)
    cache.reserve(D)  # no other victim: the held prefetch goes
    assert not cache.is_resident(A)
    assert cache.stats.wasted_prefetches == 2
    cache.release_prefetches(1)  # a stale hold is ignored
    assert cache.stats.evictions == 2


def test_prefetch_of_a_known_expert_is_an_error() -> None:
    cache = ExpertCache(2)
    cache.pin(A)
    with pytest.raises(RuntimeError, match="already wanted"):
        cache.reserve(A, prefetch=True)


def test_unpin_below_zero_is_an_error() -> None:
    cache = ExpertCache(2)
    cache.warm([A])
    with pytest.raises(RuntimeError, match="refcount 0"):
        cache.unpin(A)


def test_a_job_that_leaves_before_its_fetch_drops_the_wanted_entry() -> None:
    cache = ExpertCache(2)
    cache.pin(A)
    cache.unpin(A)
    assert cache.state(A) is None
    assert cache.is_idle()


def test_deadlock_rule() -> None:
    assert admissible(slots=16, active_requests=2, experts_per_job=8)
    assert not admissible(slots=15, active_requests=2, experts_per_job=8)


def test_zero_slots_rejected() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        ExpertCache(0)


class _PerKey:
    """A policy with only ``touch`` and ``add``: the cache must fall back to them key by key."""

    def __init__(self, name: str) -> None:
        self.inner = make_eviction(name)

    def touch(self, key: object) -> None:
        self.inner.touch(key)  # type: ignore[arg-type]

    def add(self, key: object) -> None:
        self.inner.add(key)  # type: ignore[arg-type]

    def remove(self, key: object) -> None:
        self.inner.remove(key)  # type: ignore[arg-type]

    def pop_victim(self, evictable=None):  # type: ignore[no-untyped-def]
        return self.inner.pop_victim(evictable)


@pytest.mark.parametrize("name", ["lfu", "lru"])
def test_batched_pins_evict_exactly_as_key_by_key(name: str) -> None:
    """``touch_all``/``add_all`` (one call per job) choose the same victims as ``touch``/``add`` per key."""
    import random

    rng = random.Random(7)
    batched, per_key = ExpertCache(12, name), ExpertCache(12, _PerKey(name))  # type: ignore[arg-type]
    victims: list[list[ExpertKey]] = [[], []]
    for _ in range(400):
        job = tuple({ExpertKey(rng.randrange(3), rng.randrange(8)) for _ in range(3)})
        for cache, log in zip((batched, per_key), victims, strict=True):
            for key in cache.pin_all(job):
                if cache.state(key) is EntryState.WANTED:
                    before = set(cache.resident_keys())
                    assert cache.reserve(key) is not None
                    log.extend(sorted(before - set(cache.resident_keys())))
                    cache.complete(key)
            cache.unpin_all(job)
    assert victims[0] == victims[1]
    assert len(victims[0]) > 50
    assert batched.stats == per_key.stats


def test_a_group_pinned_in_one_batch_is_pinned_as_job_by_job() -> None:
    """``pin_jobs`` (the issuer's batch per computed group) gives each job its missing keys, in gate
    order, and leaves counts, pins and later victims as one ``pin_all`` per job would."""
    import random

    from runahead.jobs import Job

    rng = random.Random(3)
    batched, single = ExpertCache(10), ExpertCache(10)
    victims: list[list[ExpertKey]] = [[], []]
    for step in range(150):
        jobs = [Job(r, step, 1, tuple(rng.sample(range(12), 3))) for r in range(rng.randrange(1, 5))]
        by_group = [expert_keys(missing) for missing in batched.pin_jobs(jobs)]  # ids, as keys
        missing = [by_group, [single.pin_all(job.keys) for job in jobs]]
        assert missing[0] == missing[1]
        for cache, log, misses in zip((batched, single), victims, missing, strict=True):
            fetch_wanted(cache, dict.fromkeys(k for keys in misses for k in keys), log)
            cache.unpin_all([key for job in jobs for key in job.keys])
            assert cache.pinned_count() == 0
    assert victims[0] == victims[1] and len(victims[0]) > 50
    assert batched.stats == single.stats


@pytest.mark.parametrize("name", ["lru", "lfu"])
def test_a_group_unpinned_in_one_call_frees_as_one_release_at_a_time(name: str) -> None:
    """``unpin_ids`` over a group whose jobs share experts (the scheduler's call after a compute)
    leaves the same pins and makes the same entries evictable, in the order their last pin went,
    as one release per expert: later victims are the same."""
    import random

    from runahead.jobs import Job, job_ids

    rng = random.Random(11)
    batched, single = ExpertCache(9, name), ExpertCache(9, name)
    victims: list[list[ExpertKey]] = [[], []]
    held: list[Job] = []  # a job pinned earlier, released with a later group: counts above one
    for step in range(300):
        jobs = [Job(r, step, 2, tuple(rng.sample(range(10), 3))) for r in range(rng.randrange(1, 4))]
        for cache, log in zip((batched, single), victims, strict=True):
            for job in jobs:
                fetch_wanted(cache, cache.pin_all(job.keys), log)
        released = [*held, *jobs] if step % 3 == 0 else jobs[1:]
        held = [] if step % 3 == 0 else [*held, *jobs[:1]]
        batched.unpin_ids(job_ids(released))
        for expert in job_ids(released):
            single.unpin_ids((expert,))
        assert batched.pinned_count() == single.pinned_count()
        assert sorted(batched.resident_keys()) == sorted(single.resident_keys())
    assert victims[0] == victims[1] and len(victims[0]) > 50
    assert batched.stats == single.stats


def test_a_group_released_more_often_than_pinned_names_the_expert() -> None:
    """An over-release inside a group is an error naming the expert; the releases before it stand."""
    from runahead.jobs import expert_id

    cache = ExpertCache(4)
    cache.pin_all([A, B])
    with pytest.raises(RuntimeError, match=r"refcount 0"):
        cache.unpin_ids((expert_id(A), expert_id(B), expert_id(B)))
    assert cache.pinned_count() == 0 and cache.state(A) is None


def test_expert_ids_stand_for_keys_inside_and_never_equal_them() -> None:
    """The hot path's ids: one per expert, turned back into the same key, never equal to a key, and
    a pickled job's ids rebuilt from its experts (another process numbers experts its own way)."""
    import pickle

    from runahead.jobs import Job, expert_id, expert_ids, expert_key

    ids = expert_ids(7, (3, 1, 3))
    assert ids[0] == ids[2] != ids[1] and len(set(expert_ids(7, range(5)))) == 5
    assert [expert_key(i) for i in ids] == [ExpertKey(7, 3), ExpertKey(7, 1), ExpertKey(7, 3)]
    assert expert_id(ExpertKey(7, 1)) == ids[1] and ids[1] != ExpertKey(7, 1)
    with pytest.raises(AttributeError):
        expert_id(ids[1])  # type: ignore[arg-type]  # an id is no key
    job = Job(2, 0, 7, (3, 1), epoch=4)
    assert job.keys == (ExpertKey(7, 3), ExpertKey(7, 1)) and job.ids == ids[:2]
    again = pickle.loads(pickle.dumps(job))
    assert again == job and again.ids == job.ids and again.epoch == 4
    cache = ExpertCache(2)
    cache.pin(ExpertKey(7, 3))  # by key and by id, the same entry
    assert cache.state_id(ids[0]) is EntryState.WANTED and cache.is_wanted(ExpertKey(7, 3))


def test_pins_stop_counting_once_the_whole_model_is_resident() -> None:
    """``experts``: once every expert of the model is resident and no earlier pin is held, a pin is
    a hit with nothing counted, an unpin does nothing, and the slots stay those of the landing."""
    cache = ExpertCache(4, experts=4)
    cache.warm([A])
    assert cache.pin_all([A, B]) == (B,)  # not all resident yet: counted as ever
    fetch(cache, B)
    cache.warm([C, D])
    assert cache.pin(C) is True  # every expert resident, but A and B are still pinned
    assert cache.pinned_count() == 3
    cache.unpin_all([A, B, C])
    assert cache.pinned_count() == 0
    slots = [cache.slot_of(key) for key in (A, B, C, D)]
    hits = cache.stats.hits
    assert cache.pin_all([A, D, D]) == ()
    assert (cache.stats.hits, cache.stats.misses, cache.pinned_count()) == (hits + 3, 1, 0)
    assert cache.pinned_slots([expert_id(k) for k in (D, A)]) == [slots[3], slots[0]]
    cache.unpin_all([A, D, D])
    cache.unpin_all([A])  # uncounted pins: nothing to release, nothing to check
    assert cache.is_idle() and cache.stats.evictions == 0
    assert [cache.slot_of(key) for key in (A, B, C, D)] == slots


@pytest.mark.parametrize("experts", [None, 5])
def test_pins_count_while_some_expert_of_the_model_is_not_resident(experts: int | None) -> None:
    """Without ``experts``, or with one expert of the model never read, every pin counts."""
    cache = ExpertCache(4, experts=experts)
    cache.warm([A, B, C, D])
    assert cache.pin(A) is True and cache.pinned_count() == 1
    with pytest.raises(RuntimeError, match="refcount 0"):
        cache.unpin_all([A, A])


def test_a_model_without_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one expert"):
        ExpertCache(4, experts=0)


def test_a_group_unpinned_by_its_jobs_releases_each_expert_once_a_job() -> None:
    """``unpin_jobs``: the group's experts, job after job, as ``unpin_ids`` of them flattened."""
    cache = ExpertCache(4)
    cache.warm([A, B, C])
    jobs = [Job(0, 0, 0, (0, 1)), Job(1, 0, 0, (1, 2))]
    cache.pin_jobs(jobs)
    assert cache.refcount(B) == 2
    cache.unpin_jobs(jobs)
    assert cache.is_idle() and cache.refcount(B) == 0
    with pytest.raises(RuntimeError, match="refcount 0"):
        cache.unpin_jobs(jobs[:1])
