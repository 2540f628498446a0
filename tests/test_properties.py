"""Scheduler properties over random models, traces, capacities and policies (hypothesis).

Whatever the policy: every request completes with its tokens; refcounts end at zero; a pinned
entry is never evicted; no expert has two reads in flight; and each request's expert selections
are exactly the trace's, so scheduling never changes what is computed.
"""

import itertools
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runahead.backends.sim import FixedCosts, sim_token
from runahead.jobs import RequestSpec, expert_key
from runahead.runtime import Runtime

from simhelpers import POLICIES, random_trace, simulate


class CheckedEviction:
    """Wraps the cache's eviction policy and checks every victim it names.

    Also the cache's last resort, a held prefetch taken when no other victim exists (it bypasses the
    policy by design): checked the same way, so ``victims`` counts every eviction.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.cache = runtime.cache
        self.inner = runtime.cache.eviction
        self.victims = 0
        runtime.cache.eviction = self  # type: ignore[assignment]
        evict_held = runtime.cache._evict_held

        def checked_evict_held() -> int:
            self.check(next(iter(self.cache._held_idle)))
            return evict_held()

        runtime.cache._evict_held = checked_evict_held  # type: ignore[method-assign]

    def check(self, victim) -> None:  # type: ignore[no-untyped-def]
        key = expert_key(victim)  # the cache hands its policy expert ids
        assert self.cache.refcount(key) == 0, f"pinned {key} chosen for eviction"
        assert self.cache.is_resident(key)
        self.victims += 1

    def touch(self, key):  # type: ignore[no-untyped-def]
        self.inner.touch(key)

    def add(self, key):  # type: ignore[no-untyped-def]
        self.inner.add(key)

    def remove(self, key):  # type: ignore[no-untyped-def]
        self.inner.remove(key)

    def pop_victim(self, evictable=None):  # type: ignore[no-untyped-def]
        victim = self.inner.pop_victim(evictable)
        if victim is not None:
            self.check(victim)
        return victim


scenario = st.fixed_dictionaries(
    {
        "requests": st.integers(1, 5),
        "steps": st.integers(1, 3),
        "layers": st.integers(1, 4),
        "experts": st.integers(2, 10),
        "top_k": st.integers(1, 3),
        "spare": st.integers(0, 12),
        "seed": st.integers(0, 2**16),
        "barrier": st.booleans(),
        "eviction": st.sampled_from(["lru", "lfu"]),
        "depth": st.integers(1, 3),
        "costs": st.tuples(
            st.integers(0, 900), st.integers(0, 300), st.integers(1, 700), st.integers(0, 200)
        ),
        "prefill": st.integers(0, 12),
        "chunk": st.integers(1, 8),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario, st.sampled_from([*POLICIES, "runahead/grouping=opportunistic"]))
def test_every_policy_completes_exactly(case: dict, policy: str) -> None:  # type: ignore[type-arg]
    top_k = min(case["top_k"], case["experts"])
    trace = random_trace(
        case["requests"], case["steps"], case["layers"], case["experts"], top_k, case["seed"]
    )
    slots = top_k + case["spare"]
    requests = [
        RequestSpec(r, max_tokens=case["steps"] - r % 2 or 1, prefill_tokens=case["prefill"] * (r % 3))
        for r in range(case["requests"])
    ]
    group, per_expert, transfer, latency = (us / 1e6 for us in case["costs"])

    from runahead.backends.sim import SimBackend
    from runahead.clock import run_virtual
    from runahead.runtime import RuntimeConfig

    runtime = Runtime(
        SimBackend(trace, FixedCosts(group, per_expert, transfer, latency)),
        RuntimeConfig(
            cache_slots=slots,
            policy=policy,
            step_barrier=case["barrier"],
            eviction=case["eviction"],
            link_queue_depth=case["depth"],
            record_selections=True,
            prefill_chunk=case["chunk"],
        ),
    )
    checked = CheckedEviction(runtime)
    results = run_virtual(lambda: runtime.run(requests))

    # every request completes, with the tokens the model (here: the sim) gives
    assert results == {r.request: [sim_token(r, s) for s in range(r.max_tokens)] for r in requests}
    # refcounts end at zero, nothing in flight
    assert runtime.cache.is_idle()
    assert checked.victims == runtime.cache.stats.evictions
    # no expert has two reads in flight
    reads = defaultdict(list)
    for record in runtime.recorder.fetches:
        reads[record.key].append((record.start, record.end))
    for intervals in reads.values():
        intervals.sort()
        assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(intervals))
    # each request's decode selections are exactly the trace's, in order, after its prefill passes
    for request in requests:
        passes = len(request.chunk_sizes(case["chunk"]))
        first = passes  # a prompt's last pass yields the first token
        decode_steps = request.max_tokens - 1 if passes else request.max_tokens
        expected = [
            (first + d, layer, trace.selections(request.request)[d][layer])
            for d in range(decode_steps)
            for layer in range(case["layers"])
        ]
        assert runtime.recorder.selections.get(request.request, []) == expected
    # the deadlock rule held: never more requests at once than the cache can pin for
    assert max_concurrent(runtime) <= slots // top_k


def max_concurrent(runtime: Runtime) -> int:
    """Most requests between their first compute and their last token at any instant."""
    spans: dict[int, list[float]] = {}
    for record in runtime.recorder.computes:
        for request in record.requests:
            span = spans.setdefault(request, [record.start, record.end])
            span[1] = max(span[1], record.end)
    events = sorted(
        [(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()],
        key=lambda event: (event[0], event[1]),
    )
    active = peak = 0
    for _, change in events:
        active += change
        peak = max(peak, active)
    return peak


def test_a_cache_too_small_for_all_requests_admits_them_in_turn() -> None:
    trace = random_trace(requests=6, steps=3, layers=3, experts=8, top_k=2, seed=3)
    requests = [RequestSpec(r, max_tokens=3) for r in range(6)]
    runtime = simulate(trace, policy="runahead", slots=5, requests=requests)  # room for 2 x top-2
    assert set(runtime.results) == set(range(6))  # type: ignore[attr-defined]
    assert max_concurrent(runtime) == 2
    assert runtime.max_active == 2


def test_a_cache_smaller_than_one_job_is_refused_up_front() -> None:
    import pytest

    from runahead.backends.sim import SimBackend
    from runahead.runtime import RuntimeConfig

    trace = random_trace(requests=1, steps=1, layers=2, experts=8, top_k=4)
    with pytest.raises(ValueError, match="cache of 3 slots cannot hold the 4 experts"):
        Runtime(SimBackend(trace, FixedCosts(0.001, 0, 0.001)), RuntimeConfig(cache_slots=3))


def test_two_runs_with_the_same_seed_are_identical_event_for_event() -> None:
    from runahead.bench import BenchPoint, run_point

    logs = []
    for _ in range(2):
        point = BenchPoint("olmoe-1b-7b", "mac-mini", "runahead+prefetch", 4, 0.2, 6, step_barrier=False)
        captured: list[Runtime] = []
        run_point(point, timeline=captured.append)
        recorder = captured[0].recorder
        logs.append((recorder.computes, recorder.fetches, recorder.tokens, captured[0].cache.stats))
    assert logs[0] == logs[1]
    assert len(logs[0][0]) > 100 and len(logs[0][1]) > 100
