"""The package's promises: a light import, and the CLI's errors."""

import subprocess
import sys

import pytest

from runahead.cli import main


def test_import_runahead_needs_neither_torch_nor_mlx_nor_numpy() -> None:
    code = (
        "import sys, runahead; runahead.Runtime; runahead.RequestSpec;"
        "print(sorted(m for m in ('torch', 'mlx', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_names_a_bad_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--policy", "runahead,fastest"])
    assert exit_.value.code == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err


def test_cli_names_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--model", "qwen9-1t", "--steps", "1", "--concurrency", "1"])
    assert "qwen9-1t" in capsys.readouterr().err


def test_cli_bench_writes_rows(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import json

    from runahead.bench import REQUIRED_FIELDS

    code = main(
        [
            "bench",
            "--model",
            "olmoe-1b-7b",
            "--profile",
            "pcie4-desktop",
            "--policy",
            "sync,runahead",
            "--concurrency",
            "2",
            "--steps",
            "4",
            "--warmup-steps",
            "2",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [row["policy"] for row in rows] == ["sync", "runahead"]
    for row in rows:
        assert set(REQUIRED_FIELDS) <= set(row)
        assert row["lower_bound_s"] == max(row["compute_s"], row["fetch_s"])
        assert row["step_time_s"] >= row["lower_bound_s"]
    table = capsys.readouterr().out
    assert "runahead" in table and "vs sync" in table


def test_bench_timeline_writes_one_chrome_trace_per_point(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    trace = tmp_path / "run.json"
    argv = [
        "bench",
        "--model",
        "olmoe-1b-7b",
        "--policy",
        "sync,runahead",
        "--concurrency",
        "2",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
        "--quiet",
        "--timeline",
        str(trace),
    ]
    assert main(argv) == 0
    for index in (0, 1):
        events = json.loads((tmp_path / f"run-{index}.json").read_text())["traceEvents"]
        assert any(e.get("cat") == "compute" for e in events) and any(e.get("cat") == "fetch" for e in events)
