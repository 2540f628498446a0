"""What the HTTP server enforces on its own, apart from the engine: access, body size, time limits."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""8 MiB: a prompt of the longest contexts as JSON token ids fits several times over."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How the server guards itself; checked on construction.

    ``api_key``: when set, every request but ``/health`` and ``/openapi.json`` must carry
    ``Authorization: Bearer <api_key>`` (401 otherwise). ``max_body_bytes``: larger request bodies
    get 413. ``request_timeout_s``: a generation running longer is cancelled (504, or an error
    event on a stream); None: no limit. ``retry_after_s``: the ``Retry-After`` a refused (429)
    request is sent.
    """

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float | None = None
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
