"""Skip tests marked ``cuda`` where no NVIDIA GPU is at hand (``bench/cuda-check.sh`` runs them on one),
and share the cores among pytest-xdist's workers (``pytest -n auto``, the README's command)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker's compute threads (torch's, OpenMP's, in this process and in the
    subprocesses tests start) get an equal share of the cores: two workers each running two threads
    on two cores would spend their time waiting for each other's spinning threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    threads = str(max(1, (os.cpu_count() or 1) // int(workers)))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if "cuda" in item.keywords]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA); bench/cuda-check.sh runs these on one")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _auto_dtype_is_float32(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests judge against transformers in float32, so ``auto`` means float32 in them (on CPU it
    would otherwise time float32 against bfloat16 and may pick either, for a bf16 checkpoint's experts
    on the kernel too); test_dtypes.py measures."""
    if request.node.get_closest_marker("measured_dtype") is not None:
        return
    try:
        import torch

        from runahead.backends import dtypes
    except ImportError:
        return
    monkeypatch.setattr(dtypes, "fastest_cpu_dtype", lambda hidden, inter: torch.float32)
    monkeypatch.setattr(dtypes, "faster_expert_rows", lambda hidden, inter: torch.float32)
