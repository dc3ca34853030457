"""Fixtures for the gateway's tests: kvgate in front of the emulator, in process or on sockets.

`gateway_over_sim` runs both apps in the test's event loop through httpx.ASGITransport (fast,
but whole responses are buffered). `served_gateway` runs kvgate under uvicorn on a real socket
in a background thread, for streaming, disconnects and the official OpenAI client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from one_backend import OneBackend

from estimator.tokens import TokenCounter
from gateway.app import create_app
from gateway.router import Router
from gateway.settings import Settings
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.server import SimApp, create_sim_app
from sim.testing import serving

# The testbed's pool (64 blocks of 32 tokens, max_model_len 1024) at unit-test speed.
FAST_ENGINE = EngineConfig(step_cost=StepCost(base_s=0.001, per_token_s=0.0, per_seq_s=0.0))
# Scrape often so tests do not wait for the budget.
TEST_SETTINGS: dict[str, Any] = {
    "metrics_poll_interval_s": 0.02,
    "metrics_stale_after_s": 0.5,
    "settle_s": 0.05,
}
READY_TIMEOUT_S = 10.0


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll `predicate` on the event loop until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def ledger_is_empty(gateway: OneBackend) -> bool:
    totals = gateway.ledger.totals()
    return (
        totals.entries == 0
        and totals.reserved_blocks == 0
        and totals.held_blocks == 0
        and not gateway.inflight
    )


@dataclass
class InProcess:
    app: FastAPI
    client: httpx.AsyncClient
    sim: SimApp

    @property
    def gateway(self) -> OneBackend:
        return OneBackend(self.app.state.kvgate)


@contextlib.asynccontextmanager
async def gateway_over_sim(sim_config: SimConfig | None = None, **overrides: Any) -> AsyncIterator[InProcess]:
    sim_app = create_sim_app(sim_config or SimConfig(engine=FAST_ENGINE))
    async with sim_app.run(), httpx.AsyncClient(transport=httpx.ASGITransport(sim_app)) as backend:
        settings = Settings(backend_url="http://sim", **{**TEST_SETTINGS, **overrides})
        app = create_app(settings, http_client=backend, token_counter=TokenCounter.approximate())
        async with app.router.lifespan_context(app):
            gateway = OneBackend(app.state.kvgate)
            await wait_until(lambda: gateway.readiness()[0], READY_TIMEOUT_S, "the gateway to be ready")
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
                yield InProcess(app, client, sim_app)


@dataclass
class InProcessFleet:
    app: FastAPI
    client: httpx.AsyncClient
    sims: dict[str, SimApp]

    @property
    def router(self) -> Router:
        router: Router = self.app.state.kvgate
        return router


@contextlib.asynccontextmanager
async def gateway_over_sims(
    sims: Mapping[str, SimConfig],
    transports: Mapping[str, Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]] | None = None,
    **overrides: Any,
) -> AsyncIterator[InProcessFleet]:
    """kvgate in process in front of several emulators, backend NAME at http://NAME; a
    backend named in `transports` is reached through what its function wraps around it."""
    apps = {name: create_sim_app(config) for name, config in sims.items()}
    async with contextlib.AsyncExitStack() as stack:
        for sim_app in apps.values():
            await stack.enter_async_context(sim_app.run())
        mounts: dict[str, httpx.AsyncBaseTransport] = {}
        for name, sim_app in apps.items():
            transport: httpx.AsyncBaseTransport = httpx.ASGITransport(sim_app)
            if transports is not None and name in transports:
                transport = transports[name](transport)
            mounts[f"http://{name}"] = transport
        backend = await stack.enter_async_context(httpx.AsyncClient(mounts=mounts))
        settings = Settings(
            backends=[f"{name}=http://{name}" for name in apps], **{**TEST_SETTINGS, **overrides}
        )
        app = create_app(settings, http_client=backend, token_counter=TokenCounter.approximate())
        await stack.enter_async_context(app.router.lifespan_context(app))
        router: Router = app.state.kvgate
        await wait_until(
            lambda: all(b.readiness()[0] for b in router.backends),
            READY_TIMEOUT_S,
            "every backend to be ready",
        )
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost")
        )
        yield InProcessFleet(app, client, apps)


@pytest.fixture
async def inproc() -> AsyncIterator[InProcess]:
    async with gateway_over_sim() as harness:
        yield harness


# -- kvgate on a real socket ------------------------------------------------------------------


@dataclass
class Served:
    url: str
    app: FastAPI
    loop: asyncio.AbstractEventLoop

    @property
    def gateway(self) -> OneBackend:
        return OneBackend(self.app.state.kvgate)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the gateway's event loop and return its result (thread-safe reads)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def wait_until(
        self, predicate: Callable[[OneBackend], bool], timeout_s: float = 10.0, what: str = ""
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.call(lambda: predicate(self.gateway)):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or predicate}")
            time.sleep(0.01)


def bound_socket() -> socket.socket:
    """A socket bound to a free local port and not yet listening: connections are refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def served_gateway(
    backend_url: str, *, wait_ready: bool = True, discover_tokenizer: bool = False, **overrides: Any
) -> Iterator[Served]:
    """kvgate under uvicorn in a background thread, in front of `backend_url`. Counts tokens
    approximately unless `discover_tokenizer` (then as `kvgate serve` does: from the backend)."""
    settings = Settings(backend_url=backend_url, **{**TEST_SETTINGS, **overrides})
    counter = None if discover_tokenizer else TokenCounter.approximate()
    app = create_app(settings, token_counter=counter)
    sock = bound_socket()
    port = sock.getsockname()[1]
    try:
        with serving(app, sock) as loop:
            served = Served(f"http://127.0.0.1:{port}", app, loop)
            if wait_ready:
                served.wait_until(lambda gw: gw.readiness()[0], READY_TIMEOUT_S, "the gateway to be ready")
            yield served
    finally:
        sock.close()
