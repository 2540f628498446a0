"""Who may call, and how much they may send: the API key check and the request body limit."""

from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from runahead.server.errors import APIError
from runahead.server.openapi import OPEN_PATHS


class APIKeyCheck:
    """ASGI middleware: a request without ``Authorization: Bearer <key>`` gets a 401 (as OpenAI's).

    ``/health`` and ``/openapi.json`` stay open, so a supervisor and a client generator need no key.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = (
            "you must provide an API key: 'Authorization: Bearer <key>'"
            if given is None
            else "the API key provided is not valid"
        )
        error = APIError(message, status=401, code="invalid_api_key")
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(size, limit, at_least=True)
        parts.append(part)
    return b"".join(parts)


def _too_large(size: int, limit: int, *, at_least: bool = False) -> APIError:
    amount = f"at least {size}" if at_least else f"{size}"
    return APIError(
        f"the request body has {amount} bytes; this server takes at most {limit}",
        status=413,
        code="request_too_large",
    )
