"""The compute thread's scheduling priority (:mod:`runahead.backends.priority`): asked for where the OS
allows it, left alone where it refuses (said once), set by ``$RUNAHEAD_COMPUTE_NICE`` or the backend's
``compute_nice``, and a bad value refused by name."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

from runahead.backends import priority
from runahead.backends.priority import COMPUTE_NICE, ENV, prioritize_this_thread, wanted_nice
from runahead.backends.torch import TorchBackend
from runahead.jobs import RequestSpec
from runahead.runtime import Runtime, RuntimeConfig

from modelhelpers import build_tiny_model

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice is Linux's")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def test_the_nice_asked_for_comes_from_the_environment_or_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert wanted_nice() == COMPUTE_NICE
    for text, nice in (("-5", -5), ("0", 0), ("19", 19), ("off", None), (" OFF ", None), ("", COMPUTE_NICE)):
        monkeypatch.setenv(ENV, text)
        assert wanted_nice() == nice, text
    for bad in ("high", "-21", "20", "1.5"):
        with pytest.raises(ValueError, match=rf"{ENV} must be an integer from -20 to 19 or 'off', got"):
            wanted_nice(bad)


def _on_a_thread(nice: int | None) -> tuple[int | None, int]:
    """``prioritize_this_thread(nice)`` on a fresh thread: what it returned, and the thread's nice then."""
    found: list[tuple[int | None, int]] = []

    def run() -> None:
        result = prioritize_this_thread(nice)
        found.append((result, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return found[0]


@linux
def test_a_thread_runs_at_the_nice_it_reports_raised_where_allowed() -> None:
    process = os.getpriority(os.PRIO_PROCESS, 0)
    result, actual = _on_a_thread(process - 1)
    assert result == actual  # what it says is what the thread runs at
    assert actual in (process - 1, process)  # raised, or left where it was (no CAP_SYS_NICE)
    result, actual = _on_a_thread(process + 1)  # never lowered by asking for less
    assert result == actual == process
    assert _on_a_thread(None) == (None, process)


@linux
def test_a_refusal_leaves_the_thread_as_it_was_and_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    said: list[dict[str, object]] = []
    monkeypatch.setattr(os, "setpriority", refuse)
    monkeypatch.setattr(priority, "_refused", False)
    monkeypatch.setattr(priority.log, "info", lambda event, **fields: said.append({"event": event, **fields}))
    process = os.getpriority(os.PRIO_PROCESS, 0)
    assert _on_a_thread(process - 5) == (process, process)
    assert _on_a_thread(process - 5) == (process, process)
    assert len(said) == 1 and said[0]["asked"] == process - 5 and "CAP_SYS_NICE" in str(said[0]["why"])


def _decode(backend: TorchBackend) -> list[int]:
    # every group on the compute thread (none on the loop's while the link idles): its priority is checked
    config = RuntimeConfig(cache_slots=backend.num_slots, policy="runahead", inline_compute=False)
    runtime = Runtime(backend, config)
    try:
        return asyncio.run(runtime.run([RequestSpec(0, 3, prompt=(5, 17, 42))]))[0]
    finally:
        backend.close()


@linux
def test_the_backend_s_compute_thread_reports_its_nice_and_computes_the_same_tokens(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    original = TorchBackend._compute

    def compute(self: TorchBackend, group: object) -> object:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return original(self, group)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchBackend, "_compute", compute)
    monkeypatch.delenv(ENV, raising=False)
    asked = TorchBackend.open(str(tiny), cache_slots=8, dtype="float32")
    assert asked.compute_nice is None  # the thread starts with the first group
    tokens = _decode(asked)
    assert asked.compute_nice == seen[0] and set(seen) == {seen[0]}
    assert seen[0] <= max(COMPUTE_NICE, os.getpriority(os.PRIO_PROCESS, 0))
    seen.clear()
    alone = TorchBackend.open(str(tiny), cache_slots=8, dtype="float32", compute_nice=None)
    assert _decode(alone) == tokens and alone.compute_nice is None
    assert set(seen) == {os.getpriority(os.PRIO_PROCESS, 0)}
    monkeypatch.setenv(ENV, "off")
    off = TorchBackend.open(str(tiny), cache_slots=8, dtype="float32")
    assert _decode(off) == tokens and off.compute_nice is None


def test_a_bad_compute_nice_is_refused_by_name(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    accepted = r"compute_nice must be an integer from -20 to 19, None or 'auto', got"
    with pytest.raises(ValueError, match=rf"{accepted} 'high'"):
        TorchBackend.open(str(tiny), cache_slots=8, dtype="float32", compute_nice="high")
    with pytest.raises(ValueError, match=rf"{accepted} 40"):
        TorchBackend.open(str(tiny), cache_slots=8, dtype="float32", compute_nice=40)
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=rf"{ENV} must be an integer from -20 to 19 or 'off', got 'fast'"):
        TorchBackend.open(str(tiny), cache_slots=8, dtype="float32")
