"""The torch backend's compute threads on CPU: ``auto`` leaves one core to the event loop and the
readers, a count is honoured, and a bad value is refused by name (backend, Engine, bench, CLI)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runahead.backends import threads as thread_choice
from runahead.backends.threads import resolve_threads
from runahead.backends.torch import TorchBackend
from runahead.cli_parser import build_parser
from runahead.jobs import RequestSpec
from runahead.runtime import Runtime, RuntimeConfig
from runahead.torchbench import TorchPoint

from modelhelpers import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Put torch's thread count back as it was: the backend sets a process-wide count."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_auto_is_every_core_but_one_and_at_least_one(
    cores: int, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(thread_choice, "available_cores", lambda: cores)
    assert resolve_threads("auto", "cpu") == expected
    assert resolve_threads(3, "cpu") == 3  # a count is taken as given, whatever the cores


def test_on_cuda_torch_s_own_setting_is_left_alone() -> None:
    assert resolve_threads("auto", "cuda") is None
    with pytest.raises(ValueError, match="threads sets the CPU's compute threads; the device cuda computes"):
        resolve_threads(4, "cuda")


@pytest.mark.parametrize("bad", [0, -2, True, "two", 1.5, None])
def test_a_bad_thread_count_is_refused_by_name(bad: object, tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"threads must be a count >= 1 or 'auto', got"):
        resolve_threads(bad, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"threads must be a count >= 1 or 'auto'"):
        TorchBackend.open(str(tiny), cache_slots=8, threads=bad)  # type: ignore[arg-type]


def test_the_backend_computes_with_the_threads_asked_for_and_the_same_tokens(
    tiny: Path, torch_threads: None
) -> None:
    tokens = {}
    for count in (1, 2):
        backend = TorchBackend.open(str(tiny), cache_slots=8, dtype="float32", threads=count)
        assert backend.compute_threads == count == torch.get_num_threads()
        runtime = Runtime(backend, RuntimeConfig(cache_slots=backend.num_slots, policy="runahead"))
        try:
            tokens[count] = asyncio.run(runtime.run([RequestSpec(0, 6, prompt=(5, 17, 42))]))[0]
        finally:
            backend.close()
    assert tokens[1] == tokens[2] and len(tokens[1]) == 6


def test_auto_sets_every_core_but_one(tiny: Path, torch_threads: None) -> None:
    backend = TorchBackend.open(str(tiny), cache_slots=8, dtype="float32")
    try:
        expected = max(1, thread_choice.available_cores() - 1)
        assert backend.compute_threads == expected == torch.get_num_threads()
    finally:
        backend.close()


def test_threads_are_the_torch_backend_s_and_mlx_refuses_a_count(tmp_path: Path) -> None:
    from runahead.engine import Engine

    with pytest.raises(ValueError, match="the mlx backend picks its own, got 2"):
        asyncio.run(Engine.open(str(tmp_path / "no-such-model"), backend="mlx", threads=2))
    with pytest.raises(ValueError, match="compute threads are set on the torch backend only"):
        TorchPoint("small", "sync", 1, 0.5, 4, backend="mlx", threads=2)


def test_the_command_line_takes_a_count_or_auto() -> None:
    parser = build_parser()
    for argv in (["generate", "m", "--prompt", "x"], ["serve", "m"], ["bench"], ["demo"]):
        assert parser.parse_args(argv).threads == "auto"
        assert parser.parse_args([*argv, "--threads", "3"]).threads == 3
        assert parser.parse_args([*argv, "--threads", "auto"]).threads == "auto"


def test_an_open_that_fails_leaves_torch_s_threads_as_they_were(tmp_path: Path, torch_threads: None) -> None:
    torch.set_num_threads(2)
    with pytest.raises((FileNotFoundError, ValueError)):
        TorchBackend.open(str(tmp_path / "no-such-model"), cache_slots=8, threads=1)
    assert torch.get_num_threads() == 2
