"""Skip tests marked ``cuda`` where no NVIDIA GPU is at hand (``bench/cuda-check.sh`` runs them on one)."""

from __future__ import annotations

import pytest


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
    would otherwise time float32 against bfloat16 and may pick either); test_dtypes.py measures."""
    if request.node.get_closest_marker("measured_dtype") is not None:
        return
    try:
        import torch

        from runahead.backends import dtypes
    except ImportError:
        return
    monkeypatch.setattr(dtypes, "fastest_cpu_dtype", lambda hidden, inter: torch.float32)
