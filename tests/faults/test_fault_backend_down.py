"""The backend dies: killed mid-stream (SIGKILL of the emulator's process), then started again.

What must happen: streams in flight end with a well-formed SSE error event and the end of the
stream; every reservation is released; the backend is marked down and /readyz says so; the
requests waiting in kvgate's queue are answered at once with 503 + Retry-After rather than left
to wait for a backend that is gone; and when the backend is back kvgate serves again, with no
restart of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from faultkit import (
    LONG_STREAM,
    SLOW_STEPS,
    Served,
    SimProcess,
    gateway_idle,
    poll_until,
    served_gateway,
    sse_events,
)

from sim.config import SimConfig

# Two of these fill the testbed-shaped pool (30 of 63 blocks each): whatever comes next waits.
HOG = {**LONG_STREAM, "prompt": "a", "max_tokens": 950}
SMALL = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture
def sim() -> Iterator[SimProcess]:
    process = SimProcess(SimConfig(engine=SLOW_STEPS))
    process.start()
    try:
        yield process
    finally:
        process.stop()


def stream_all(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """POST a streaming request and read it to its end; returns status and `data:` payloads."""
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        return response.status_code, sse_events("".join(response.iter_text()))


def test_backend_killed_mid_stream(sim: SimProcess) -> None:
    with served_gateway(sim.url) as kvgate, ThreadPoolExecutor(8) as pool:
        hogs = [pool.submit(stream_all, kvgate.url, HOG) for _ in range(2)]
        kvgate.wait_until(lambda gw: gw.ledger.totals().entries == 2, what="both streams admitted")
        # Let both streams get going before the crash.
        kvgate.wait_until(
            lambda gw: all(sum(entry.output_tokens) >= 5 for entry in gw.ledger.entries()),
            what="tokens to flow",
        )
        queued: list[Future[httpx.Response]] = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=SMALL, timeout=30) for _ in range(3)
        ]
        kvgate.wait_until(lambda gw: len(gw.queue) == 3, what="three requests queued")

        killed_at = time.monotonic()
        sim.kill()

        for hog in hogs:
            status, events = hog.result(timeout=10)
            assert status == 200  # the status line had gone out before the crash
            assert events, "the stream ended without any event"
            error = json.loads(events[-1])["error"]  # the last event is the error, well-formed JSON
            assert error["type"] == "upstream_error"
            assert error["code"] == 502
            assert "[DONE]" not in events
        for waiting in queued:
            response = waiting.result(timeout=10)
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.headers["x-should-retry"] == "true"
            assert response.json()["error"]["code"] == "backend_down"
        answered_s = time.monotonic() - killed_at
        assert answered_s < 2.0, f"queued requests waited {answered_s:.2f} s for a dead backend"
        kvgate.wait_until(gateway_idle, timeout_s=2, what="every reservation released")

        ready = httpx.get(f"{kvgate.url}/readyz", timeout=5)
        assert ready.status_code == 503
        assert "unreachable" in ready.json()["reason"]
        # New arrivals are not queued for a dead backend either.
        refused = httpx.post(f"{kvgate.url}/v1/completions", json=SMALL, timeout=5)
        assert refused.status_code == 503
        assert "retry-after" in refused.headers

        sim.start()  # the same port, a fresh engine
        poll_until(
            lambda: httpx.get(f"{kvgate.url}/readyz", timeout=5).status_code == 200, what="ready again"
        )
        status, events = stream_all(kvgate.url, {**LONG_STREAM, "max_tokens": 20})
        assert status == 200
        assert events[-1] == "[DONE]"
        kvgate.wait_until(gateway_idle, what="the ledger to balance after recovery")


def test_backend_killed_under_a_non_streaming_request(sim: SimProcess) -> None:
    """The status line has not gone out yet: the client gets a clean 502 in OpenAI's shape."""
    with served_gateway(sim.url) as kvgate, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post, f"{kvgate.url}/v1/completions", json={**SMALL, "max_tokens": 900}, timeout=30
        )
        kvgate.wait_until(
            lambda gw: gw.ledger.totals().entries == 1 and gw.snapshot().used_reported_blocks > 0,
            what="the request to be running",
        )
        sim.kill()
        response = pending.result(timeout=10)
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "upstream_error"
        kvgate.wait_until(gateway_idle, timeout_s=2, what="the reservation released")
        kvgate.wait_until(lambda gw: gw.snapshot().state.value == "down", what="backend marked down")


def served_state(kvgate: Served) -> dict[str, Any]:
    return kvgate.call(kvgate.gateway.describe)  # type: ignore[no-any-return]
