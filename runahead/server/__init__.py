"""An OpenAI-compatible HTTP server over the :class:`~runahead.engine.Engine` (Starlette + uvicorn).

::

    asyncio.run(serve("path/to/model", port=8000, device="cuda", cache_fraction=0.3))

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream``), ``GET /metrics`` (Prometheus text), ``GET /openapi.json``. The server
imports the engine; the
engine never imports the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from runahead.server.app import create_app
from runahead.server.config import ServerConfig
from runahead.server.logs import configure_logging

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp

__all__ = ["EngineStopped", "ServerConfig", "build_server", "configure_logging", "create_app", "serve"]

log = structlog.get_logger("runahead.server")

GRACEFUL_SHUTDOWN_S = 10
"""How long a shutdown waits for open answers before cancelling them."""


def build_server(
    app: ASGIApp, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> uvicorn.Server:
    """A uvicorn server for ``app``; logs go through :func:`configure_logging`'s handlers."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,
        access_log=False,  # the app logs one line per request itself
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return uvicorn.Server(config)


class EngineStopped(RuntimeError):
    """The engine stopped by itself (an error it could not isolate): the server shut down."""


async def serve(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    log_json: bool = False,
    log_level: str = "info",
    config: ServerConfig | None = None,
    **engine_options: Any,
) -> None:
    """Open the model, serve it until uvicorn is told to stop (SIGINT/SIGTERM), then close it.

    ``model_name`` (default: the folder's name) is what clients pass as ``model``;
    ``config`` says what the server enforces (API key, body size, time limit);
    ``engine_options`` go to :meth:`Engine.open` (``device``, ``cache_fraction``, ``policy``, ...).
    Should the engine stop by itself, the server shuts down and :class:`EngineStopped` says why
    (``runahead serve`` then exits non-zero, so a supervisor can restart it).
    """
    import asyncio

    from runahead.engine import Engine

    configure_logging(json=log_json, level=log_level)
    engine = await Engine.open(model_path, **engine_options)
    watcher: asyncio.Task[None] | None = None
    try:
        name = model_name or Path(model_path).resolve().name
        app = create_app(engine, name, close_engine=True, config=config)
        server = build_server(app, host=host, port=port, log_level=log_level)

        async def stop_if_the_engine_fails() -> None:
            failure = await engine.wait_stopped()
            if failure is not None:
                log.error("engine stopped; shutting down", reason=repr(failure))
                server.should_exit = True

        watcher = asyncio.create_task(stop_if_the_engine_fails())
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
        await engine.close()  # no-op when the app's shutdown closed it
    if engine.failure is not None:
        raise EngineStopped(f"the engine stopped: {engine.failure!r}") from engine.failure
