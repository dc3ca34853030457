"""`create_app`: the kvgate ASGI application. Its lifespan owns every resource.

Built from a `Settings` object and three optional injections for tests and embedding:
`clock` (monotonic seconds), `http_client` (an httpx.AsyncClient to reach the backend with,
e.g. one over `httpx.ASGITransport` to an in-process emulator; the caller keeps ownership)
and `token_counter` (skips tokenizer discovery). Nothing starts before the lifespan does:
the HTTP client, the tokenizer thread pool, the metrics poller and the discovery task are
created on startup and closed on shutdown, when the queue is answered with 503.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from estimator.tokens import TokenCounter
from gateway import routes
from gateway.metrics import GatewayMetrics, GaugeReadings
from gateway.service import BackendGateway
from gateway.settings import Settings


class _Levels:
    def __init__(self, gateways: Iterable[BackendGateway]) -> None:
        self._gateways = list(gateways)

    def gauge_readings(self) -> Iterable[GaugeReadings]:
        return [gateway.gauge_readings() for gateway in self._gateways]


def backend_client(settings: Settings) -> httpx.AsyncClient:
    """The client for backend traffic: explicit connect/write/pool timeouts; reads are bounded
    per request by the relay's first-byte and between-chunk timeouts instead."""
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
        ),
    )


def create_app(
    settings: Settings,
    *,
    clock: Callable[[], float] = time.monotonic,
    http_client: httpx.AsyncClient | None = None,
    token_counter: TokenCounter | None = None,
) -> FastAPI:
    metrics = GatewayMetrics(CollectorRegistry(auto_describe=True))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = http_client if http_client is not None else backend_client(settings)
        executor = ThreadPoolExecutor(
            max_workers=settings.tokenizer_threads, thread_name_prefix="kvgate-tokens"
        )
        gateway = BackendGateway(
            settings,
            client=client,
            clock=clock,
            metrics=metrics,
            executor=executor,
            token_counter=token_counter,
        )
        levels = metrics.watch(_Levels([gateway]))
        app.state.kvgate = gateway
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()
            metrics.registry.unregister(levels)
            executor.shutdown(wait=False, cancel_futures=True)
            if http_client is None:
                await client.aclose()

    app = FastAPI(
        title="kvgate",
        summary="Admission control for vLLM against its live KV-cache block budget",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    routes.install(app, metrics)
    return app
