"""A prefill job's MoE over several waves, summed as if it had run in one.

A job needing more experts than one job may pin runs its MoE in *waves* (:class:`runahead.jobs.Job`),
and which experts go in which wave depends on the cache (the issuer puts resident experts first).
Adding each wave's products into a running sum would then make the last bits of a prompt's hidden
states depend on the schedule. Instead each routed ``(row, k)`` product is kept until the job's last
wave, and the row's sum is taken in ascending expert order, as a job that ran in one wave adds them
(:meth:`runahead.models.base.MoEModel.moe_partial`): the same floating-point adds in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from runahead.models.routing import ExpertRows


class WavedState(Protocol):
    """What a backend keeps per request for its waved jobs."""

    partials: torch.Tensor | None  # [tokens, k, H] the products of the waves so far
    routing: list[list[int]] | None  # the job's experts per row and k, read back to the host


def sums_with_waves(
    y: torch.Tensor | None,
    routing: ExpertRows,
    rows: Sequence[tuple[int, int]],
    hidden: torch.Tensor,
    k: int,
    waved: Sequence[tuple[int, WavedState, bool]],
) -> torch.Tensor:
    """A group's MoE sums ``[T, H]`` from its weighted products ``y`` (``routing``'s order, or None):
    the rows of jobs in one wave added up as :meth:`~runahead.models.base.MoEModel.moe_partial` does,
    each waved job's (``(index, state, last wave?)``, rows ``rows[index]``) products kept in its state
    and, at its last wave, summed with :func:`ascending_sum`. A waved job's rows are zero otherwise."""
    total = torch.zeros_like(hidden)
    if y is not None:
        in_waves = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for i, _, _ in waved:
            in_waves[slice(*rows[i])] = True
        plain = ~in_waves[routing.rows]
        total.index_add_(0, routing.rows[plain], y[plain])
    for i, state, last in waved:
        start, stop = rows[i]
        if y is not None:
            state.partials = keep_products(state.partials, routing, y, start, stop, k)
        if last:
            assert state.partials is not None and state.routing is not None
            total[start:stop] = ascending_sum(state.partials, state.routing)
            state.partials = None
    return total


def keep_products(
    partials: torch.Tensor | None, routing: ExpertRows, y: torch.Tensor, start: int, stop: int, k: int
) -> torch.Tensor:
    """Store the products ``y`` (in ``routing``'s order) of the pairs whose row lies in
    ``[start, stop)`` into ``partials [stop - start, k, H]`` (created, zeros, at the first wave)."""
    if partials is None:
        partials = y.new_zeros(stop - start, k, y.shape[1])
    mine = (routing.rows >= start) & (routing.rows < stop)
    partials[routing.rows[mine] - start, routing.kpos[mine]] = y[mine]
    return partials


def ascending_sum(partials: torch.Tensor, routing: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each row's kept products ``partials [n, k, H]`` added from zero in ascending expert order
    (``routing``: the row's expert per k; entries that route nowhere, ``-1``, add their zeros last)."""
    ids = torch.tensor(routing, dtype=torch.long, device=partials.device)
    order = torch.where(ids < 0, torch.iinfo(torch.long).max, ids).argsort(dim=1, stable=True)
    ranked = partials.gather(1, order.unsqueeze(-1).expand_as(partials))
    total = torch.zeros_like(ranked[:, 0])
    for j in range(ranked.shape[1]):
        total += ranked[:, j]
    return total
