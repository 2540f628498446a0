"""A group's routed ``(row, k)`` pairs sorted by expert: how the grouped expert product lays out its rows.

Built from routing read back to the host (the torch backend keeps each job's routing there), or
from the gate's ``ids`` tensor; :meth:`runahead.models.base.MoEModel.moe_partial` takes it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from runahead.models.hostcopy import int_tensor


@dataclass(frozen=True, slots=True)
class ExpertRows:
    """A group's routed ``(row, k)`` pairs sorted by expert: the layout of the grouped expert product.

    ``rows[i]`` / ``kpos[i]``: pair ``i``'s row in the batch and its position among the row's k
    choices; ``spans``: ``(expert, start, stop)`` runs of pairs, ascending by expert, each run in
    ascending row order (the order ``torch.where(ids == expert)`` gives).
    """

    rows: Tensor
    kpos: Tensor
    spans: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_host(
        cls, routing: Sequence[Sequence[int]], experts: Collection[int], device: torch.device | str = "cpu"
    ) -> ExpertRows:
        """From routing read back to the host (one list of expert ids per row), keeping only the pairs
        that route to ``experts``; one copy to ``device``."""
        wanted = set(experts)
        pairs = sorted((e, r, k) for r, row in enumerate(routing) for k, e in enumerate(row) if e in wanted)
        spans: list[tuple[int, int, int]] = []
        for i, (e, _, _) in enumerate(pairs):
            if spans and spans[-1][0] == e:
                spans[-1] = (e, spans[-1][1], i + 1)
            else:
                spans.append((e, i, i + 1))
        flat = int_tensor([r for _, r, _ in pairs] + [k for _, _, k in pairs], device)
        return cls(flat[: len(pairs)], flat[len(pairs) :], tuple(spans))

    @classmethod
    def from_ids(cls, ids: Tensor, experts: Collection[int]) -> ExpertRows:
        """From ``ids [T, k]`` (read on the host: a device sync on CUDA); entries of -1 route nowhere."""
        return cls.from_host(ids.tolist(), experts, ids.device)
