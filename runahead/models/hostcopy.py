"""Small host values (token ids, positions, routing pairs) copied to the device without a wait.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory, and CUDA makes that copy
synchronous: the host waits for every kernel queued before it. Inside a group's compute that would
stall the launch queue once per call. Through pinned memory the copy is queued on the stream like a
kernel; torch's pinned-memory allocator keeps the buffer until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def int_tensor(
    values: Sequence[int], device: torch.device | str, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """``values`` as an integer tensor (``dtype``, long unless told) on ``device``; on CUDA by a
    non-blocking copy from pinned memory."""
    tensor = torch.tensor(values, dtype=dtype)
    target = torch.device(device)
    if target.type == "cuda":
        return tensor.pin_memory().to(target, non_blocking=True)
    return tensor if target.type == "cpu" else tensor.to(target)
