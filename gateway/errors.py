"""One error tree for the gateway, and one function that maps it to HTTP (pure).

Every refusal kvgate produces is a `GatewayError`; foreign exceptions are wrapped where they
enter (`raise UpstreamUnavailable(...) from exc`). `to_http` turns any of them into a status,
headers and OpenAI's error JSON `{"error": {"message", "type", "param", "code"}}`, so that
OpenAI clients parse them as they parse OpenAI's own.

Retry hints: a shed request (429) or one that no backend budget can take yet (503) carries
`Retry-After` (whole seconds, at least 1), `retry-after-ms` (the same, precise) and
`x-should-retry: true`; the OpenAI SDK honours them and retries by itself. Client errors carry
`x-should-retry: false`, so no SDK retries a request that cannot succeed.
"""

from __future__ import annotations

import json
import math
import os
import socket
import ssl
from dataclasses import dataclass, field
from typing import ClassVar


class GatewayError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code


class InvalidRequestError(GatewayError):
    """The request can never succeed as sent (400)."""

    status = 400
    error_type = "invalid_request_error"


class ContextTooLongError(InvalidRequestError):
    default_code = "context_length_exceeded"


class ExceedsKvPoolError(InvalidRequestError):
    """Its worst case needs more KV blocks than the backend's whole pool."""

    default_code = "kv_pool_exceeded"


class BodyTooLargeError(InvalidRequestError):
    status = 413
    default_code = "request_too_large"


class UnauthorizedError(GatewayError):
    status = 401
    error_type = "authentication_error"
    default_code = "invalid_admin_token"


class PermissionDeniedError(GatewayError):
    """Understood, and not allowed for this client (403): a priority it may not raise, an admin
    request from another site."""

    status = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class RequestTimeoutError(InvalidRequestError):
    """The client did not send its request in time (408)."""

    status = 408
    default_code = "request_timeout"


class NotFoundError(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    default_code = "model_not_found"


class MethodNotAllowedError(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class RetryableError(GatewayError):
    """Refusals that a later retry may turn into success; they carry a retry hint."""

    def __init__(
        self, message: str, *, retry_after_s: float, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s


class ShedError(RetryableError):
    """Not admitted in time: queue full, deadline unreachable or passed (429)."""

    status = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"


class UnavailableError(RetryableError):
    """No backend budget is known (or the backend is down, or still being discovered): 503."""

    status = 503
    error_type = "service_unavailable"
    default_code = "backend_unavailable"


class UpstreamError(GatewayError):
    """The backend failed or broke the connection (502)."""

    status = 502
    error_type = "upstream_error"
    default_code = "upstream_failed"


class UpstreamConnectError(UpstreamError):
    """No connection to the backend could be opened (refused, unreachable): it never saw the
    request, which may go to another backend of the model."""


class UpstreamTimeoutError(UpstreamError):
    """The backend did not answer within a configured timeout (504)."""

    status = 504
    default_code = "upstream_timeout"


def failure_reason(exc: BaseException) -> str:
    """What went wrong in a foreign exception, in words safe to show anyone: its kind and, for
    an operating-system error somewhere in its chain, the system's text for its number, or a
    TLS error's reason code. Never the exception's own message: that names hosts, ports and
    URLs ("Connect call failed ('10.0.0.5', 8000)", "... for url 'http://user:pass@...'"),
    and client-facing errors and /readyz must reveal neither the backend's address nor its
    credentials."""
    kind = type(exc).__name__
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, socket.gaierror):
            return f"{kind}: the host name does not resolve"
        if isinstance(current, ssl.SSLError) and current.reason:
            return f"{kind}: TLS error {current.reason}"
        if isinstance(current, OSError) and isinstance(current.errno, int) and current.errno > 0:
            return f"{kind}: {os.strerror(current.errno)}"
        if isinstance(current, TimeoutError):
            return f"{kind}: timed out"
        current = current.__cause__ or current.__context__
    return kind


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}},
        separators=(",", ":"),
    ).encode()


def retry_headers(retry_after_s: float) -> dict[str, str]:
    delay_s = max(0.0, retry_after_s)
    return {
        "retry-after": str(max(1, math.ceil(delay_s))),
        "retry-after-ms": str(max(1, round(delay_s * 1000))),
        "x-should-retry": "true",
    }


def to_http(error: GatewayError) -> HttpError:
    """The one mapping from a gateway error to an HTTP answer."""
    headers: dict[str, str] = {}
    if isinstance(error, RetryableError):
        headers.update(retry_headers(error.retry_after_s))
    elif 400 <= error.status < 500:
        headers["x-should-retry"] = "false"
    body = error_body(error.message, error.error_type, error.param, error.code)
    return HttpError(error.status, body, headers)
