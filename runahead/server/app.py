"""The Starlette app: OpenAI routes over one open :class:`Engine`, health, metrics, errors.

A streamed answer is an async generator closed whatever ends it (its last event, an error, the
client disconnecting); a whole answer races the client's disconnect and is cancelled if it loses.
Either way the engine's ``generate`` iterator is closed, which cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from runahead.engine import EngineOverloaded
from runahead.server import protocol
from runahead.server.access import APIKeyCheck, read_body
from runahead.server.config import ServerConfig
from runahead.server.errors import APIError
from runahead.server.generation import Tally, collect_all, sse_events
from runahead.server.logs import CLIENT_CLOSED, AccessLog
from runahead.server.metrics import CONTENT_TYPE, ServerMetrics
from runahead.server.openapi import openapi_document
from runahead.server.responses import Health, ModelCard, ModelList
from runahead.server.shapes import ChatShape, CompletionShape, ResponseShape

if TYPE_CHECKING:
    from runahead.engine import Engine, Generation

T = TypeVar("T")
Parser = Callable[[Mapping[str, Any], "Engine", frozenset[int]], protocol.GenerationRequest]

log = structlog.get_logger("runahead.server")


class EventStream(StreamingResponse):
    """A server-sent event stream that closes its generator (and cancels the generations it
    reads) however the response ends."""

    def __init__(self, events: AsyncIterator[str], generations: Sequence[Generation]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette cancels the sending task on a disconnect, which may leave the generator
        # suspended at a yield: close it here so the engine's request is cancelled now, not at GC.
        try:
            await super().__call__(scope, receive, send)
        finally:
            await cast(AsyncGenerator[str, None], self.body_iterator).aclose()
            cancel_all(self.generations)  # those the generator never started


class OpenAIRoutes:
    """The request handlers, bound to one engine and the one model name it serves."""

    def __init__(self, engine: Engine, model_name: str, config: ServerConfig) -> None:
        self.engine = engine
        self.model_name = model_name
        self.config = config
        eos = getattr(engine.tokenizer, "eos_token_id", None)
        self.eos = frozenset([eos] if isinstance(eos, int) else [])

    async def health(self, request: Request) -> Response:
        """200 while the engine serves (``ok`` or ``degraded``), 503 once it has stopped."""
        report = Health.model_validate(self.engine.health())
        return JSONResponse(report.dump(), status_code=503 if report.status == "failed" else 200)

    async def models(self, request: Request) -> Response:
        model = ModelCard(id=self.model_name, object="model", created=0, owned_by="runahead")
        return JSONResponse(ModelList(object="list", data=[model]).dump())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, protocol.completion_request, CompletionShape)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, protocol.chat_request, ChatShape)

    async def _generate(self, request: Request, parse: Parser, kind: type[ResponseShape]) -> Response:
        data = protocol.parse_body(await read_body(request, self.config.max_body_bytes))
        protocol.check_model(data, self.model_name)
        job = parse(data, self.engine, self.eos)
        shape = kind(self.model_name, logprobs=job.logprobs is not None)
        tally = Tally(prompt_tokens=job.prompt_tokens)
        request.state.tally = tally
        generations = self._submit(job)
        timeout = self.config.request_timeout_s
        if job.stream:
            events = sse_events(self.engine, job, generations, shape, tally, timeout)
            return EventStream(events, generations)
        try:
            done = await until_disconnected(
                request, collect_all(self.engine, job, generations, tally, timeout)
            )
        except RuntimeError as error:  # a failed read or compute (500), or a closed or failed engine (503)
            status = 500 if self.engine.running else 503
            raise APIError(str(error), status=status, kind="server_error") from None
        finally:
            cancel_all(generations)
        if done is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(shape.response(done, tally))

    def _submit(self, job: protocol.GenerationRequest) -> list[Generation]:
        """Queue every answer of ``job`` in the engine now, or none: 429 when they do not all fit."""
        engine, wanted = self.engine, len(job.choices)
        if wanted > engine.capacity:
            raise APIError(
                f"{wanted} answers asked, but this server holds at most {engine.capacity} requests at once",
                param="n",
            )
        if engine.room() < wanted:
            raise self._overloaded(
                f"the server is busy: {wanted} answer(s) asked, room for {engine.room()} "
                f"(it holds {engine.capacity} requests at most, running and waiting); retry later"
            )
        generations: list[Generation] = []
        try:
            for choice in job.choices:
                generations.append(engine.submit(choice.prompt_ids, choice.params))
        except EngineOverloaded as error:
            cancel_all(generations)
            raise self._overloaded(str(error)) from None
        except ValueError as error:  # the engine's own checks, should ours miss one
            cancel_all(generations)
            raise APIError(str(error)) from None
        except RuntimeError as error:  # a closed or failed engine
            cancel_all(generations)
            raise APIError(str(error), status=503, kind="server_error") from None
        return generations

    def _overloaded(self, message: str) -> APIError:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        return APIError(message, status=429, kind="server_error", code="overloaded", headers=retry)


def cancel_all(generations: Sequence[Generation]) -> None:
    """Cancel generations that may still run (no-op for those that ended)."""
    for generation in generations:
        generation.cancel()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, but cancel it and return None if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op once done
        await asyncio.gather(task, watcher, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    """Return once the client has gone (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error(request: Request, error: Exception) -> Response:
    return cast(APIError, error).response()


async def _http_error(request: Request, error: Exception) -> Response:
    http = cast(HTTPException, error)
    message = f"{http.detail}: {request.method} {request.url.path}"
    return APIError(message, status=http.status_code, code=str(http.status_code)).response()


async def _server_error(request: Request, error: Exception) -> Response:
    log.error("unhandled error", path=request.url.path, error=repr(error))
    return APIError(f"internal error: {error!r}", status=500, kind="server_error").response()


def create_app(
    engine: Engine, model_name: str, *, close_engine: bool = False, config: ServerConfig | None = None
) -> Starlette:
    """The ASGI app serving ``engine`` as ``model_name``; ``close_engine`` closes it on shutdown;
    ``config`` says what the server enforces (API key, body size, time limit)."""
    config = config or ServerConfig()
    api = OpenAIRoutes(engine, model_name, config)
    metrics = ServerMetrics(engine)
    document = openapi_document(model_name, api_key=config.api_key is not None)

    async def metrics_text(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_engine:
                await engine.close()
                log.info("engine closed")

    middleware = [Middleware(AccessLog, metrics=metrics, endpoints=[r.path for r in routes])]
    if config.api_key is not None:
        middleware.append(Middleware(APIKeyCheck, api_key=config.api_key))
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
