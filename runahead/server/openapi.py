"""The OpenAPI 3.1 document of the server, built from the pydantic models (``GET /openapi.json``).

The document describes the server as it runs: ``model`` can only be the served model's name, and
when an API key is set every operation but ``/health`` and ``/openapi.json`` asks for it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from runahead.server import responses
from runahead.server.schema import ChatRequest, CompletionRequest

REF = "#/components/schemas/{model}"
_REQUESTS: list[type[BaseModel]] = [CompletionRequest, ChatRequest]
_RESPONSES: list[type[BaseModel]] = [
    responses.Completion,
    responses.ChatCompletion,
    responses.ChatCompletionChunk,
    responses.ErrorResponse,
    responses.ModelList,
    responses.Health,
]
OPEN_PATHS = frozenset({"/health", "/openapi.json"})
"""Paths that answer without the API key."""

_ERRORS = {
    "400": "The request is malformed; the error names the field.",
    "401": "The API key is missing or wrong.",
    "404": "No such model.",
    "413": "The request body is larger than the server takes.",
    "429": "Too many requests are waiting; retry after `Retry-After` seconds.",
    "500": "A failed expert read or compute ended this request (the engine goes on).",
    "503": "The engine is stopped or failed.",
    "504": "The request ran past the server's time limit.",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _errors(*codes: str) -> dict[str, Any]:
    error = responses.ErrorResponse
    return {code: _json(error, _ERRORS[code]) for code in codes}


def _event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """Each server-sent event: ``data`` holds a chunk, an error, or ``[DONE]`` at the end."""
    payload = {"anyOf": [_ref(chunk), _ref(responses.ErrorResponse)]}
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    data = {"anyOf": [{"const": "[DONE]"}, json_data]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _generation(
    request: type[BaseModel], answer: type[BaseModel], chunk: type[BaseModel], summary: str
) -> dict[str, Any]:
    ok = _json(
        answer,
        f"The whole answer, or with `stream` server-sent events each holding a `{chunk.__name__}` "
        "(or an error), ending in `data: [DONE]`.",
    )
    ok["content"]["text/event-stream"] = {"schema": _event_stream(chunk)}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": ok, **_errors("400", "401", "404", "413", "429", "500", "503", "504")},
        }
    }


def openapi_document(model_name: str, *, api_key: bool = False) -> dict[str, Any]:
    """The OpenAPI document of a server serving ``model_name`` (with ``api_key``: Bearer auth)."""
    pairs: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in _REQUESTS]
    pairs += [(m, "serialization") for m in _RESPONSES]
    _, defs = models_json_schema(pairs, ref_template=REF)
    schemas = defs.get("$defs", {})
    for name in ("CompletionRequest", "ChatRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}
    paths = {
        "/health": {
            "get": {
                "summary": "Health: ok, degraded (with the reason) or failed",
                "responses": {
                    "200": _json(responses.Health, "Serving (ok or degraded)."),
                    "503": _json(responses.Health, "The engine stopped."),
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The served model",
                "responses": {"200": _json(responses.ModelList, "One model."), **_errors("401")},
            }
        },
        "/v1/completions": _generation(
            CompletionRequest, responses.Completion, responses.Completion, "Complete a prompt"
        ),
        "/v1/chat/completions": _generation(
            ChatRequest, responses.ChatCompletion, responses.ChatCompletionChunk, "Answer a conversation"
        ),
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {"200": {"description": "Prometheus text format.", **text}, **_errors("401")},
            }
        },
    }
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "runahead", "version": "1", "description": "An OpenAI-compatible API."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in paths.items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
    return document
