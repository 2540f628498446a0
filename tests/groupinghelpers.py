"""Shared helpers of the hold rule's tests: jobs, a shared-plus-per-job cost, a cache view by id."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from runahead.jobs import ExpertId, ExpertKey, Job, expert_id, expert_key


def job(request: int, layer: int, experts: tuple[int, ...] = (), epoch: int = 0) -> Job:
    return Job(request, 0, layer, experts, lane=request, epoch=epoch)


def shared_plus_per_job(shared: float, per_job: float):  # type: ignore[no-untyped-def]
    return lambda jobs: shared + per_job * len(jobs)


@dataclass(frozen=True)
class Resident:
    """Every expert but the ``missing`` ones, by id (as the cache's ``resident_ids`` answers)."""

    missing: Set[ExpertKey]

    def __contains__(self, expert: object) -> bool:
        return expert_key(expert) not in self.missing  # type: ignore[arg-type]


def states(
    pending: Set[ExpertKey] = frozenset(), wanted: Set[ExpertKey] = frozenset()
) -> tuple[Resident, set[ExpertId]]:
    """A cache view by expert id (the cache's ``resident_ids`` and ``pending_ids``): keys listed under
    ``pending``/``wanted`` are in that state, others resident."""
    return Resident(pending | wanted), {expert_id(key) for key in pending}
