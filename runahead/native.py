"""Small C libraries compiled with the system's compiler on first use and loaded with :mod:`ctypes`.

The one seam for every C source in the package (the expert product kernel,
:mod:`runahead.models.qkernel`; the reader threads, :mod:`runahead.store.native`): each build is
cached under ``$RUNAHEAD_CACHE/kernels`` (default ``~/.cache/runahead``), named by its source's
stem and a digest of the source, the compiler and the flags, so a changed source or flag builds anew
and concurrent processes agree on the file. ``RUNAHEAD_CC`` names the compiler (default ``cc``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def build(source: Path, flags: Sequence[str]) -> Path:
    """The shared library compiled from ``source`` with ``flags``, built once per cache directory.

    Raises ``OSError`` or :class:`subprocess.SubprocessError` (the compiler's stderr in ``stderr``)
    where it cannot be built: callers fall back to their Python path and say why.
    """
    compiler = os.environ.get("RUNAHEAD_CC", "cc")
    text = source.read_bytes()
    digest = hashlib.sha256(text + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("RUNAHEAD_CACHE", Path.home() / ".cache" / "runahead")) / "kernels"
    target = cache / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, str(source), "-o", str(built)]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(built, target)  # atomic: a concurrent build of the same source writes the same file
    return target


def cpu_lacks(wanted: set[str]) -> str | None:
    """Why a build needing the CPU features ``wanted`` (``/proc/cpuinfo`` flags) cannot run here, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"CPU {platform.machine()} is not x86-64"
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo for the CPU's features"
    lines = (line.split(":", 1)[1] for line in info.splitlines() if line.startswith("flags"))
    flags = set(next(lines, "").split())
    missing = wanted - flags
    return f"the CPU lacks {', '.join(sorted(missing))}" if missing else None
