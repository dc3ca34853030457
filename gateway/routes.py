"""The HTTP surface of `kvgate serve`.

- `POST /v1/chat/completions`, `POST /v1/completions`: admission-controlled, streamed back
  byte for byte (see `gateway.service`).
- `GET /v1/models`: the backend's own answer, relayed (no admission: it costs no KV blocks).
- Any other `/v1/*` path is refused with an OpenAI-shaped 404 that names what is served.
  Proxying them unadmitted would let KV-consuming work (embeddings, responses, audio) past
  the budget; refusing them keeps kvgate from being an open proxy into the backend.
- `GET /healthz`: the process answers. `GET /readyz`: 200 only when the backend's models are
  known, a tokenizer is loaded and the budget is fresh; otherwise 503 and why.
- `GET /metrics`: the gateway's own Prometheus metrics.
- `GET /admin/state`: budget, ledger, queue, backend and output-length model as JSON; needs
  the admin token (`Authorization: Bearer ...` or `X-Kvgate-Admin-Token`) when one is set.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from estimator.tokens import Route
from gateway.errors import (
    BodyTooLargeError,
    GatewayError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    UnauthorizedError,
    UpstreamError,
    UpstreamTimeoutError,
    error_body,
    to_http,
)
from gateway.metrics import GatewayMetrics
from gateway.outcomes import Outcome
from gateway.service import BackendGateway, ClientGoneError
from gateway.settings import Settings

SERVED_V1_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
# nginx's convention for "client closed the request"; nobody is left to read it.
CLIENT_CLOSED_STATUS = 499


def error_response(error: GatewayError, extra_headers: dict[str, str] | None = None) -> Response:
    http = to_http(error)
    headers = {**http.headers, **(extra_headers or {})}
    return Response(http.body, status_code=http.status, headers=headers, media_type="application/json")


def _gateway(request: Request) -> BackendGateway:
    gateway: BackendGateway = request.app.state.kvgate
    return gateway


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"the request body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLargeError(f"the request body is larger than {limit} bytes")
    return bytes(body)


def _parse_json(raw: bytes) -> Any:
    if not raw:
        raise InvalidRequestError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc


async def _generation(request: Request, route: Route) -> Response:
    gateway = _gateway(request)
    arrived_at = gateway.clock()
    try:
        raw = await _read_body(request, gateway.settings.max_body_bytes)
        body = _parse_json(raw)
        prepared = await gateway.prepare(route, body, raw, request.headers, arrived_at)
    except GatewayError as exc:
        gateway.metrics.outcome(
            gateway.name, Outcome.REJECTED_INVALID if exc.status < 500 else Outcome.SHED_UNAVAILABLE
        )
        return error_response(exc)
    entered_at = gateway.clock()
    try:
        reservation = await gateway.admit(prepared, request.receive)
    except ClientGoneError:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except GatewayError as exc:
        # Shed or rejected: say how long it waited and what it would have reserved.
        queued_ms = round(max(0.0, gateway.clock() - entered_at) * 1000)
        return error_response(
            exc,
            {"x-kvgate-queue-ms": str(queued_ms), "x-kvgate-blocks": str(prepared.demand.reserved_blocks)},
        )
    # No await between admission and handing the reservation to the response that completes it.
    try:
        return gateway.relay(reservation, request.headers.items(), request.url.path)
    except (ValueError, httpx.HTTPError) as exc:  # e.g. a header httpx cannot encode
        reservation.finish(Outcome.REJECTED_INVALID, None, gateway.clock())
        return error_response(InvalidRequestError(f"the request cannot be forwarded: {exc}"))
    except BaseException:
        reservation.finish(Outcome.UPSTREAM_ERROR, None, gateway.clock())
        raise


async def chat_completions(request: Request) -> Response:
    return await _generation(request, Route.CHAT)


async def completions(request: Request) -> Response:
    return await _generation(request, Route.COMPLETIONS)


async def list_models(request: Request) -> Response:
    gateway = _gateway(request)
    settings = gateway.settings
    headers = (
        {"authorization": f"Bearer {settings.backend_api_key.get_secret_value()}"}
        if settings.backend_api_key
        else {}
    )
    try:
        upstream = await gateway.client.get(
            f"{settings.backend_url}/v1/models",
            headers=headers,
            timeout=httpx.Timeout(settings.discovery_timeout_s),
        )
    except httpx.TimeoutException as exc:
        return error_response(UpstreamTimeoutError(f"the backend did not list its models in time: {exc!r}"))
    except httpx.HTTPError as exc:
        return error_response(UpstreamError(f"cannot reach the backend: {exc!r}"))
    return Response(
        upstream.content,
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type", "application/json"),
    )


async def unserved_v1(request: Request) -> Response:
    if request.url.path in SERVED_V1_PATHS:
        method = "GET" if request.url.path == "/v1/models" else "POST"
        return error_response(
            MethodNotAllowedError(f"{request.url.path} takes {method}, not {request.method}")
        )
    return error_response(
        NotFoundError(
            f"kvgate does not serve {request.method} {request.url.path}; it serves "
            f"{', '.join(SERVED_V1_PATHS)}",
            code="unsupported_endpoint",
        )
    )


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    ready, reason = _gateway(request).readiness()
    return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _admin_allowed(request: Request, settings: Settings) -> bool:
    if settings.admin_token is None:
        return True
    expected = settings.admin_token.get_secret_value().encode()
    offered = request.headers.get("x-kvgate-admin-token", "")
    authorization = request.headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        offered = offered or authorization[7:].strip()
    return hmac.compare_digest(offered.encode(), expected)


async def admin_state(request: Request) -> Response:
    gateway = _gateway(request)
    if not _admin_allowed(request, gateway.settings):
        return error_response(UnauthorizedError("the admin token is missing or wrong"))
    return JSONResponse({"backends": [gateway.describe()], "settings": gateway.settings.public_view()})


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else "internal error"
    body = error_body(f"{detail}: {request.method} {request.url.path}", "invalid_request_error", None, None)
    return Response(body, status_code=status, media_type="application/json")


def install(app: FastAPI, metrics_registry: GatewayMetrics) -> None:
    app.state.metrics = metrics_registry
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=True)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route(
        "/v1/{path:path}",
        unserved_v1,
        methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        include_in_schema=False,
    )
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/readyz", readyz, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/admin/state", admin_state, methods=["GET"])
    app.add_exception_handler(StarletteHTTPException, _http_exception)
