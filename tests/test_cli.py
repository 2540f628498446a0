"""The command line as a new user meets it: help that says what and what default, one-line errors."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from runahead.cli import build_parser, main
from runahead.cli_args import HelpFormatter
from runahead.extras import missing_extra

COMMANDS = ("bench", "demo", "serve", "generate", "convert")


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (choices,) = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert isinstance(choices, dict)
    return choices[name]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_a_help_line_with_its_default(name: str) -> None:
    parser = subcommand(name)
    shown = "".join(parser.format_help().split())  # compared without whitespace: lines wrap at hyphens
    formatter = HelpFormatter(name)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"runahead {name} {action.dest}: no help line"
        help_line = formatter._get_help_string(action)
        assert help_line is not None
        if action.option_strings and action.default not in (None, False):
            assert "(default: " in help_line, f"runahead {name} {action.option_strings[0]}: no default shown"
        assert "".join(help_line.split()) in shown


def test_defaults_read_as_the_user_types_them() -> None:
    text = " ".join(subcommand("bench").format_help().split())
    assert "(default: 2,4,8,16)" in text  # --concurrency
    assert "(default: on)" in text  # --step-barrier
    assert "(default: 8)" in " ".join(subcommand("demo").format_help().split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--concurrency", "0"], "argument --concurrency: must be >= 1, got 0"),
        (["demo", "--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
        (["demo", "--cache-fraction", "0"], "argument --cache-fraction: must be in (0.0, 1.0], got 0.0"),
        (["serve", "m", "--port", "80000"], "argument --port: must be in [0, 65535], got 80000"),
        (
            ["serve", "m", "--device", "tpu"],
            "argument --device: expected cpu, cuda, cuda:N (torch), gpu or auto (mlx), got 'tpu'",
        ),
        (
            ["generate", "m", "--prompt", "x", "--device", "tpu"],
            "expected cpu, cuda, cuda:N (torch), gpu or auto (mlx)",
        ),
        (["generate", "m", "--prompt-ids", "1,x"], "argument --prompt-ids: expected an integer, got 'x'"),
        (["generate", "no/such/folder", "--prompt", "x"], "model folder 'no/such/folder' does not exist"),
        (["bench", "--concurrency", "2,x"], "argument --concurrency: expected an integer, got 'x'"),
        (["bench", "--policy", "fastest"], "unknown policy 'fastest'"),
        (["bench", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["bench", "--step-barrier", "maybe"], "expected on, off or on,off"),
        (["bench", "--link-gbps", "0"], "argument --link-gbps: must be > 0.0, got 0.0"),
        (["bench", "--link-gbps", "inf"], "argument --link-gbps: expected a finite number, got 'inf'"),
        (["serve", "m", "--link-gbps", "-1"], "argument --link-gbps: must be > 0.0, got -1.0"),
        (["generate", "m", "--prompt", "x", "--link-gbps", "0"], "--link-gbps: must be > 0.0, got 0.0"),
        (["bench", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["serve", "m", "--reads-in-flight", "0"], "argument --reads-in-flight: must be >= 1, got 0"),
        (["bench", "--reads-in-flight", "8"], "the sim's link keeps its profile's link_queue_depth"),
        (["bench", "--inline-compute", "off"], "the sim computes on virtual time: drop it"),
        (["bench", "--charge-scale", "0"], "argument --charge-scale: must be > 0.0, got 0.0"),
        (["bench", "--charge-scale", "3"], "--charge-scale scales what --charge-overhead charges"),
        (["bench", "paper", "--out", "x", "--charge-scale", "3"], "--charge-scale scales what"),
        (
            ["bench", "--backend", "torch", "--charge-overhead"],
            "--backend torch runs on real time, which already pays it: drop them",
        ),
        (["serve", "m", "--inline-compute", "maybe"], "argument --inline-compute: invalid choice: 'maybe'"),
        (["serve", "m", "--threads", "two"], "argument --threads: expected an integer, got 'two'"),
        (["generate", "m", "--prompt", "x", "--temperature", "nan"], "expected a finite number, got 'nan'"),
        (
            ["bench", "--policy", "runahead/grouping=static:2:2:2", "--concurrency", "4", "--steps", "1"],
            "its static groups hold 6 requests, which does not divide concurrency 4",
        ),
        (["bench", "--trace", "no-such.npz"], "no-such.npz"),
        (["bench", "--backend", "torch", "--trace", "t.npz"], "--trace replays recorded routing on the sim"),
        (["bench", "paper"], "runahead bench paper needs --out DIR"),
        (
            ["bench", "paper", "--out", "x", "--workload", "agentic", "--steps", "8"],
            "ignores --steps, --workload: drop them",
        ),
        (["bench", "--workload-file", "no-such.json"], "ShareGPT file no-such.json does not exist"),
        (
            ["bench", "--workload", "agentic", "--workload-file", "no-such"],
            "SWE-agent trajectory path no-such does not exist",
        ),
        (
            ["bench", "--backend", "torch", "--workload-file", "x.json"],
            "--workload-file shape the sim backend",
        ),
    ],
)
def test_a_bad_argument_gets_one_line_and_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"runahead {argv[0]}: error: "), err
    assert message in err


def test_a_cuda_device_this_torch_lacks_is_refused_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit:
        main(["generate", "no/such/folder", "--prompt", "x", "--device", "cuda"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: this torch" in err and "use --device cpu" in err


@pytest.mark.parametrize(
    ("hidden", "argv", "extra"),
    [("torch", ["demo"], "torch"), ("starlette", ["serve", "small"], "serve")],
)
def test_a_missing_optional_package_names_its_extra(hidden: str, argv: list[str], extra: str) -> None:
    code = (
        f"import sys; sys.modules[{hidden!r}] = None\n"  # makes 'import {hidden}' fail as if not installed
        "from runahead.cli import main\n"
        f"sys.exit(main({argv!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"runahead {argv[0]}: error: this needs the {hidden!r} package: pip install 'runahead[{extra}]' "
        "(or 'runahead[all]')"
    ]


def test_an_unrelated_missing_module_is_not_blamed_on_an_extra() -> None:
    assert missing_extra(ModuleNotFoundError("no", name="torchvision")) is None
    assert "runahead[torch]" in (missing_extra(ModuleNotFoundError("no", name="transformers.models")) or "")


def test_the_library_names_the_extra_too() -> None:
    code = (
        "import asyncio, sys; sys.modules['torch'] = None\n"
        "from runahead import Engine\n"
        "try:\n"
        "    asyncio.run(Engine.open('no/such/folder'))\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == (
        "this needs the 'torch' package: pip install 'runahead[torch]' (or 'runahead[all]')"
    ), done.stderr


def test_the_demo_alternates_which_policy_runs_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pairs alternate their first policy (a drifting machine favours neither); rows and ratios still
    come as sync, then runahead, and every run gives the same tokens."""
    from structlog.testing import capture_logs

    from runahead.demo import run_pairs

    monkeypatch.setenv("RUNAHEAD_CACHE", str(tmp_path))
    with capture_logs() as logs:
        rows, ratios = run_pairs(2, 2, 0.5, "host", 2)
    ran = [(entry["repeat"], entry["policy"]) for entry in logs if entry["event"] == "run done"]
    assert ran == [(1, "sync"), (1, "runahead"), (2, "runahead"), (2, "sync")]
    assert [row["policy"] for row in rows] == ["sync", "runahead", "sync", "runahead"]
    assert ratios == [rows[i + 1]["tokens_per_s"] / rows[i]["tokens_per_s"] for i in (0, 2)]
    assert len({row["token_digest"] for row in rows}) == 1
