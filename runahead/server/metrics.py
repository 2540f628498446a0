"""Prometheus metrics: the server's own counters plus the engine's ``stats()``, read at each scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from runahead.engine import Engine
    from runahead.server.generation import Tally

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ENGINE_HELP = {
    "requests_active": "Requests running in the engine",
    "tokens_generated": "Tokens the engine generated",
    "cache_hits": "Expert cache hits",
    "cache_misses": "Expert cache misses",
    "cache_fetches": "Experts fetched into the cache",
    "cache_evictions": "Experts evicted from the cache",
    "compute_busy_seconds": "Seconds the compute unit was busy",
    "expert_read_seconds": "Seconds of expert reads, summed over reads in flight together",
    "link_busy_seconds": "Seconds the link was busy (some expert read in flight), up to the last read's end",
    "groups_computed": "Backend calls (groups of jobs at one layer) computed",
    "jobs_computed": "Layer jobs computed",
    "cache_slots_pinned": "Expert cache slots pinned by jobs now (0 once the whole model is resident)",
    "reads_failed": "Expert reads given up after their retries",
    "reads_retried": "Expert reads retried after an I/O error",
    "groups_failed": "Groups whose compute failed (their requests failed)",
    "requests_failed": "Requests ended by a failed read or compute",
}


def _is_gauge(name: str) -> bool:
    """Stats that go down as well as up; the rest are running totals."""
    return any(word in name for word in ("active", "queue", "length", "waiting", "running", "pinned"))


class EngineCollector:
    """Exposes every entry of ``engine.stats()`` as ``runahead_engine_<name>``, so new stats appear."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        for name, value in self.engine.stats().items():
            help_text = _ENGINE_HELP.get(name, f"engine.stats()[{name!r}]")
            family = GaugeMetricFamily if _is_gauge(name) else CounterMetricFamily
            yield family(f"runahead_engine_{name}", help_text, value=float(value))


class ServerMetrics:
    """One registry per app (so several apps in one process do not clash)."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "runahead_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.active = Gauge(
            "runahead_http_requests_active", "HTTP requests in flight", registry=self.registry
        )
        self.duration = Histogram(
            "runahead_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            ["endpoint"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "runahead_prompt_tokens", "Prompt tokens of the requests served", registry=self.registry
        )
        self.completion_tokens = Counter(
            "runahead_completion_tokens", "Tokens generated for the requests served", registry=self.registry
        )
        self.registry.register(EngineCollector(engine))

    def observe(self, endpoint: str, status: int, seconds: float, tally: Tally | None) -> None:
        """Count one finished request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.duration.labels(endpoint=endpoint).observe(seconds)
        if tally is not None:
            self.prompt_tokens.inc(tally.prompt_tokens)
            self.completion_tokens.inc(tally.completion_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
