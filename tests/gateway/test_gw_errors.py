"""One mapping from gateway errors to OpenAI-shaped HTTP answers."""

from __future__ import annotations

import json

import pytest

from gateway.errors import (
    BodyTooLargeError,
    ContextTooLongError,
    ExceedsKvPoolError,
    GatewayError,
    InvalidRequestError,
    ModelNotFoundError,
    NotFoundError,
    ShedError,
    UnauthorizedError,
    UnavailableError,
    UpstreamError,
    UpstreamTimeoutError,
    to_http,
)


@pytest.mark.parametrize(
    ("error", "status", "error_type", "code", "should_retry"),
    [
        (InvalidRequestError("bad", param="n"), 400, "invalid_request_error", None, "false"),
        (ContextTooLongError("long"), 400, "invalid_request_error", "context_length_exceeded", "false"),
        (ExceedsKvPoolError("big"), 400, "invalid_request_error", "kv_pool_exceeded", "false"),
        (BodyTooLargeError("huge"), 413, "invalid_request_error", "request_too_large", "false"),
        (UnauthorizedError("who"), 401, "authentication_error", "invalid_admin_token", "false"),
        (NotFoundError("where"), 404, "invalid_request_error", "not_found", "false"),
        (ModelNotFoundError("which"), 404, "invalid_request_error", "model_not_found", "false"),
        (
            ShedError("busy", retry_after_s=2.4, code="queue_full"),
            429,
            "rate_limit_error",
            "queue_full",
            "true",
        ),
        (
            UnavailableError("down", retry_after_s=0.3),
            503,
            "service_unavailable",
            "backend_unavailable",
            "true",
        ),
        (UpstreamError("broke"), 502, "upstream_error", "upstream_failed", None),
        (UpstreamTimeoutError("slow"), 504, "upstream_error", "upstream_timeout", None),
    ],
)
def test_mapping(
    error: GatewayError, status: int, error_type: str, code: str | None, should_retry: str | None
) -> None:
    http = to_http(error)
    assert http.status == status
    body = json.loads(http.body)
    assert set(body) == {"error"}
    assert body["error"] == {"message": error.message, "type": error_type, "param": error.param, "code": code}
    assert http.headers.get("x-should-retry") == should_retry


@pytest.mark.parametrize(
    ("delay_s", "seconds", "ms"), [(2.4, "3", "2400"), (0.3, "1", "300"), (0.0, "1", "1")]
)
def test_retry_headers(delay_s: float, seconds: str, ms: str) -> None:
    headers = to_http(ShedError("busy", retry_after_s=delay_s)).headers
    assert (headers["retry-after"], headers["retry-after-ms"]) == (seconds, ms)
