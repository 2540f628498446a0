"""Slots and the host store's image in transparent huge pages (``runahead/store/memory.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runahead.store.base import SlotPool
from runahead.store.memory import HUGE_PAGE, huge_page_tensor, huge_pages_offered


def _thp_eligible(address: int) -> bool | None:
    """The ``THPeligible`` flag of the mapping holding ``address`` (None where smaps does not say)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_a_large_tensor_is_aligned_to_a_huge_page_and_advised_where_the_os_offers_them() -> None:
    t = huge_page_tensor((40, 1 << 16), torch.bfloat16)  # 5 MiB
    assert t.shape == (40, 1 << 16) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.fill_(1.5)
    assert t.sum(dtype=torch.float32).item() == 1.5 * 40 * (1 << 16)  # every element is writable memory
    if not huge_pages_offered():
        pytest.skip("no transparent huge pages on request here")
    assert t.data_ptr() % HUGE_PAGE == 0
    eligible = _thp_eligible(t.data_ptr())
    if eligible is None:
        pytest.skip("/proc/self/smaps does not say")
    assert eligible  # MADV_HUGEPAGE took: the kernel may back it with 2 MB pages


def test_a_small_tensor_stays_torch_s_own() -> None:
    small = huge_page_tensor((3, 5), torch.float32)
    assert small.shape == (3, 5) and small.dtype == torch.float32


def test_the_slot_pool_on_the_cpu_lives_in_it_and_its_slots_are_views() -> None:
    pool = SlotPool(4, 1 << 20, torch.bfloat16)  # 8 MiB
    assert pool.data.shape == (4, 1 << 20)
    pool.slot(2).fill_(2.0)
    assert pool.data[2].eq(2.0).all() and pool.slot(2).data_ptr() == pool.data[2].data_ptr()
    if huge_pages_offered():
        assert pool.data.data_ptr() % HUGE_PAGE == 0
