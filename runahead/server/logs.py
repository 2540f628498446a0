"""Logging (structlog, for ours and uvicorn's lines alike) and the per-request access log."""

from __future__ import annotations

import time
from collections.abc import Collection

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runahead.logs import configure_logging
from runahead.server.generation import Tally
from runahead.server.metrics import ServerMetrics

__all__ = ["AccessLog", "configure_logging"]

log = structlog.get_logger("runahead.server")

CLIENT_CLOSED = 499
"""The status recorded for a request whose client went away before its answer (nginx's code)."""


class AccessLog:
    """ASGI middleware: one log line and one metrics sample per HTTP request, when its answer ends.

    Handlers leave a :class:`Tally` in ``request.state.tally`` so the line carries token counts.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = CLIENT_CLOSED  # unless a response starts

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.active.inc()
        try:
            await self.app(scope, receive, record_status)
        except Exception:
            status = 500
            raise
        finally:
            self.metrics.active.dec()
            self._record(scope, status, time.perf_counter() - start)

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        tally = scope.get("state", {}).get("tally")
        tally = tally if isinstance(tally, Tally) else None
        self.metrics.observe(endpoint, status, seconds, tally)
        tokens = (
            {} if tally is None else {"prompt_tokens": tally.prompt_tokens, "tokens": tally.completion_tokens}
        )
        log.info(
            "request",
            method=scope["method"],
            path=path,
            status=status,
            duration_ms=round(seconds * 1000, 1),
            **tokens,
        )
