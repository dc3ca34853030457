"""The runner against real local servers: streams, refusals, deadlines, the schedule, failures.

`bench.instant` serves well-formed streams; `raw_server` below answers with whatever bytes a
test scripts (cut streams, garbage, refusals, silence) and notes when the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest

from bench import runner
from bench.cli import run_on_fast_loop
from bench.instant import InstantBackend, serving
from bench.payload import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    TENANT_HEADER,
    TTFT_HEADER,
    PayloadOptions,
    PlannedRequest,
    plan_requests,
)
from bench.records import RequestRecord
from bench.report import Outcome, classify, summarize
from bench.runner import (
    DISPATCHER_THREAD,
    ChunkInfo,
    Endpoint,
    RunOptions,
    read_chunk,
    retry_after_seconds,
    run_target,
    serialise,
    wait_idle,
)
from bench.workload import RequestSpec

# --------------------------------------------------------------------------------------------
# Pure helpers


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (
            {"choices": [{"index": 0, "text": " a", "token_ids": [5, 6], "finish_reason": None}]},
            ChunkInfo(tokens=2),
        ),
        ({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}, ChunkInfo(tokens=1)),
        # vLLM's EOS chunk: empty text, the finish reason, and (when asked) the EOS id
        (
            {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
            ChunkInfo(tokens=1, finish_reason="stop"),
        ),
        (
            {"choices": [{"index": 0, "text": "", "token_ids": [2], "finish_reason": "stop"}]},
            ChunkInfo(tokens=1, finish_reason="stop"),
        ),
        # chat opens with a role-only delta that carries no token
        ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, ChunkInfo(tokens=0)),
        ({"choices": [{"index": 0, "delta": {"content": "hi"}}]}, ChunkInfo(tokens=1)),
        (
            {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}},
            ChunkInfo(usage_completion_tokens=9, usage_prompt_tokens=7),
        ),
        ({"error": {"message": "engine died"}}, ChunkInfo(error="engine died")),
    ],
)
def test_read_chunk(payload: dict[str, Any], expected: ChunkInfo) -> None:
    assert read_chunk(payload) == expected


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after": "2", "retry-after-ms": "1500"}, 1.5),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
    ],
)
def test_retry_after_seconds(headers: dict[str, str], expected: float | None) -> None:
    assert retry_after_seconds(headers) == expected


@pytest.mark.parametrize(
    ("url", "host", "port", "host_header", "prefix", "tls"),
    [
        ("http://example.test:8000", "example.test", 8000, "example.test:8000", "", False),
        ("https://example.test", "example.test", 443, "example.test", "", True),
        ("http://[::1]:9/gateway/", "::1", 9, "[::1]:9", "/gateway", False),
        ("http://user:secret@127.0.0.1", "127.0.0.1", 80, "127.0.0.1", "", False),
    ],
)
def test_endpoint_from_url(url: str, host: str, port: int, host_header: str, prefix: str, tls: bool) -> None:
    endpoint = Endpoint.from_url(url)
    assert (endpoint.host, endpoint.port, endpoint.host_header, endpoint.path_prefix) == (
        host,
        port,
        host_header,
        prefix,
    )
    assert (endpoint.tls is not None) == tls


@pytest.mark.parametrize("url", ["ftp://example.test", "localhost:8000", "http://"])
def test_endpoint_refuses_what_is_not_http(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        Endpoint.from_url(url)


def test_serialised_request_is_what_a_server_reads() -> None:
    (planned,) = _plan([RequestSpec(0.0, 3, 4, tenant="a")])
    _, data = serialise(Endpoint.from_url("http://example.test:8000/gateway"), planned)
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    head = server.next_event()
    assert isinstance(head, h11.Request)
    assert head.method == b"POST"
    assert head.target == b"/gateway/v1/completions"
    headers = dict(head.headers)
    assert headers[b"host"] == b"example.test:8000"
    # the server closes first, so that TIME_WAIT stays on its side
    assert headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"application/json"
    assert headers[TENANT_HEADER.lower().encode()] == b"a"
    body = server.next_event()
    assert isinstance(body, h11.Data)
    assert bytes(body.data) == planned.body
    assert isinstance(server.next_event(), h11.EndOfMessage)


# --------------------------------------------------------------------------------------------
# Servers


@pytest.fixture
async def fake() -> AsyncIterator[tuple[InstantBackend, str]]:
    app = InstantBackend(token_interval_s=0.002)
    async with serving(app) as url:
        yield app, url


@dataclass
class RawServer:
    """What a scripted server saw: each request's head, and when each client left."""

    url: str = ""
    heads: list[bytes] = field(default_factory=list)
    left_at: list[float] = field(default_factory=list)
    left: asyncio.Event = field(default_factory=asyncio.Event)

    async def until_client_leaves(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        self.left_at.append(time.monotonic())
        self.left.set()


Reply = Callable[[RawServer, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(reply: Reply, tls: ssl.SSLContext | None = None) -> AsyncIterator[RawServer]:
    """Reads each request whole, then lets `reply` write raw bytes; closes after it."""
    state = RawServer()
    handlers: set[asyncio.Task[Any]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            state.heads.append(head)
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            await reader.readexactly(int(length.group(1)) if length else 0)
            await reply(state, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    state.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield state
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


# A body that ends when the server closes (no length, not chunked)
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
TOKEN = _event({"choices": [{"index": 0, "text": " x", "finish_reason": None}]})
LAST = _event({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"
WHOLE_STREAM = STREAM_HEAD + TOKEN + LAST + USAGE + DONE


async def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


def _plan(specs: list[RequestSpec], **options: Any) -> tuple[PlannedRequest, ...]:
    opts = PayloadOptions(model="instant", eos_token_id=2, max_tokens_cap=64, **options)
    return plan_requests(specs, ["one two three"] * len(specs), opts)


async def _one(url: str, options: RunOptions | None = None, **plan_options: Any) -> RequestRecord:
    (record,) = (
        await run_target(url, _plan([RequestSpec(0.0, 3, 2)], **plan_options), options or RunOptions())
    ).records
    return record


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --------------------------------------------------------------------------------------------
# Well-formed streams and refusals


async def test_streams_are_counted_and_headers_sent(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    specs = [
        RequestSpec(0.00, 3, 5, tenant="a", priority="high"),
        RequestSpec(0.01, 3, 1, tenant="b"),
        RequestSpec(0.02, 3, 12),
    ]
    plan = _plan(specs, deadline_s=30.0, ttft_slo_s=2.0, headers=(("X-Extra", "yes"),))
    result = await run_target(url, plan, RunOptions(deadline_s=30.0, metrics_urls=(f"{url}/metrics",)))
    assert [r.output_tokens for r in result.records] == [5, 1, 12]
    assert [r.streamed_tokens for r in result.records] == [5, 1, 12]
    assert [r.usage_completion_tokens for r in result.records] == [5, 1, 12]
    assert all(classify(r, 30.0) is Outcome.OK for r in result.records)
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s for r in result.records)  # type: ignore[operator]
    assert len(result.records[2].gaps_s) == 11
    assert [r.tenant for r in result.records] == ["a", "b", None]
    assert result.max_in_flight >= 1
    first, second, third = app.headers_seen
    assert (first[TENANT_HEADER.lower()], first[PRIORITY_HEADER.lower()]) == ("a", "high")
    assert PRIORITY_HEADER.lower() not in second
    assert TENANT_HEADER.lower() not in third
    assert all(h[DEADLINE_HEADER.lower()] == "30000" for h in app.headers_seen)
    assert all(h[TTFT_HEADER.lower()] == "2000" for h in app.headers_seen)
    assert all(h["x-extra"] == "yes" for h in app.headers_seen)
    # the fake's generated-token counter moved by exactly what the client counted
    summary = summarize(result, offered_s=1.0, deadline_s=30.0)
    assert result.vllm_sources == (f"{url}/metrics",)
    assert summary.backend_generation_tokens == 18 == summary.client_output_tokens
    assert summary.backend_tokens_wasted == 0


async def test_refusals_are_shed_with_their_retry_after(fake: tuple[InstantBackend, str]) -> None:
    _, url = fake
    for status, outcome in ((429, Outcome.SHED), (503, Outcome.SHED), (500, Outcome.ERROR)):
        record = await _one(url, headers=(("X-Fake-Status", str(status)),))
        assert record.status == status
        assert classify(record, None) is outcome
        assert record.retry_after_s == (1.0 if status in (429, 503) else None)
        assert record.retry_after_header == ("1" if status in (429, 503) else None)
        assert record.retry_after_ms_header == ("1000" if status in (429, 503) else None)
        assert record.error is not None
        assert "fake refusal" in record.error


async def test_a_refusal_without_a_body_keeps_its_reason() -> None:
    async def refuse(_: RawServer, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _write(writer, b"HTTP/1.1 503 Busy Now\r\nretry-after: 2\r\ncontent-length: 0\r\n\r\n")

    async with raw_server(refuse) as server:
        record = await _one(server.url)
    assert (record.status, record.error) == (503, "Busy Now")
    assert (record.retry_after_s, record.retry_after_header, record.retry_after_ms_header) == (2.0, "2", None)
    assert classify(record, None) is Outcome.SHED


async def test_https(certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)

    async def stream(_: RawServer, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _write(writer, WHOLE_STREAM)

    async with raw_server(stream, tls=server_side) as server:
        # The system's trust store does not know this certificate: an error, not a crash.
        untrusted = await _one(server.url)
        assert untrusted.status is None
        assert untrusted.error is not None
        assert "SSLCertVerificationError" in untrusted.error
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        record = await _one(server.url)
    assert record.error is None
    assert record.finished
    assert (record.streamed_tokens, record.output_tokens, record.finish_reason) == (2, 2, "stop")


def test_the_runner_works_on_uvloop() -> None:
    # kvgate bench reads on uvloop, whose add_reader and timers are its own.
    async def scenario() -> tuple[RequestRecord, ...]:
        async with serving(InstantBackend(token_interval_s=0.001)) as url:
            result = await run_target(
                url, _plan([RequestSpec(0.0, 3, 4), RequestSpec(0.01, 3, 3)]), RunOptions()
            )
            return result.records

    records = run_on_fast_loop(scenario())
    assert [(r.finished, r.output_tokens, r.error) for r in records] == [(True, 4, None), (True, 3, None)]


# --------------------------------------------------------------------------------------------
# Giving up


async def test_the_client_gives_up_at_its_deadline(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    plan = _plan([RequestSpec(0.0, 3, 50)], headers=(("X-Fake-Token-Interval-Ms", "50"),))
    (record,) = (await run_target(url, plan, RunOptions(deadline_s=0.3))).records
    assert record.gave_up
    assert not record.finished
    assert classify(record, 0.3) is Outcome.LATE
    assert record.e2e_s == pytest.approx(0.3, abs=0.1)
    assert 0 < record.streamed_tokens < 50
    # the connection was closed, so the server stopped generating (as vLLM aborts)
    async with httpx.AsyncClient() as client:
        readings = await wait_idle(client, [f"{url}/metrics"], timeout_s=5.0)
    assert readings[f"{url}/metrics"].running == 0
    assert app.generated_tokens < 50


async def test_giving_up_closes_the_connection() -> None:
    received_at: list[float] = []

    async def trickle(server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received_at.append(time.monotonic())
        await _write(writer, STREAM_HEAD + TOKEN)
        await server.until_client_leaves(reader)

    async with raw_server(trickle) as server:
        record = await _one(server.url, RunOptions(deadline_s=0.3))
        await asyncio.wait_for(server.left.wait(), 5.0)
    assert record.gave_up
    assert record.streamed_tokens == 1
    assert record.error is None
    assert server.left_at[0] - received_at[0] == pytest.approx(0.3, abs=0.2)


async def test_a_silent_connection_times_out() -> None:
    async def silence(server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _write(writer, STREAM_HEAD + TOKEN)
        await server.until_client_leaves(reader)

    async with raw_server(silence) as server:
        record = await _one(server.url, RunOptions(request_timeout_s=0.2))
        await asyncio.wait_for(server.left.wait(), 5.0)
    assert not record.gave_up
    assert record.error == "ReadTimeout: nothing received for 0.2 s"
    assert record.e2e_s == pytest.approx(0.2, abs=0.15)


async def test_after_a_whole_response_the_client_waits_for_the_server_to_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "CLOSE_GRACE_S", 0.05)
    left_before_second: list[int] = []

    async def keep_open(
        server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        left_before_second.append(len(server.left_at))
        body = TOKEN + LAST + DONE
        await _write(writer, b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await server.until_client_leaves(reader)

    async with raw_server(keep_open) as server:
        plan = _plan([RequestSpec(0.0, 3, 2), RequestSpec(0.5, 3, 2)])
        result = await run_target(server.url, plan, RunOptions())
    assert all(r.finished and r.error is None for r in result.records)
    # the record did not wait for the close; the close came after the grace period
    assert result.records[0].e2e_s is not None
    assert result.records[0].e2e_s < 0.05 + 0.2
    assert left_before_second == [0, 1]


# --------------------------------------------------------------------------------------------
# Broken responses and unreachable servers


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("sent", "server_waits", "status", "streamed", "error"),
    [
        # a proper end of the body, but no [DONE]
        (STREAM_HEAD + TOKEN, False, 200, 1, "stream ended without [DONE]"),
        # a chunk that is not JSON: the client stops reading and hangs up
        (STREAM_HEAD + TOKEN + b"data: {not json\n\n", True, 200, 1, "bad chunk: '{not json'"),
        (STREAM_HEAD + b"data: [1, 2]\n\n", True, 200, 0, "bad chunk: '[1, 2]'"),
        # an error reported inside the stream, as vLLM does when the engine fails
        (STREAM_HEAD + TOKEN + _event({"error": {"message": "engine died"}}), True, 200, 1, "engine died"),
        # cut in the middle of a chunk
        (
            CHUNKED_HEAD + b"%x\r\n%s\r\n" % (len(TOKEN), TOKEN) + b"40\r\ndata: {",
            False,
            200,
            1,
            "RemoteProtocolError: peer closed connection without sending complete message body",
        ),
        # not HTTP at all
        (b"SPAM SPAM SPAM\r\n\r\n", False, None, 0, "RemoteProtocolError"),
        # closed without a word
        (b"", False, None, 0, "RemoteProtocolError"),
    ],
)
async def test_broken_responses_are_errors(
    sent: bytes, server_waits: bool, status: int | None, streamed: int, error: str
) -> None:
    async def reply(server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _write(writer, sent)
        if server_waits:
            await server.until_client_leaves(reader)

    async with raw_server(reply) as server:
        record = await _one(server.url)
        if server_waits:  # the client hung up at once rather than at its timeout
            await asyncio.wait_for(server.left.wait(), 5.0)
    assert record.status == status
    assert record.streamed_tokens == streamed
    assert not record.finished
    assert record.error is not None
    assert record.error.startswith(error)
    assert classify(record, None) is Outcome.ERROR


async def test_a_refused_connection_is_an_error_record() -> None:
    record = await _one(f"http://127.0.0.1:{_free_port()}")
    assert record.status is None
    assert record.error is not None
    assert record.error.startswith("ConnectionRefusedError")
    assert classify(record, None) is Outcome.ERROR


async def test_a_header_http_cannot_carry_is_an_error_record(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    record = await _one(url, headers=(("X-Broken", "a\r\nInjected: yes"),))
    assert record.error is not None
    assert record.error.startswith("bad request")
    assert app.requests_seen == 0


async def test_a_failing_record_callback_fails_the_run(fake: tuple[InstantBackend, str]) -> None:
    _, url = fake

    def refuse(_: RequestRecord) -> None:
        raise RuntimeError("progress display broke")

    with pytest.raises(RuntimeError, match="progress display broke"):
        await run_target(url, _plan([RequestSpec(0.0, 3, 1)]), RunOptions(), on_record=refuse)
    assert not _dispatcher_threads()


# --------------------------------------------------------------------------------------------
# The schedule


async def test_requests_start_on_schedule(fake: tuple[InstantBackend, str]) -> None:
    _, url = fake
    specs = [RequestSpec(0.02 * i, 3, 2) for i in range(20)]
    result = await run_target(url, _plan(specs), RunOptions())
    assert [r.scheduled_s for r in result.records] == pytest.approx([s.arrival_s for s in specs])
    # generous: the machine is shared; the self-check measures the real figure
    assert max(r.start_lag_s for r in result.records) < 0.05
    assert result.duration_s >= specs[-1].arrival_s


class JumpingClock:
    """Monotonic time plus an offset a test can push forward, as if time had passed."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


async def test_a_late_start_is_measured_as_late() -> None:
    clock = JumpingClock()

    async def stream(server: RawServer, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(server.heads) == 1:
            clock.offset_s += 1.0  # the first request's reply "takes" a second
        await _write(writer, WHOLE_STREAM)

    async with raw_server(stream) as server:
        plan = _plan([RequestSpec(0.0, 3, 2), RequestSpec(0.3, 3, 2)])
        first, second = (await run_target(server.url, plan, RunOptions(), clock=clock)).records
    assert (first.scheduled_s, second.scheduled_s) == pytest.approx((0.0, 0.3))
    assert first.start_lag_s < 0.1
    assert first.e2e_s is not None
    assert first.e2e_s >= 1.0
    # due 0.3 s in, started when the clock said 1.3 s or so
    assert 0.6 < second.start_lag_s < 1.2
    assert second.finished


async def test_the_schedule_holds_while_the_reader_is_busy(fake: tuple[InstantBackend, str]) -> None:
    """The first record's callback holds the event loop for `burn_s`; requests due meanwhile
    still start on time, because the dispatcher thread does not wait for the loop."""
    _, url = fake
    burn_s = 0.6
    burns: list[float] = []

    def burn_once(_: RequestRecord) -> None:
        if not burns:
            burns.append(burn_s)
            until = time.monotonic() + burn_s
            while time.monotonic() < until:
                pass

    specs = [RequestSpec(0.0, 3, 1)] + [RequestSpec(0.02 * i, 3, 1) for i in range(1, 40)]
    records = (await run_target(url, _plan(specs), RunOptions(), on_record=burn_once)).records
    first = records[0]
    assert first.e2e_s is not None
    burn_from = first.scheduled_s + first.start_lag_s + first.e2e_s
    during = [r for r in records[1:] if burn_from < r.scheduled_s < burn_from + burn_s]
    assert len(during) >= 15
    assert all(r.finished for r in records)
    lags = sorted(r.start_lag_s for r in during)
    assert lags[len(lags) // 2] < 0.01
    assert lags[-1] < burn_s / 10


def _dispatcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == DISPATCHER_THREAD]


async def test_a_cancelled_run_stops_its_dispatcher(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    interval_before = sys.getswitchinterval()
    some_done = asyncio.Event()

    def note(_: RequestRecord) -> None:
        if app.requests_seen >= 3:
            some_done.set()

    specs = [RequestSpec(0.02 * i, 3, 1) for i in range(500)]
    run = asyncio.create_task(run_target(url, _plan(specs), RunOptions(), on_record=note))
    await asyncio.wait_for(some_done.wait(), 10.0)
    assert sys.getswitchinterval() == runner.DISPATCH_SWITCH_INTERVAL_S
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert not _dispatcher_threads()
    assert sys.getswitchinterval() == interval_before
    assert app.requests_seen < 500


# --------------------------------------------------------------------------------------------
# Metrics


async def test_wait_idle_polls_until_the_engine_is_idle(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    app.running = 2
    ticks = iter(range(100))

    async with httpx.AsyncClient() as client:
        readings = await wait_idle(
            client, [f"{url}/metrics"], timeout_s=0.0, clock=lambda: float(next(ticks))
        )
        assert readings[f"{url}/metrics"].running == 2  # gave up at once: timeout 0
        app.running = 0
        readings = await wait_idle(client, [f"{url}/metrics"], timeout_s=1e9)
        assert readings[f"{url}/metrics"].busy == 0
