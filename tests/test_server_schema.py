"""The server against its own OpenAPI document: schemathesis fuzzes every operation over real HTTP.

Each generated request (valid and invalid by the schema) must get an answer that is not a server
error, whose status is documented and whose body conforms to the documented schema; bodies the
schema forbids must be refused with a 4xx. The model has a 16-token context, so no accepted
request generates for long and the run stays short.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from serverhelpers import RunningServer, build_chat_model, running_server

CONTEXT = 16
EXAMPLES = 15
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = build_chat_model(tmp_path_factory.mktemp("short-model"), max_position_embeddings=CONTEXT)
    with running_server(model, cache_fraction=0.5) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(short_server: RunningServer) -> Any:
    return schemathesis.openapi.from_url(f"{short_server.url}/openapi.json")


def _operations(api_schema: Any) -> dict[str, Any]:
    return {op.ok().label: op.ok() for op in api_schema.get_all_operations()}


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_every_operation_conforms_to_the_schema(api_schema, short_server, mode) -> None:  # type: ignore[no-untyped-def]
    operations = _operations(api_schema)
    assert set(operations) >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"}
    for label, operation in operations.items():
        if mode is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no parameters: nothing can be made invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
        )
        def call(case: Any) -> None:
            case.call_and_validate(base_url=short_server.url, checks=CHECKS)

        try:
            call()
        except Exception as error:
            raise AssertionError(f"{label} ({mode.value}): {error}") from error


def test_the_document_describes_the_served_model(short_server: RunningServer) -> None:
    document = httpx.get(f"{short_server.url}/openapi.json", timeout=10).json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    schemas = document["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == ["tiny"]
    assert schemas["CompletionRequest"]["required"] == ["model", "prompt"]
    assert "temperature" in schemas["ChatRequest"]["properties"]
    assert {"Completion", "ChatCompletion", "ChatCompletionChunk", "ErrorResponse"} <= set(schemas)
