"""The relay on real sockets, against a scripted backend: which headers cross the gateway in
each direction, the backend key replacing the client's, and the first-byte and between-chunk
timeouts (each ends the backend's request and balances the ledger). And the relay in process,
against a scripted upstream and client: the time it spends blocked writing to the client, the
client write timeout, and plain answers held while short and relayed as they come past that."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import Served, bound_socket, ledger_is_empty, served_gateway, serving
from pydantic import ValidationError

from gateway.outcomes import Outcome
from gateway.proxy import PLAIN_HOLD_BYTES, RelayResponse, RelayResult, RelayTimeouts
from gateway.settings import Settings
from gateway.sse import Usage
from gateway.upstream import UpstreamRequest

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

    # A burst of 40 in this process can delay a scrape past the tests' short staleness bound;
    # this test is about the connection pool, so the budget may be as old as a loaded machine makes it.
    with served_gateway(url, metrics_stale_after_s=5.0) as kvgate:
        assert asyncio.run(burst(kvgate.url)) == [200] * 40
        assert len(app.seen) == 40
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")
        pool = kvgate.call(lambda: kvgate.gateway.upstream)
        assert 1 <= pool.open_connections <= 40


@pytest.mark.parametrize("key", ["k\r\nx-injected: 1", "k\x00", "clé"])
def test_a_gateway_key_that_cannot_be_a_header_value_is_refused_at_startup(key: str) -> None:
    with pytest.raises(ValidationError, match="printable ASCII"):
        Settings(backend_url="http://127.0.0.1:1", backend_api_key=key)


# -- the relay in process: writes to the client, timed and bounded ------------------------------


class ScriptedResponse:
    """An upstream response whose body is `chunks`, each after `gap_s` (a slow backend)."""

    def __init__(self, chunks: list[bytes], content_type: bytes, gap_s: float = 0.0) -> None:
        self._chunks = list(chunks)
        self._gap_s = gap_s
        self.headers = [(b"content-type", content_type)]
        self.status = 200
        self.closed = 0

    async def receive(self, deadline: float | None = None) -> bytes:
        if self._gap_s:
            await asyncio.sleep(self._gap_s)
        return self._chunks.pop(0) if self._chunks else b""

    async def aclose(self) -> None:
        self.closed += 1


@dataclass
class ScriptedUpstream:
    response: ScriptedResponse

    async def send(self, request: UpstreamRequest, deadline: float | None = None) -> ScriptedResponse:
        return self.response

    async def aclose(self) -> None:
        pass


@dataclass
class Finished:
    calls: list[tuple[Outcome, RelayResult]] = field(default_factory=list)

    def on_first_byte(self, now: float) -> None:
        pass

    def on_tokens(self, choice: int, tokens: int) -> None:
        pass

    def on_finish(self, outcome: Outcome, result: RelayResult, now: float) -> None:
        self.calls.append((outcome, result))


async def relay(
    response: ScriptedResponse,
    send: Callable[[dict[str, Any]], Awaitable[None]],
    *,
    write_timeout_s: float = 30.0,
) -> tuple[Outcome, RelayResult]:
    """Run a RelayResponse over `response` with `send` as the client's side; returns what it
    reported (exactly once)."""
    observer = Finished()
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()  # the client never disconnects
        return {"type": "http.disconnect"}

    relay_response = RelayResponse(
        upstream=ScriptedUpstream(response),
        request=UpstreamRequest(b"POST", b"/v1/completions", []),
        observer=observer,
        timeouts=RelayTimeouts(5.0, 5.0, write_timeout_s),
        extra_headers={},
        clock=time.monotonic,
    )
    await relay_response({"type": "http"}, receive, send)
    assert len(observer.calls) == 1
    assert response.closed == 1
    return observer.calls[0]


SSE = b"text/event-stream"


async def test_the_time_blocked_writing_to_the_client_is_measured() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 3:  # the second event: the client's window is full for a while
            await asyncio.sleep(0.2)

    outcome, result = await relay(ScriptedResponse([EVENT, EVENT, EVENT], SSE), send)
    assert outcome is Outcome.COMPLETED
    assert result.client_wait_s >= 0.2
    assert result.client_wait_before_first_byte_s < result.client_wait_s
    assert result.code is None


async def test_a_write_that_never_waits_is_not_the_clients_time() -> None:
    # As when another thread holds the GIL: the write is slow but never gives the loop a turn.
    async def send(message: dict[str, Any]) -> None:
        time.sleep(0.01)  # noqa: ASYNC251 (the point: a write that holds the loop)

    outcome, result = await relay(ScriptedResponse([EVENT, EVENT, EVENT], SSE), send)
    assert outcome is Outcome.COMPLETED
    assert result.client_wait_s == 0.0


async def test_a_write_that_waits_gets_what_the_server_hands_back_and_its_errors() -> None:
    # The relay runs a write's first step itself; the rest must still behave as an await.
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if len(sent) == 2:
                raise ConnectionResetError("the client went away")
            sent.append(message["body"])

    outcome, result = await relay(ScriptedResponse([EVENT] * 5, SSE), send)
    assert outcome is Outcome.CLIENT_GONE
    assert sent == [EVENT, EVENT]
    assert result.client_wait_s > 0.0


async def test_a_write_blocked_past_the_timeout_ends_the_relay_once() -> None:
    blocked = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message.get("body") == EVENT:
            blocked.set()
            await asyncio.Event().wait()  # the client never reads again

    outcome, result = await relay(ScriptedResponse([EVENT] * 50, SSE), send, write_timeout_s=0.05)
    assert blocked.is_set()
    assert outcome is Outcome.CLIENT_GONE
    assert result.code == "client_write_timeout"
    assert result.client_wait_s >= 0.05


async def test_writes_that_each_complete_are_never_timed_out() -> None:
    # The relay lasts many times the write timeout, but no single write blocks that long.
    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0.005)

    response = ScriptedResponse([EVENT] * 40, SSE, gap_s=0.005)
    outcome, result = await relay(response, send, write_timeout_s=0.05)
    assert outcome is Outcome.COMPLETED
    assert result.client_wait_s >= 40 * 0.005


async def test_a_plain_answer_past_the_hold_goes_out_as_it_comes() -> None:
    piece = b"x" * (PLAIN_HOLD_BYTES // 4)
    chunks = [
        b'{"choices":[{"text":"',
        *([piece] * 12),
        b'"}],"usage":{"prompt_tokens":2,"completion_tokens":5}}',
    ]
    sizes: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sizes.append(len(message["body"]))

    outcome, result = await relay(ScriptedResponse(chunks, b"application/json"), send)
    assert outcome is Outcome.COMPLETED
    assert sum(sizes) == sum(map(len, chunks))
    assert max(sizes) <= PLAIN_HOLD_BYTES + len(piece) + len(chunks[0])  # never the whole
    assert result.usage == Usage(2, 5)

    small: list[dict[str, Any]] = []

    async def keep(message: dict[str, Any]) -> None:
        small.append(message)

    await relay(ScriptedResponse([b'{"usage":', b'{"completion_tokens":1}}'], b"application/json"), keep)
    assert [m.get("body") for m in small[1:]] == [b'{"usage":{"completion_tokens":1}}']  # held, sent whole
