"""OpenAI-style errors: one exception type, rendered as ``{"error": {...}}`` with its status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses, with the status and the OpenAI error fields to send back."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` about ``param``."""
    return APIError(message, param=param, code=code)
