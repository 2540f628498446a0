"""The torch backend's compute dtype: a named one is honoured, ``auto`` returns one that works, and a
bad name is refused with an error naming the accepted ones (CLI, ``Engine.open``, the backend)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from runahead.backends.dtypes import (
    CANDIDATES,
    DTYPE_CHOICES,
    expert_rows_timings,
    faster_expert_rows,
    fastest_cpu_dtype,
    resolve_dtype,
)
from runahead.backends.torch import TorchBackend
from runahead.cli_parser import DTYPES, build_parser
from runahead.jobs import RequestSpec
from runahead.runtime import Runtime, RuntimeConfig

from modelhelpers import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _decode(backend: TorchBackend, tokens: int = 4) -> list[int]:
    runtime = Runtime(backend, RuntimeConfig(cache_slots=backend.num_slots, policy="runahead"))
    try:
        return asyncio.run(runtime.run([RequestSpec(0, tokens, prompt=(5, 17, 42))]))[0]
    finally:
        backend.close()


def test_the_command_line_offers_the_backend_s_dtypes() -> None:
    assert tuple(DTYPES) == DTYPE_CHOICES
    parser = build_parser()
    for argv in (["generate", "m", "--prompt", "x"], ["serve", "m"], ["bench"], ["demo"]):
        assert parser.parse_args([*argv, "--dtype", "bfloat16"]).dtype == "bfloat16"
        assert parser.parse_args(argv).dtype == "auto"


def test_a_bad_dtype_is_refused_by_name(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'; expected one of auto, float32, bfloat16"):
        resolve_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match=r"unsupported compute dtype torch\.int8"):
        resolve_dtype(torch.int8, "cpu")
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        TorchBackend.open(str(tiny), cache_slots=8, dtype="half")
    from runahead.engine import Engine

    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        asyncio.run(Engine.open(str(tiny), dtype="half"))
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["generate", "m", "--prompt", "x", "--dtype", "fp8"])
    assert stopped.value.code == 2
    assert "argument --dtype: invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_a_named_dtype_is_what_the_backend_computes_in(tiny: Path, name: str) -> None:
    backend = TorchBackend.open(str(tiny), cache_slots=8, dtype=name)
    dtype = getattr(torch, name)
    assert backend.model.dtype == dtype and backend.slots.data.dtype == dtype  # no widening of experts
    assert backend.model.weights["0.q_proj"].dtype == dtype
    tokens = _decode(backend)
    assert len(tokens) == 4 and all(0 <= t < backend.model.config.vocab_size for t in tokens)


@pytest.mark.measured_dtype
def test_auto_times_the_candidates_and_returns_one_that_works(tiny: Path) -> None:
    fastest_cpu_dtype.cache_clear()
    chosen = resolve_dtype("auto", "cpu", (64, 24))
    assert chosen in CANDIDATES
    assert fastest_cpu_dtype(64, 24) is chosen  # measured once per process and shape
    assert fastest_cpu_dtype.cache_info().hits >= 1
    assert resolve_dtype("auto", "cuda") == torch.bfloat16  # no measuring on CUDA
    backend = TorchBackend.open(str(tiny), cache_slots=8, dtype="auto")
    assert backend.model.dtype is chosen
    assert len(_decode(backend)) == 4


@pytest.mark.measured_dtype
def test_the_kernel_race_for_bf16_experts_times_both_rows_where_the_build_has_bf16_dots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """:func:`faster_expert_rows` returns a candidate, once per shape; it times both kinds of rows only
    where the kernel has bf16 dot products, and takes bfloat16 only when they win by its margin."""
    from runahead.backends import dtypes
    from runahead.models import qkernel

    faster_expert_rows.cache_clear()
    chosen = faster_expert_rows(64, 32)
    assert chosen in CANDIDATES and faster_expert_rows(64, 32) is chosen
    assert faster_expert_rows(64, 48) is torch.float32  # 48: not whole 32-weight blocks
    if not qkernel.bf16_dot():
        assert chosen is torch.float32
        return
    timings = expert_rows_timings(64, 32)
    assert set(timings) == {"float32", "bfloat16"} and all(t > 0 for t in timings.values())
    margin = dtypes.BF16_ROWS_WIN
    for share, wanted in ((margin, torch.bfloat16), (margin + 0.01, torch.float32)):
        seconds = {torch.float32: 1.0, torch.bfloat16: share}
        monkeypatch.setattr(dtypes, "_expert_rows_times", lambda _h, _i, s=seconds: s)
        faster_expert_rows.cache_clear()
        assert faster_expert_rows(64, 32) is wanted, share
    faster_expert_rows.cache_clear()


def test_the_race_takes_turns_keeps_each_best_and_drops_a_hopeless_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The candidates' passes alternate (order reversed every other round), each candidate's best pass
    counts, and with a give-up factor one far slower in the first round is cut short there (its pass
    gets the deadline) and not timed again: a pause of the machine cannot fall on one candidate's
    passes alone."""
    from runahead.backends import dtypes

    clock = [0.0]
    monkeypatch.setattr(dtypes, "_clock", lambda: clock[0])
    calls: list[tuple[str, float]] = []

    def timed(name: str, seconds: list[float]) -> dtypes.Pass:
        def run(deadline: float) -> None:
            calls.append((name, deadline - clock[0]))
            clock[0] += seconds.pop(0)

        return run

    f32, bf16 = torch.float32, torch.bfloat16
    best = dtypes._race({f32: timed("f32", [3.0, 1.0, 2.0]), bf16: timed("bf16", [2.0, 5.0, 1.5])}, 3)
    assert [name for name, _ in calls] == ["f32", "bf16", "bf16", "f32", "f32", "bf16"]
    assert best == {f32: 1.0, bf16: 1.5}  # f32's best is its second pass: one slow pass does not decide

    calls.clear()
    best = dtypes._race({f32: timed("f32", [1.0, 1.0, 1.0]), bf16: timed("bf16", [4.5])}, 3, give_up=4.0)
    assert calls == [("f32", float("inf")), ("bf16", 4.0), ("f32", float("inf")), ("f32", float("inf"))]
    assert best == {f32: 1.0, bf16: 4.5}
