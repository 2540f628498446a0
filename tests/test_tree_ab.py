"""``bench/tree-ab.sh``: one bench command on two trees of the package, rounds alternating, and its
summary (``bench/ab_summary.py --variant``) over the rows it leaves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchhelpers import BENCH, load_bench_script

ROOT = BENCH.parent


def test_two_trees_alternate_and_the_summary_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tmp_path / "before"
    shutil.copytree(ROOT / "runahead", before / "runahead", ignore=shutil.ignore_patterns("__pycache__"))
    with (before / "runahead" / "__init__.py").open("a") as init:  # which tree a run imported, seen below
        init.write('\nimport sys as _sys\n_sys.stderr.write("imported from the before tree\\n")\n')
    out = tmp_path / "rows"
    env = {**os.environ, "RUNAHEAD_CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable}
    args = ["--backend", "torch", "--model", "small", "--store", "host", "--cache-fraction", "0.5"]
    args += ["--steps", "2", "--warmup-steps", "1", "--concurrency", "2", "--policy", "sync,runahead"]
    done = subprocess.run(
        ["bash", str(BENCH / "tree-ab.sh"), str(before), str(out), "host50", "2", *args],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # round 1 runs before then after, round 2 after then before
    assert [line.split()[1:4] for line in done.stdout.splitlines()] == [
        ["1", "before", "done"],
        ["1", "after", "done"],
        ["2", "after", "done"],
        ["2", "before", "done"],
    ]
    for variant in ("before", "after"):
        for r in (1, 2):
            log = (out / f"host50-{variant}-{r}.log").read_text()
            assert ("imported from the before tree" in log) == (variant == "before")
            text = (out / f"host50-{variant}-{r}" / "results.jsonl").read_text()
            rows = [json.loads(line) for line in text.splitlines()]
            assert [row["policy"] for row in rows] == ["sync", "runahead"]
    script = load_bench_script("ab_summary")
    argv = ["summary", str(out), "--variant", "before=old", "--variant", "after=new"]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| host50")]
    assert len(table) == 4  # 2 policies x 2 variants
    assert {line.split(" | ")[2] for line in table} == {"old", "new"}


def test_a_folder_without_the_package_is_refused(tmp_path: Path) -> None:
    command = ["bash", str(BENCH / "tree-ab.sh"), str(tmp_path), str(tmp_path / "rows"), "p", "1"]
    command += ["--backend", "sim"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "holds no runahead package" in done.stderr


def test_the_summary_names_a_point_whose_rounds_computed_in_different_dtypes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--dtype auto`` races in each process: the kept rows of the dtype race's A/B drew bfloat16 in
    one "before" round of the 70% points and float32 everywhere else, which the table alone hides."""
    script = load_bench_script("ab_summary")
    kept = BENCH / "results" / "dtype-race"
    argv = ["summary", str(kept), "--variant", "before=old", "--variant", "after=new"]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 3  # the 70% points at 2, 4 and 8 requests; the resident point drew float32 alone
    assert all(note.startswith("note: zen4-70, ") and "before-2 bfloat16" in note for note in notes)
