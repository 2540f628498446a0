"""``runahead generate``: JSON output equals transformers' greedy tokens; traces are recorded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runahead.cli import main
from runahead.trace import RoutingTrace

from modelhelpers import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3"))


def test_generate_json_matches_transformers_and_records_the_trace(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = torch.tensor([tokenizer.encode("w5 w17 w42")])
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    expected = out[0, ids.shape[1] :].tolist()
    if tokenizer.eos_token_id in expected:  # the CLI stops at the tokenizer's end-of-sequence token
        expected = expected[: expected.index(tokenizer.eos_token_id) + 1]

    trace = tmp_path / "trace.npz"
    argv = ["generate", str(model), "--prompt", "w5 w17 w42", "--max-tokens", "10", "--concurrency", "3"]
    assert main([*argv, "--json", "--record-trace", str(trace)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["request"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["token_ids"] == expected
        assert row["text"] == tokenizer.decode(expected)
    recorded = RoutingTrace.load(trace)
    assert (recorded.num_requests, recorded.num_layers, recorded.top_k) == (3, 3, 2)
    assert recorded.num_steps == len(expected) - 1  # decode steps: the prompt's pass gave the first token


def test_sampling_with_a_seed_is_reproducible(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "generate",
        str(model),
        "--prompt-ids",
        "5,17,42",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--concurrency",
        "2",
        "--json",
    ]
    main(argv)
    first = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    main(argv)
    second = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert first == second
    assert first[0] != first[1]  # copy i samples with seed + i


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], "argument --temperature: must be in [0.0, 100.0], got -1.0"),
        (["--top-p", "0"], "argument --top-p: must be in (0.0, 1.0], got 0.0"),
        (["--cache-fraction", "1.5"], "argument --cache-fraction: must be in (0.0, 1.0], got 1.5"),
        (["--policy", "fastest"], "unknown policy 'fastest'"),
    ],
)
def test_bad_generate_arguments_are_named(
    model: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["generate", str(model), "--prompt-ids", "5", *extra])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_prompt_ids_outside_the_vocabulary_are_named(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", str(model), "--prompt-ids", "5,99999"])
    assert "outside the vocabulary [0, 256)" in capsys.readouterr().err


def test_bench_on_the_torch_backend_writes_rows(model: Path, tmp_path: Path) -> None:
    from runahead.bench import REQUIRED_FIELDS

    argv = [
        "bench",
        "--backend",
        "torch",
        "--model",
        str(model),
        "--policy",
        "sync,runahead",
        "--concurrency",
        "3",
        "--cache-fraction",
        "0.4",
        "--steps",
        "6",
        "--warmup-steps",
        "2",
        "--out",
        str(tmp_path),
        "--quiet",
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [row["policy"] for row in rows] == ["sync", "runahead"]
    for row in rows:
        assert set(REQUIRED_FIELDS) <= set(row)
        assert row["backend"] == "torch" and row["tokens"] == 3 * 6
        assert row["fetch_s"] > 0 and row["compute_s"] > 0


def test_generate_writes_a_timeline(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "gen.json"
    main(
        [
            "generate",
            str(model),
            "--prompt-ids",
            "5,17",
            "--max-tokens",
            "4",
            "--json",
            "--timeline",
            str(trace),
        ]
    )
    events = json.loads(trace.read_text())["traceEvents"]
    tokens = [e for e in events if e.get("ph") == "i"]
    assert len(tokens) == 4  # one instant event per generated token


def test_a_recorded_trace_replays_on_its_own_model_spec(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "run.npz"
    argv = ["generate", str(model), "--prompt-ids", "5,17", "--max-tokens", "8", "--concurrency", "2"]
    assert main([*argv, "--json", "--record-trace", str(trace)]) == 0
    recorded = RoutingTrace.load(trace)
    spec = recorded.spec
    assert spec is not None and spec.name == model.name
    assert (spec.num_layers, spec.num_experts, spec.top_k, spec.bits_per_weight) == (3, 8, 2, 32)
    capsys.readouterr()

    out = tmp_path / "bench"
    replay = ["bench", "--trace", str(trace), "--policy", "sync,runahead", "--profile", "mac-mini"]
    assert (
        main([*replay, "--concurrency", "2", "--steps", "4", "--warmup-steps", "2", "--out", str(out)]) == 0
    )
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(row["model"], row["policy"]) for row in rows] == [(model.name, "sync"), (model.name, "runahead")]
    assert all(row["tokens"] == 2 * 4 for row in rows)
    # fewer requests than asked for, or fewer steps: refused, not reused
    for extra, message in (
        (["--concurrency", "3"], "the trace holds 2 request(s), fewer than concurrency 3"),
        (["--concurrency", "2", "--steps", "20"], "hold 7 decode steps, fewer than --warmup-steps 8"),
    ):
        with pytest.raises(SystemExit) as exit:
            main([*replay, *extra])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err


def record_opened_stores(monkeypatch: pytest.MonkeyPatch, what: Any) -> list[Any]:
    """What ``what`` reads from the read workers (``store._executor``) of every torch backend opened
    from now on, in order."""
    from runahead.backends.torch import TorchBackend

    seen: list[Any] = []
    open_backend = TorchBackend.open

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        backend = open_backend(*args, **kwargs)
        seen.append(what(backend.store._executor))
        return backend

    monkeypatch.setattr(TorchBackend, "open", recording)
    return seen


def tokens_without_and_with(
    model: Path, capsys: pytest.CaptureFixture[str], options: list[str]
) -> tuple[list[int], list[int]]:
    """``runahead generate``'s tokens for one prompt, without and then with ``options``."""
    argv = ["generate", str(model), "--prompt-ids", "5,17,42", "--max-tokens", "6", "--json"]
    seen = []
    for extra in ([], options):
        main([*argv, *extra])
        seen.append(json.loads(capsys.readouterr().out)["token_ids"])
    return seen[0], seen[1]


def test_a_link_cap_reaches_the_backend_and_changes_no_token(
    model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = record_opened_stores(monkeypatch, lambda executor: executor.link)
    free, capped = tokens_without_and_with(model, capsys, ["--link-gbps", "0.25"])
    assert capped == free
    assert opened[0] is None and opened[1] is not None and opened[1].bandwidth == 0.25e9


def test_reads_in_flight_reach_the_store_and_the_link_and_change_no_token(
    model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--reads-in-flight`` (``Engine.open(reads_in_flight=...)``): the store's read workers and the
    runtime's link workers both take it (by default four store workers, and sixteen link workers
    where groups are computed inline); the tokens stay the same."""
    from runahead.engine import Engine

    depths = record_opened_stores(monkeypatch, lambda executor: executor.queue_depth)
    links = []
    engine_open = Engine.open.__func__  # type: ignore[attr-defined]

    async def engine_recording(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        engine = await engine_open(cls, *args, **kwargs)
        links.append(engine.runtime.link_queue_depth)
        return engine

    monkeypatch.setattr(Engine, "open", classmethod(engine_recording))
    default, one = tokens_without_and_with(model, capsys, ["--reads-in-flight", "1"])
    assert one == default
    assert depths == [4, 1] and links == [16, 1]  # by default the link keeps 16 in flight: groups inline
    with pytest.raises(ValueError, match="reads_in_flight must be a whole number >= 1, got 0"):
        asyncio.run(Engine.open(str(model), reads_in_flight=0))


def test_inline_compute_off_reaches_the_runtime_and_changes_no_token(
    model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--inline-compute off`` (``Engine.open(inline_compute=False)``): no group computes on the
    event loop's thread; on by default, some do (one request: the link idles between its reads)."""
    from runahead.engine import Engine

    runtimes = []
    engine_open = Engine.open.__func__  # type: ignore[attr-defined]

    async def engine_recording(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        engine = await engine_open(cls, *args, **kwargs)
        runtimes.append(engine.runtime)
        return engine

    monkeypatch.setattr(Engine, "open", classmethod(engine_recording))
    default, off = tokens_without_and_with(model, capsys, ["--inline-compute", "off"])
    assert off == default
    assert [runtime.config.inline_compute for runtime in runtimes] == [True, False]
    assert runtimes[0].recorder.inline_groups > 0 and runtimes[1].recorder.inline_groups == 0
