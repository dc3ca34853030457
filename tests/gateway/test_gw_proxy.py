"""The relay on real sockets, against a scripted backend: which headers cross the gateway in
each direction, the backend key replacing the client's, and the first-byte and between-chunk
timeouts (each ends the backend's request and balances the ledger)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import Served, bound_socket, ledger_is_empty, served_gateway, serving
from pydantic import ValidationError

from gateway.settings import Settings

MODEL = "fake"
METRICS = (
    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 0.0\n'
    '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 0.0\n'
    '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.0\n'
    '# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{engine="0"} 0.0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
)
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
EVENT = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'


@dataclass
class Backend:
    """An ASGI backend whose generation answers follow `mode`; it records what it was sent and
    whether the gateway hung up on it."""

    mode: str = "json"
    seen: list[dict[str, str]] = field(default_factory=list)
    hung_up: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/models":
            models = {"data": [{"id": MODEL, "max_model_len": 4096}]}
            await self._answer(send, 200, json.dumps(models).encode(), b"application/json")
            return
        if scope["path"] == "/metrics":
            await self._answer(send, 200, METRICS.encode(), b"text/plain")
            return
        if scope["path"] == "/version":
            await self._answer(send, 200, b'{"version": "0.32.0"}', b"application/json")
            return
        while (await receive()).get("more_body"):
            pass
        self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        if self.mode == "json":
            body = b'{"choices":[{"index":0,"text":"hi"}],"usage":{"completion_tokens":1}}'
            extra = [
                (b"connection", b"x-backend-hop"),
                (b"x-backend-hop", b"1"),
                (b"keep-alive", b"timeout=5"),
                (b"proxy-authenticate", b"Basic"),
                (b"server", b"fake"),
                (b"x-backend-custom", b"yes"),
            ]
            await self._answer(send, 200, body, b"application/json", extra)
            return
        if self.mode == "stall":  # one event, then nothing until the gateway gives up
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        while (await receive())["type"] != "http.disconnect":  # "silent" and "stall"
            pass
        self.hung_up.set()

    @staticmethod
    async def _answer(
        send: Any,
        status: int,
        body: bytes,
        content_type: bytes,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        headers = [(b"content-type", content_type), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def backend() -> Iterator[tuple[Backend, str]]:
    app = Backend()
    sock = bound_socket()
    try:
        with serving(app, sock):
            yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def outcome_count(served: Served, outcome: str) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=5).text
    prefix = f'kvgate_requests_total{{backend="default",outcome="{outcome}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


CLIENT_HEADERS = {
    "connection": "x-client-hop",
    "x-client-hop": "1",
    "te": "trailers",
    "keep-alive": "timeout=5",
    "proxy-authorization": "Basic abc",
    "x-kvgate-priority": "high",
    "authorization": "Bearer client-key",
    "x-client-custom": "kept",
}


def test_hop_by_hop_headers_stay_on_their_side_of_the_gateway(backend: tuple[Backend, str]) -> None:
    app, url = backend
    with served_gateway(url) as kvgate:
        response = httpx.post(f"{kvgate.url}/v1/completions", json=BODY, headers=CLIENT_HEADERS, timeout=10)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "hi"
        sent = app.seen[-1]
        for name in ("x-client-hop", "te", "keep-alive", "proxy-authorization", "x-kvgate-priority"):
            assert name not in sent, name
        assert sent["x-client-custom"] == "kept"
        assert sent["authorization"] == "Bearer client-key"  # no key of its own: passed on
        assert sent["accept-encoding"] == "identity"
        assert sent["x-request-id"] == response.headers["x-request-id"]
        received = response.headers
        for name in ("x-backend-hop", "keep-alive", "proxy-authenticate"):
            assert name not in received, name
        assert received.get("server") != "fake"  # the server in front of the client names itself
        assert received["x-backend-custom"] == "yes"
        assert received["content-type"] == "application/json"
        assert "x-kvgate-queue-ms" in received
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_the_gateway_key_replaces_the_client_credentials(backend: tuple[Backend, str]) -> None:
    app, url = backend
    with served_gateway(url, backend_api_key="gateway-key") as kvgate:
        response = httpx.post(f"{kvgate.url}/v1/completions", json=BODY, headers=CLIENT_HEADERS, timeout=10)
        assert response.status_code == 200
        assert app.seen[-1]["authorization"] == "Bearer gateway-key"
        assert [value for name, value in app.seen[-1].items() if name == "authorization"] == [
            "Bearer gateway-key"
        ]


def test_a_stream_that_stalls_ends_with_an_error_event_and_hangs_up(backend: tuple[Backend, str]) -> None:
    app, url = backend
    app.mode = "stall"
    with served_gateway(url, between_chunk_timeout_s=0.3) as kvgate:
        response = httpx.post(f"{kvgate.url}/v1/completions", json={**BODY, "stream": True}, timeout=10)
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[0] == EVENT.decode()[6:].strip()
        error = json.loads(events[-1])["error"]
        assert (error["type"], error["code"]) == ("upstream_error", 504)
        assert app.hung_up.wait(5), "the backend was not told that nobody waits any more"
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")
        assert outcome_count(kvgate, "upstream_error") == 1


def test_no_first_byte_in_time_is_a_504_and_hangs_up(backend: tuple[Backend, str]) -> None:
    app, url = backend
    app.mode = "silent"
    with served_gateway(url, first_byte_timeout_s=0.3) as kvgate:
        response = httpx.post(f"{kvgate.url}/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert app.hung_up.wait(5)
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_the_relay_runs_beside_other_requests_on_one_connection_pool(backend: tuple[Backend, str]) -> None:
    # Many concurrent requests share the pool; each answer reaches its own client.
    app, url = backend

    async def burst(base: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json={**BODY, "max_tokens": i + 1}) for i in range(40))
            )
        return [answer.status_code for answer in answers]

    with served_gateway(url) as kvgate:
        assert asyncio.run(burst(kvgate.url)) == [200] * 40
        assert len(app.seen) == 40
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")
        pool = kvgate.call(lambda: kvgate.gateway.upstream)
        assert 1 <= pool.open_connections <= 40


@pytest.mark.parametrize("key", ["k\r\nx-injected: 1", "k\x00", "clé"])
def test_a_gateway_key_that_cannot_be_a_header_value_is_refused_at_startup(key: str) -> None:
    with pytest.raises(ValidationError, match="printable ASCII"):
        Settings(backend_url="http://127.0.0.1:1", backend_api_key=key)
