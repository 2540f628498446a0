"""Large host tensors in transparent huge pages: the expert cache's slots and the host store's image.

The CPU kernel streams a group's expert weights from the slots at memory speed, and the readers copy
whole experts into them: 3 MB an expert on the medium model, 768 pages of 4 KB. Where Linux offers
transparent huge pages only on request (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``madvise``, the usual default), ``torch.empty`` gets 4 KB pages, and every TLB miss on them costs a
page walk (a two-level one under virtualization). Here the memory is an anonymous mapping aligned to
2 MB and advised ``MADV_HUGEPAGE`` before its first touch, so the kernel backs it with 2 MB pages
where it can. Measured on the 2-vCPU AMX Xeon VM (docs/results-torch.md, "Slots in huge pages"): the
kernel's product over cold experts +3-5%, runs whose compute bounds the step +1-3% tokens/s, and a
cold cache's first fills fault 512 times fewer pages. Elsewhere (macOS, THP off, a mapping the OS
refuses) it is ``torch.empty``.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
"""The huge page size the mapping is aligned to (x86-64 and arm64 with 4 KB base pages)."""


def huge_page_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, in memory advised for
    transparent huge pages where the OS takes the advice (:func:`huge_pages_offered`), else
    ``torch.empty``'s. The tensor keeps its mapping alive; the memory returns to the OS with it."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not huge_pages_offered():
        return torch.empty(shape, dtype=dtype)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError, AttributeError):  # no memory for the mapping, or the advice refused
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
    start = (-raw.data_ptr()) % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def huge_pages_offered() -> bool:
    """Whether this OS backs an anonymous mapping advised ``MADV_HUGEPAGE`` with huge pages: Linux
    with transparent huge pages ``always`` or ``madvise`` (not ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False
