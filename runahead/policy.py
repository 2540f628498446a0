"""Scheduling policies by name: the paper's system, its ablations and the baselines.

A policy spec is a name with optional knobs: ``NAME[/knob=value...]``, for example
``runahead/compute=fifo/fetch=global-srtf``, ``runahead/grouping=static:2:2:2`` or
``runahead/grouping=opportunistic`` (the paper's grouping, by name).

| name | grouping | prefetch | stands for |
| --- | --- | --- | --- |
| ``runahead`` | adaptive (bottleneck-aware) | none | Bevy, grouping beyond the paper (docs/results-core.md) |
| ``runahead/grouping=bottleneck`` | bottleneck-aware | none | the same, never batching by measurement |
| ``runahead/grouping=opportunistic`` | opportunistic | none | the paper's system as published |
| ``runahead+prefetch`` | adaptive (bottleneck-aware) | speculative gate | the paper's combination study |
| ``sync`` | one static group of all requests | none | llama.cpp with an expert cache |
| ``prefetch-gate`` | as sync | speculative gate | SpecMD / Mixtral-offloading |
| ``prefetch-history`` | as sync | request history | FineMoE |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TypeVar

from runahead.scheduling import ComputeOrder, FetchOrder, Grouping

E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """How the three actors schedule: group choice, fetch order, prefetching."""

    name: str
    grouping: Grouping
    compute_order: ComputeOrder
    fetch_order: FetchOrder
    prefetch: str | None = None  # predictor name: "gate" or "history"

    @property
    def spec(self) -> str:
        """The canonical spec string, which :func:`parse_policy` turns back into this config."""
        base = BASE_POLICIES[self.name]
        knobs = []
        if self.compute_order is not base.compute_order:
            knobs.append(f"compute={self.compute_order.value}")
        if self.fetch_order is not base.fetch_order:
            knobs.append(f"fetch={self.fetch_order.value}")
        if self.grouping != base.grouping:
            knobs.append(f"grouping={self.grouping}")
        return "/".join([self.name, *knobs])


def _runahead(name: str, grouping: Grouping, prefetch: str | None = None) -> PolicyConfig:
    return PolicyConfig(name, grouping, ComputeOrder.LOWEST_LAYER, FetchOrder.LOWEST_LAYER_SRTF, prefetch)


def _sync(name: str, prefetch: str | None = None) -> PolicyConfig:
    return PolicyConfig(name, Grouping(static=True), ComputeOrder.LOWEST_LAYER, FetchOrder.FIFO, prefetch)


BASE_POLICIES: dict[str, PolicyConfig] = {
    "runahead": _runahead("runahead", Grouping(bottleneck=True, adaptive=True)),
    "runahead+prefetch": _runahead(
        "runahead+prefetch", Grouping(bottleneck=True, adaptive=True), prefetch="gate"
    ),
    "sync": _sync("sync"),
    "prefetch-gate": _sync("prefetch-gate", prefetch="gate"),
    "prefetch-history": _sync("prefetch-history", prefetch="history"),
}


def parse_policy(spec: str) -> PolicyConfig:
    """Turn ``NAME[/knob=value...]`` into a :class:`PolicyConfig`, naming any bad part."""
    name, *knobs = spec.strip().split("/")
    if name not in BASE_POLICIES:
        raise ValueError(f"unknown policy {name!r} in {spec!r}; choose one of {', '.join(BASE_POLICIES)}")
    config = BASE_POLICIES[name]
    for knob in knobs:
        key, sep, value = knob.partition("=")
        if not sep:
            raise ValueError(f"policy {spec!r}: knob {knob!r} is not of the form key=value")
        try:
            if key == "compute":
                config = replace(config, compute_order=_choice(ComputeOrder, value))
            elif key == "fetch":
                config = replace(config, fetch_order=_choice(FetchOrder, value))
            elif key == "grouping":
                config = replace(config, grouping=Grouping.parse(value))
            else:
                raise ValueError(f"unknown knob {key!r}; knobs are compute, fetch, grouping")
        except ValueError as error:
            raise ValueError(f"policy {spec!r}: {error}") from None
    return config


def _choice(kind: type[E], value: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{value!r} is not one of {', '.join(str(m.value) for m in kind)}") from None


def check_concurrency(spec: str, concurrency: int) -> None:
    """Refuse a static grouping whose groups do not tile ``concurrency`` request lanes.

    ``static:2:2:2`` holds 6 lanes; at concurrency 4 its last group could never fill, so the run would
    measure something other than what the spec says. Called when a bench point is built.
    """
    sizes = parse_policy(spec).grouping.sizes
    if sizes is not None and concurrency % sum(sizes):
        raise ValueError(
            f"policy {spec!r}: its static groups hold {sum(sizes)} requests, which does not divide "
            f"concurrency {concurrency}"
        )
