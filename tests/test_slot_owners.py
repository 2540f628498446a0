"""Which expert each cache slot holds (runahead/backends/common.py: SlotOwners), as a backend sees it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from runahead.backends.common import SlotOwners
from runahead.backends.torch import TorchBackend
from runahead.jobs import ExpertKey, RequestSpec
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams

from modelhelpers import EXACTNESS_PROMPTS, build_tiny_model

X, Y = ExpertKey(0, 1), ExpertKey(0, 2)


def test_a_slot_refilled_forgets_only_what_it_still_held() -> None:
    """X was in slot 2, then fetched again into slot 5; slot 2 then takes Y. X is still in slot 5."""
    owners = SlotOwners()
    owners.claim(X, 2)
    owners.filled(X, 2)
    owners.claim(X, 5)
    owners.filled(X, 5)
    owners.claim(Y, 2)
    owners.filled(Y, 2)
    assert owners.slot(X) == 5
    assert owners.slot(Y) == 2


def test_an_expert_being_fetched_again_is_nowhere_until_it_lands() -> None:
    """Its old slot's bytes may be overwritten any time now: neither slot counts until it lands."""
    owners = SlotOwners()
    owners.claim(X, 2)
    owners.filled(X, 2)
    owners.claim(X, 5)
    with pytest.raises(RuntimeError, match="not resident"):
        owners.slot(X)
    assert 2 not in owners.owner
    owners.filled(X, 5)
    assert owners.slot(X) == 5
    with pytest.raises(RuntimeError, match="not resident"):
        owners.slot(Y)


def _tokens(backend: TorchBackend, policy: str) -> dict[int, list[int]]:
    runtime = Runtime(backend, RuntimeConfig(cache_slots=backend.num_slots, policy=policy, prefill_chunk=2))
    params = SamplingParams(max_tokens=8)
    specs = [RequestSpec(i, 8, prompt=tuple(p), sampling=params) for i, p in enumerate(EXACTNESS_PROMPTS)]
    return asyncio.run(runtime.run(specs))


def test_a_backend_serves_a_second_runtime_after_the_first(tmp_path: Path) -> None:
    """A new runtime starts from an empty cache on a backend whose slots the last one filled: every
    slot is fetched again before use, and the tokens are those of a fresh backend."""
    path = str(build_tiny_model("qwen3_moe", tmp_path / "qwen3_moe"))
    fresh = TorchBackend.open(path, cache_slots=8)
    try:
        expected = _tokens(fresh, "runahead")
    finally:
        fresh.close()
    reused = TorchBackend.open(path, cache_slots=8)
    try:
        _tokens(reused, "sync")
        assert _tokens(reused, "runahead") == expected
    finally:
        reused.close()
