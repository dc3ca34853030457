"""The HTTP surface of `kvgate serve`.

- `POST /v1/chat/completions`, `POST /v1/completions`: admission-controlled, streamed back
  byte for byte (see `gateway.router`).
- `GET /v1/models`: the backend's own answer, relayed (no admission: it costs no KV blocks).
- Any other `/v1/*` path is refused with an OpenAI-shaped 404 that names what is served.
  Proxying them unadmitted would let KV-consuming work (embeddings, responses, audio) past
  the budget; refusing them keeps kvgate from being an open proxy into the backend.
- `GET /healthz`: the process answers. `GET /readyz`: 200 only when the backend's models are
  known, a tokenizer is loaded and the budget is fresh; otherwise 503 and why (unauthenticated:
  never the backend's address or credentials, see `gateway.errors.failure_reason`).
- `GET /metrics`: the gateway's own Prometheus metrics.
- `GET /admin/state`: budget, ledger, queue, backend, output-length model, the latest
  requests, the process's own figures (tasks, descriptors, memory) and the event loop's lag
  (the worst, the latest stalls and their likeliest cause, see `gateway.loop_lag`) as JSON.
  `POST /admin/reload`: re-read the settings and apply those that may change at run time
  (as SIGHUP does; see `gateway.lifecycle`). Both need the admin token
  (`Authorization: Bearer ...` or `X-Kvgate-Admin-Token`) when one is set, and are off on a
  non-loopback bind without one (`admin_api` in the settings). Neither is served to another
  site: a request whose `Sec-Fetch-Site` says cross-site or same-site, or whose `Origin` is
  not the host it was sent to, gets 403; without a token, so does one addressed to a host name
  that is not a loopback one (DNS rebinding), and a POST without `X-Kvgate-Admin: 1` (a header
  a cross-site form cannot send).
- `GET /dashboard`: a self-contained status page that polls `/admin/state` from the browser.
  The page holds no data, so it is served without the token; the browser sends the token the
  user types in with each poll (see `gateway.dashboard`).

Every response carries `x-request-id` (see `gateway.request_id`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route as StarletteRoute
from starlette.types import Receive, Scope, Send

from estimator.tokens import Route
from gateway.credentials import token_matches
from gateway.dashboard import DashboardPage, load_page
from gateway.errors import (
    BodyTooLargeError,
    GatewayError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PermissionDeniedError,
    RequestTimeoutError,
    UnauthorizedError,
    UpstreamError,
    UpstreamTimeoutError,
    error_body,
    failure_reason,
    to_http,
)
from gateway.intake import BodyIntake
from gateway.json_body import BodyParser, TooManyContainersError
from gateway.metrics import GatewayMetrics
from gateway.openapi import ADMIN_ERRORS, BACKEND_ERRORS, ErrorBody, install_openapi
from gateway.outcomes import CLIENT_CLOSED_STATUS, Outcome
from gateway.process_stats import process_stats
from gateway.recent import RequestSummary
from gateway.request_id import RequestIdMiddleware, request_id_of
from gateway.router import ClientGoneError, Router
from gateway.settings import Settings, is_loopback

SERVED_V1_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def error_response(error: GatewayError, extra_headers: dict[str, str] | None = None) -> Response:
    http = to_http(error)
    headers = {**http.headers, **(extra_headers or {})}
    return Response(http.body, status_code=http.status, headers=headers, media_type="application/json")


def _gateway(request: Request) -> Router:
    gateway: Router = request.app.state.kvgate
    return gateway


class ClientLeftError(Exception):
    """The client closed its connection before its request body was complete."""


async def _read_body(request: Request, limit: int, intake: BodyIntake) -> bytes:
    """The request body, at most `limit` bytes (BodyTooLargeError beyond). Raises
    ClientLeftError when the client disconnects mid-body: nothing has been reserved then, and
    nobody is left to answer. A large body waits for its pace in `intake` (gateway.intake)
    between chunks.

    Receipt is this one loop over the body's chunks: a limit on how long a body may take to
    arrive belongs around it, raising a GatewayError (its answer goes out as any refusal's)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"the request body is larger than {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BodyTooLargeError(f"the request body is larger than {limit} bytes")
            await intake.received(len(body) - len(chunk), len(body))
    except ClientDisconnect as exc:
        raise ClientLeftError() from exc
    return bytes(body)


async def _received(body: Awaitable[bytes], timeout_s: float) -> bytes:
    """`body`, or RequestTimeoutError (408) when it has not arrived within `timeout_s` of the
    head: a client trickling its body would otherwise hold a connection and a task for ever.
    (The server closes the connection after the answer: the rest of the body may still come.)"""
    try:
        async with asyncio.timeout(timeout_s):
            return await body
    except TimeoutError:
        raise RequestTimeoutError(f"the request body did not arrive within {timeout_s:g} s") from None


async def _parse_json(parser: BodyParser, raw: bytes) -> Any:
    """The body as JSON, a large one parsed in steps that let the loop run (gateway.json_body)."""
    if not raw:
        raise InvalidRequestError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return await parser.parse(raw)
    except TooManyContainersError as exc:
        raise InvalidRequestError(f"the request body is too complex: {exc}", code="body_too_complex") from exc
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc


async def _generation(request: Request, route: Route, path: str) -> Response:
    gateway = _gateway(request)
    arrived_at = gateway.clock()
    request_id = request_id_of(request.scope)
    intake: BodyIntake = request.app.state.body_intake
    try:
        raw = await _received(
            _read_body(request, gateway.settings.max_body_bytes, intake), gateway.settings.body_timeout_s
        )
        body = await _parse_json(request.app.state.body_parser, raw)
        prepared = await gateway.prepare(route, body, raw, request.headers, arrived_at, request_id)
    except GatewayError as exc:
        gateway.refused_early(request_id, route, exc, arrived_at)
        return error_response(exc)
    except ClientLeftError:
        # A clean end, not a fault of kvgate's: one request line, nothing reserved.
        gateway.conclude(
            RequestSummary(
                request_id,
                gateway.label_before_placing(),
                route.value,
                Outcome.CLIENT_GONE,
                CLIENT_CLOSED_STATUS,
                arrived_at,
                gateway.clock(),
                code="client_left_mid_body",
            )
        )
        return Response(status_code=CLIENT_CLOSED_STATUS)
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
            {
                "x-kvgate-queue-ms": str(queued_ms),
                "x-kvgate-blocks": str(prepared.reference.demand.reserved_blocks),
            },
        )
    # No await between admission and handing the reservation to the response that completes it.
    try:
        return gateway.relay(reservation, request.scope["headers"], path)
    except ValueError as exc:  # e.g. a header that cannot be forwarded
        reservation.finish(Outcome.REJECTED_INVALID, None, gateway.clock())
        return error_response(InvalidRequestError(f"the request cannot be forwarded: {exc}"))
    except BaseException:
        reservation.finish(Outcome.UPSTREAM_ERROR, None, gateway.clock())
        raise


class GenerationEndpoint:
    """The ASGI app of one generation route (`path` on the backend too). A plain ASGI app
    rather than a FastAPI endpoint: it has no parameters to validate, and FastAPI's
    per-request machinery would be a noticeable share of the proxy's cost."""

    def __init__(self, route: Route, path: str) -> None:
        self.route = route
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await _generation(Request(scope, receive), self.route, self.path)
        await response(scope, receive, send)


GENERATION_ENDPOINTS = {
    "/v1/chat/completions": GenerationEndpoint(Route.CHAT, "/v1/chat/completions"),
    "/v1/completions": GenerationEndpoint(Route.COMPLETIONS, "/v1/completions"),
}


async def list_models(request: Request) -> Response:
    """One backend's /v1/models as it answers; for a fleet, every model some backend serves
    (each listed once, as the first backend in order that serves it describes it)."""
    gateway = _gateway(request)
    answers = await asyncio.gather(
        *(_backend_models(gateway, backend.url, backend.headers) for backend in gateway.backends)
    )
    if len(answers) == 1:
        return answers[0]
    listed: dict[str, Any] = {}
    for answer in answers:
        if answer.status_code != 200:
            continue
        try:
            data = json.loads(bytes(answer.body)).get("data")
        except (ValueError, AttributeError):
            continue
        for item in data if isinstance(data, list) else ():
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                listed.setdefault(item["id"], item)
    if not listed:
        return answers[0]
    return JSONResponse({"object": "list", "data": list(listed.values())})


async def _backend_models(gateway: Router, url: str, headers: dict[str, str]) -> Response:
    try:
        upstream = await gateway.client.get(
            f"{url}/v1/models",
            headers=headers,
            timeout=httpx.Timeout(gateway.settings.discovery_timeout_s),
        )
    except httpx.TimeoutException as exc:
        return error_response(
            UpstreamTimeoutError(f"the backend did not list its models in time: {failure_reason(exc)}")
        )
    except httpx.HTTPError as exc:
        return error_response(UpstreamError(f"cannot reach the backend: {failure_reason(exc)}"))
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


ADMIN_TOKEN_HEADER = "x-kvgate-admin-token"
# Without an admin token, a request that changes state (POST /admin/*) carries this header:
# a page of another site cannot send a custom header without a CORS preflight, which kvgate
# never grants, so a form or a script elsewhere cannot reload a loopback kvgate.
ADMIN_INTENT_HEADER = "x-kvgate-admin"
# What the browser says of the page that sent a request (Fetch Metadata): only kvgate's own
# pages (same-origin) and requests no page made (none: typed, bookmarked, or not a browser).
_ADMIN_FETCH_SITES = frozenset({"same-origin", "none"})


def _admin_refusal(request: Request, settings: Settings, *, changes_state: bool = False) -> Response | None:
    """None when the request may use the admin API, else the answer to give it.

    Beyond the token: a request that a browser marks as sent by another site (Sec-Fetch-Site,
    or an Origin other than the host it was sent to) is refused, and so is, without a token on
    a loopback bind, one addressed to a host name other than a loopback one (a page that
    rebinds its own name to 127.0.0.1 is same-origin to the browser, but says its name)."""
    if not settings.admin_enabled():
        return error_response(
            NotFoundError(
                "the admin API is off: on a non-loopback bind it needs an admin token "
                "(KVGATE_ADMIN_TOKEN) or admin_api = on",
                code="admin_api_disabled",
            )
        )
    cross_site = _cross_site(request)
    if cross_site is not None:
        return error_response(
            PermissionDeniedError(
                f"the admin API is not served to other sites ({cross_site})", code="cross_site"
            )
        )
    if settings.admin_token is None:
        if is_loopback(settings.host) and not is_loopback(_host_name(request.headers.get("host", ""))):
            return error_response(
                PermissionDeniedError(
                    "without an admin token the admin API answers only requests addressed to a loopback "
                    "host (localhost, 127.0.0.1, [::1])",
                    code="admin_host_not_loopback",
                )
            )
        if changes_state and not request.headers.get(ADMIN_INTENT_HEADER):
            return error_response(
                PermissionDeniedError(
                    f"{request.method} {request.url.path} needs the header X-Kvgate-Admin: 1 (or the admin "
                    "token), which a page of another site cannot send",
                    code="admin_header_required",
                )
            )
        return None
    offered = request.headers.get(ADMIN_TOKEN_HEADER, "")
    authorization = request.headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        offered = offered or authorization[7:].strip()
    if token_matches(offered, settings.admin_token.get_secret_value()):
        return None
    return error_response(UnauthorizedError("the admin token is missing or wrong"))


def _cross_site(request: Request) -> str | None:
    """Why a browser's request comes from another site, or None."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site.strip().lower() not in _ADMIN_FETCH_SITES:
        return f"Sec-Fetch-Site: {site.strip().lower()}"
    origin = request.headers.get("origin")
    if origin is None:
        return None
    parts = urlsplit(origin.strip())
    host = request.headers.get("host", "")
    if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.strip().lower():
        return "Origin is not this host"
    return None


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    host = host.strip()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


async def admin_state(request: Request) -> Response:
    gateway = _gateway(request)
    refusal = _admin_refusal(request, gateway.settings)
    if refusal is not None:
        return refusal
    return JSONResponse(
        {
            **gateway.describe(),
            "settings": gateway.settings.public_view(),
            "process": process_stats().to_json(),
            "event_loop": request.app.state.loop_lag.recorder.summary().to_json(),
            "body_intake": request.app.state.body_intake.to_json(),
        }
    )


async def admin_reload(request: Request) -> Response:
    """Re-read the settings and apply those that may change at run time (as SIGHUP does)."""
    refusal = _admin_refusal(request, _gateway(request).settings, changes_state=True)
    if refusal is not None:
        return refusal
    reloader = getattr(request.app.state, "reloader", None)
    if reloader is None:
        return error_response(
            NotFoundError("this kvgate has no settings source to reload from", code="reload_unavailable")
        )
    result = reloader.reload()
    return JSONResponse(result.to_json(), status_code=200 if result.error is None else 400)


async def dashboard(request: Request) -> Response:
    page: DashboardPage = request.app.state.dashboard_page
    return Response(page.html, media_type="text/html; charset=utf-8", headers=page.headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else "internal error"
    body = error_body(f"{detail}: {request.method} {request.url.path}", "invalid_request_error", None, None)
    return Response(body, status_code=status, media_type="application/json")


def install(app: FastAPI, metrics_registry: GatewayMetrics) -> None:
    app.state.metrics = metrics_registry
    for path, endpoint in GENERATION_ENDPOINTS.items():
        app.router.routes.append(StarletteRoute(path, endpoint, methods=["POST"]))
    app.add_api_route("/v1/models", list_models, methods=["GET"], responses=BACKEND_ERRORS)
    app.add_api_route(
        "/v1/{path:path}",
        unserved_v1,
        methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        include_in_schema=False,
    )
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route(
        "/readyz", readyz, methods=["GET"], responses={503: {"description": "Not ready, and why"}}
    )
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/admin/state", admin_state, methods=["GET"], responses=ADMIN_ERRORS)
    app.add_api_route(
        "/admin/reload",
        admin_reload,
        methods=["POST"],
        responses={**ADMIN_ERRORS, 400: {"model": ErrorBody, "description": "Invalid settings"}},
    )
    app.state.dashboard_page = load_page()
    app.add_api_route("/dashboard", dashboard, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_middleware(RequestIdMiddleware)
    install_openapi(app)
