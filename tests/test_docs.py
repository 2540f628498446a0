"""Every code block in README.md and docs/ runs as printed (long commands in a short form).

Blocks are fenced with a language: ``sh`` and ``python`` blocks run here, ``text`` blocks are output
or diagrams. Shell lines run in document order, each file in a fresh folder (relative paths such
as ``--out results/`` land there) with the model cache in a temporary folder:

* ``runahead ...`` runs in this process through :func:`runahead.cli.main` (exit status 0 expected),
  shortened: ``--steps`` 2, ``--warmup-steps`` 1, ``--tokens`` 2, ``--max-tokens`` at most 8, one
  ``--concurrency`` (at most 4) and one ``--cache-fraction``, ``medium`` -> ``small``, ``demo`` with
  one repeat, torch benches with two policies (and ``max_tokens`` at most 8 in python blocks);
  ``runahead serve`` starts a real server in a subprocess on a free port (the python blocks after it
  talk to that port) that stops when the file is done;
* ``bench paper`` and the ``bench/*.sh`` scripts (minutes to hours) are parsed, not run: their
  ``runahead`` lines must be accepted by the parser (``tests/test_paper.py`` runs the paper's
  figures in their tiny form);
* install lines (``python3 -m venv``, ``pip install``) are checked, not run: the extras they name
  must exist; ``python -m pytest`` is this suite itself;
* ``docker`` lines are checked, not run (no Docker engine here): ``docker build`` names a Dockerfile
  of ``docker/`` and only build arguments it declares, ``docker run`` an image built above in the same
  file and ``runahead serve`` options after it, ``docker compose`` a compose file with that profile.
  Leading ``NAME=value`` environment assignments are dropped.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runahead.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHORT = {"--steps": 2, "--warmup-steps": 1, "--tokens": 2, "--max-tokens": 8, "--repeats": 1}
SERVER_START_S = 180.0


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    text: str


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [
        Block(path, text[: m.start()].count("\n") + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)
    ]


def shell_lines(text: str) -> Iterator[str]:
    """Commands of a shell block: continuations joined, comments dropped."""
    for line in text.replace("\\\n", " ").splitlines():
        command = line.split(" #")[0].strip()
        if command and not command.startswith("#"):
            yield command


def shorten(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        value = out[i + 1]
        if arg in SHORT:
            out[i + 1] = str(min(int(value), SHORT[arg]))
        elif arg == "--concurrency":
            out[i + 1] = str(min(int(value.split(",")[0]), 4))
        elif arg == "--cache-fraction":
            out[i + 1] = value.split(",")[0]
        elif arg == "--model" and value == "medium":
            out[i + 1] = "small"
    if out[:1] == ["demo"]:
        out += ["--concurrency", "2", "--tokens", "2", "--repeats", "1"]
    if out[:1] == ["bench"] and "torch" in out:  # each point loads the model: two policies, not four
        policies = (
            out[out.index("--policy") + 1].split(",")[:2] if "--policy" in out else ["sync", "runahead"]
        )
        out += ["--policy", ",".join(policies)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DocRunner:
    """Runs one file's blocks in order; owns the servers it started."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.servers: list[subprocess.Popen[bytes]] = []
        self.images: set[str] = set()  # tags of the docker images built so far

    def python(self, block: Block) -> None:
        source = block.text.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        source = re.sub(r"max_tokens=(\d+)", lambda m: f"max_tokens={min(int(m.group(1)), 8)}", source)
        code = compile(source, f"{block.path.name}:{block.line}", "exec")
        exec(code, {"__name__": "__main__"})

    def shell(self, block: Block) -> None:
        for line in shell_lines(block.text):
            for part in line.split("&&"):
                self.command(shlex.split(part), block)

    def command(self, argv: list[str], block: Block) -> None:
        where = f"{block.path.name}:{block.line}: {shlex.join(argv)}"
        while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
            argv = argv[1:]
        program = argv[0].removeprefix(".venv/bin/")
        if argv[:3] == ["python3", "-m", "venv"] or argv[1:3] == ["-m", "pytest"]:
            return
        if program == "pip":
            check_install(argv, where)
        elif program == "runahead":
            self.runahead(argv[1:], where)
        elif program == "docker":
            check_docker(argv[1:], where, self.images)
        elif program == "bash" and argv[1].startswith("bench/"):
            check_script(REPO / argv[1], where)
        elif program == "python" and argv[1].startswith("bench/"):
            args = [
                arg for pattern in argv[1:] for arg in sorted(glob.glob(pattern, root_dir=REPO)) or [pattern]
            ]
            done = subprocess.run(
                [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"{where}\n{done.stderr[-2000:]}"
        else:
            pytest.fail(f"{where}: no rule to run this command; add one to tests/test_docs.py")

    def runahead(self, argv: list[str], where: str) -> None:
        if argv[:2] == ["bench", "paper"]:
            build_parser().parse_args(argv)
            return
        argv = shorten(argv)
        if argv[:1] == ["serve"]:
            self.serve(argv, where)
            return
        try:
            status = main(argv)
        except SystemExit as exit:
            status = exit.code  # type: ignore[assignment]
        assert status == 0, where

    def serve(self, argv: list[str], where: str) -> None:
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(self.port)
        else:
            argv += ["--port", str(self.port)]
        server = subprocess.Popen([sys.executable, "-m", "runahead", *argv], stderr=subprocess.DEVNULL)
        self.servers.append(server)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            assert server.poll() is None, f"{where}: the server exited with {server.returncode}"
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).close()
                return
            time.sleep(0.2)
        pytest.fail(f"{where}: the server did not answer /health in {SERVER_START_S:.0f} s")

    def close(self) -> None:
        for server in self.servers:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def check_install(argv: list[str], where: str) -> None:
    """The extras a ``pip install -e '.[...]'`` line names exist in pyproject.toml."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for arg in argv:
        match = re.fullmatch(r"\.\[([\w,]+)\]", arg)
        if match:
            missing = set(match.group(1).split(",")) - set(extras)
            assert not missing, f"{where}: no extra {sorted(missing)} in pyproject.toml"


DOCKER_RUN_VALUES = {"-p", "-v", "-e", "--gpus", "--runtime", "--name", "--ulimit", "--tmpfs"}


def check_docker(argv: list[str], where: str, images: set[str]) -> None:
    """A docker line that can be checked without an engine (see the module docstring)."""
    if argv[0] == "build":
        dockerfile = REPO / argv[argv.index("-f") + 1]
        assert dockerfile.parent == REPO / "docker" and dockerfile.exists(), where
        declared = set(re.findall(r"^ARG (\w+)", dockerfile.read_text(), re.M))
        for i, arg in enumerate(argv[:-1]):
            if arg == "--build-arg":
                assert argv[i + 1].split("=")[0] in declared, f"{where}: {dockerfile.name} has no such ARG"
        images.add(argv[argv.index("-t") + 1])
    elif argv[0] == "run":
        i = 1
        while argv[i].startswith("-"):
            i += 2 if argv[i] in DOCKER_RUN_VALUES else 1
        assert argv[i] in images, f"{where}: image {argv[i]} is not built above"
        build_parser().parse_args(["serve", "/model", *argv[i + 1 :]])
    elif argv[0] == "compose":
        import yaml

        compose = yaml.safe_load((REPO / argv[argv.index("-f") + 1]).read_text())
        profile = argv[argv.index("--profile") + 1]
        assert any(profile in s.get("profiles", []) for s in compose["services"].values()), where
    else:
        pytest.fail(f"{where}: no rule to check this docker command; add one to tests/test_docs.py")


def check_script(script: Path, where: str) -> None:
    """A bench script is valid bash and each of its ``runahead`` lines parses, with every
    ``${NAME:-default}`` read as its default."""
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, where
    for line in shell_lines(script.read_text()):
        if line.startswith("runahead "):
            build_parser().parse_args(shlex.split(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", line))[1:])


def test_every_code_block_names_its_language() -> None:
    unnamed = [
        f"{b.path.name}:{b.line}" for path in DOCS for b in blocks(path) if b.language not in LANGUAGES
    ]
    assert not unnamed, f"fence these blocks as sh, python or text: {unnamed}"


LANGUAGES = ("sh", "python", "text")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One model cache for every file (the small model is built once), in a temporary folder."""
    folder = tmp_path_factory.mktemp("cache")
    before = os.environ.get("RUNAHEAD_CACHE")
    os.environ["RUNAHEAD_CACHE"] = str(folder)
    yield folder
    if before is None:
        del os.environ["RUNAHEAD_CACHE"]
    else:
        os.environ["RUNAHEAD_CACHE"] = before


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_code_blocks_run_as_printed(
    path: Path, model_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runner = DocRunner(free_port())
    try:
        for block in blocks(path):
            if block.language == "sh":
                runner.shell(block)
            elif block.language == "python":
                runner.python(block)
    finally:
        runner.close()
