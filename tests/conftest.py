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
