"""`create_app`: the kvgate ASGI application. Its lifespan owns every resource.

Built from a `Settings` object and three optional injections for tests and embedding:
`clock` (monotonic seconds), `http_client` (an httpx.AsyncClient to reach the backend with,
e.g. one over `httpx.ASGITransport` to an in-process emulator; the caller keeps ownership)
and `token_counter` (skips tokenizer discovery). Nothing starts before the lifespan does:
the HTTP clients, the tokenizer thread pool, the metrics poller and the discovery task are
created on startup and closed on shutdown, when the queue is answered with 503.

Two clients reach the backend: generation requests, the hot path, go through the gateway's
own keep-alive pool (`gateway.upstream.HttpUpstream`); the occasional scrape and discovery
requests go through httpx. An injected `http_client` carries both.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from estimator.tokens import TokenCounter
from gateway import routes
from gateway.fleet import Resolver
from gateway.intake import BodyIntake
from gateway.json_body import DEFAULT_INLINE_MAX_BYTES, BodyParser
from gateway.loop_lag import LoopLagProbe
from gateway.metrics import GatewayMetrics, GaugeReadings
from gateway.router import Router
from gateway.settings import BackendSpec, Settings
from gateway.upstream import DEFAULT_KEEPALIVE_EXPIRY_S, HttpUpstream, HttpxUpstream, Upstream


class KvgateApp(FastAPI):
    """FastAPI with a shorter way in for the generation routes, the proxy's hot path.

    Starlette and FastAPI pass every request through their own middleware (error page,
    telemetry, body limit, exception mapping, an exit stack) and the router before it reaches
    an endpoint: tens of microseconds, a tenth of all kvgate spends on a proxied request. A POST
    to one of `direct_routes` skips them: it runs the middleware added with `add_middleware`
    (request ids), then the route's ASGI app, the same one the router would have reached
    (`routes.GENERATION_ENDPOINTS`). Those endpoints answer every error they expect themselves;
    anything else reaches the server, which answers 500 as the error middleware would have.
    Every other request takes FastAPI's usual way.
    """

    def __init__(self, *, direct_routes: Mapping[str, ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct_routes = dict(direct_routes)
        self._direct_stack: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._direct_routes:
            if self._direct_stack is None:  # built on first use, as Starlette builds its own
                self._direct_stack = self._build_direct_stack()
            scope["app"] = self
            await self._direct_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _build_direct_stack(self) -> ASGIApp:
        if self.middleware_stack is None:
            # Built now too, so that add_middleware refuses from here on for both ways in.
            self.middleware_stack = self.build_middleware_stack()
        app: ASGIApp = self._dispatch_direct
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return app

    async def _dispatch_direct(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._direct_routes[scope["path"]](scope, receive, send)


class _Levels:
    def __init__(self, router: Router) -> None:
        self._router = router

    def gauge_readings(self) -> Iterable[GaugeReadings]:
        return self._router.gauge_readings()


def backend_client(settings: Settings) -> httpx.AsyncClient:
    """The client for the backend's /metrics and /v1/models: explicit connect/write/pool
    timeouts; every call sets its own read timeout."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=None,
            write=settings.write_timeout_s,
            pool=settings.connect_timeout_s,
        ),
        limits=httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            # Expire idle connections before the backend's server does (uvicorn's keep-alive
            # lasts 5 s, httpx's default too): a poll never goes out on one being closed.
            keepalive_expiry=DEFAULT_KEEPALIVE_EXPIRY_S,
        ),
    )


def backend_upstream(settings: Settings, spec: BackendSpec) -> HttpUpstream:
    """The pool for one backend's generation requests: the same connect/write/pool bounds as
    the client."""
    return HttpUpstream(
        spec.url,
        connect_timeout_s=settings.connect_timeout_s,
        write_timeout_s=settings.write_timeout_s,
        max_connections=settings.max_connections,
    )


def create_app(
    settings: Settings,
    *,
    clock: Callable[[], float] = time.monotonic,
    http_client: httpx.AsyncClient | None = None,
    token_counter: TokenCounter | None = None,
    resolve: Resolver | None = None,
) -> FastAPI:
    metrics = GatewayMetrics(CollectorRegistry(auto_describe=True))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = http_client if http_client is not None else backend_client(settings)

        def upstream_for(spec: BackendSpec) -> Upstream:
            if http_client is not None:
                return HttpxUpstream(http_client, spec.url)
            return backend_upstream(settings, spec)

        executor = ThreadPoolExecutor(
            max_workers=settings.tokenizer_threads, thread_name_prefix="kvgate-tokens"
        )
        gateway = Router(
            settings,
            specs=settings.backend_specs(),
            client=client,
            upstream_for=upstream_for,
            clock=clock,
            metrics=metrics,
            executor=executor,
            token_counter=token_counter,
            resolve=resolve,
        )
        levels = metrics.watch(_Levels(gateway))
        app.state.kvgate = gateway
        app.state.body_parser = BodyParser()
        app.state.body_intake = BodyIntake(
            bytes_per_s=settings.large_body_bytes_per_s,
            burst_bytes=settings.max_body_bytes,
            free_bytes=DEFAULT_INLINE_MAX_BYTES,
        )
        probe = app.state.loop_lag = LoopLagProbe(metrics.event_loop_lag.observe)
        lag_task = asyncio.create_task(probe.run(), name="kvgate-loop-lag")
        await gateway.start()
        try:
            yield
        finally:
            lag_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag_task
            await gateway.stop()
            metrics.registry.unregister(levels)
            executor.shutdown(wait=False, cancel_futures=True)
            if http_client is None:
                await client.aclose()

    app = KvgateApp(
        direct_routes=routes.GENERATION_ENDPOINTS,
        title="kvgate",
        summary="Admission control for vLLM against its live KV-cache block budget",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    routes.install(app, metrics)
    return app
