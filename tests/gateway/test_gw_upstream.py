"""The upstream hop: HttpUpstream's keep-alive pool against scripted HTTP/1.1 servers on real
sockets (bodies by length, chunked and by close; broken, stalled and malformed backends;
timeouts; the pool's limit and expiry), and the httpx adapter."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop
from conftest import wait_until

from gateway.errors import UpstreamConnectError, UpstreamError, UpstreamTimeoutError
from gateway.upstream import (
    HttpUpstream,
    HttpxUpstream,
    Upstream,
    UpstreamClosedError,
    UpstreamRequest,
    UpstreamResponse,
)

POST = UpstreamRequest(b"POST", b"/v1/completions", [(b"content-type", b"application/json")], b'{"x":1}')


@dataclass
class Received:
    request_line: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class Scripted:
    """A server whose every connection runs `handler(reader, writer, connection_number)`."""

    url: str
    connections: int = 0
    requests: list[Received] = field(default_factory=list)


async def read_request(reader: asyncio.StreamReader, server: Scripted) -> Received | None:
    """One request (Content-Length bodies only, which is all HttpUpstream sends); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    request_line, *lines = head[:-4].split(b"\r\n")
    headers = [(name.lower(), value) for name, _, value in (line.partition(b": ") for line in lines)]
    length = int(dict(headers).get(b"content-length", b"0"))
    received = Received(request_line, headers, await reader.readexactly(length))
    server.requests.append(received)
    return received


def response(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        len(body),
        extra,
        body,
    )


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def scripted(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter, Scripted, int], Awaitable[None]],
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[Scripted]:
    tasks: set[asyncio.Task[None]] = set()
    server_state = Scripted("")

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server_state.connections += 1
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer, server_state, server_state.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    scheme = "https" if tls is not None else "http"
    server_state.url = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield server_state
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def serve_json(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
) -> None:
    """Keep-alive: answer every request with a small JSON body."""
    while await read_request(reader, server) is not None:
        writer.write(response(b'{"ok":%d}' % len(server.requests)))
        await writer.drain()


def pool(url: str, **overrides: Any) -> HttpUpstream:
    options: dict[str, Any] = {"connect_timeout_s": 2.0, "write_timeout_s": 2.0, "max_connections": 4}
    return HttpUpstream(url, **{**options, **overrides})


async def read_all(response_: UpstreamResponse) -> bytes:
    body = bytearray()
    while chunk := await response_.receive():
        body += chunk
    return bytes(body)


async def exchange(upstream: Upstream, request: UpstreamRequest = POST) -> tuple[int, bytes]:
    answer = await upstream.send(request)
    try:
        return answer.status, await read_all(answer)
    finally:
        await answer.aclose()


# -- bodies and keep-alive --------------------------------------------------------------------


async def test_connections_are_kept_alive_and_reused() -> None:
    async with scripted(serve_json) as server:
        upstream = pool(server.url)
        results = [await exchange(upstream) for _ in range(3)]
        assert results == [(200, b'{"ok":1}'), (200, b'{"ok":2}'), (200, b'{"ok":3}')]
        assert server.connections == 1
        assert (upstream.open_connections, upstream.idle_connections) == (1, 1)
        await upstream.aclose()
        assert upstream.open_connections == 0


async def test_concurrent_requests_open_connections_up_to_the_limit() -> None:
    async with scripted(serve_json) as server:
        upstream = pool(server.url, max_connections=3)
        answers = await asyncio.gather(*(upstream.send(POST) for _ in range(3)))
        assert server.connections == 3
        for answer in answers:
            await read_all(answer)
            await answer.aclose()
        assert upstream.idle_connections == 3
        await upstream.aclose()


async def test_request_line_and_headers_as_sent() -> None:
    async with scripted(serve_json) as server:
        upstream = pool(f"{server.url}/prefix/")
        request = UpstreamRequest(
            b"POST", b"/v1/chat/completions", [(b"x-one", b"1"), (b"authorization", b"Bearer k")], b"{}"
        )
        await exchange(upstream, request)
        await exchange(upstream, UpstreamRequest(b"GET", b"/metrics?x=1", []))
        post, get = server.requests
        host = server.url.removeprefix("http://").encode()
        assert post.request_line == b"POST /prefix/v1/chat/completions HTTP/1.1"
        assert post.headers == [
            (b"host", host),
            (b"content-length", b"2"),
            (b"x-one", b"1"),
            (b"authorization", b"Bearer k"),
        ]
        assert post.body == b"{}"
        assert get.request_line == b"GET /prefix/metrics?x=1 HTTP/1.1"
        assert get.headers == [(b"host", host)]  # no body, no length
        await upstream.aclose()


async def test_a_line_break_in_a_header_is_refused_before_anything_is_sent() -> None:
    async with scripted(serve_json) as server:
        upstream = pool(server.url)
        smuggling = UpstreamRequest(b"POST", b"/v1/completions", [(b"x-a", b"1\r\nx-b: 2")], b"{}")
        with pytest.raises(ValueError, match="line break"):
            await upstream.send(smuggling)
        with pytest.raises(ValueError, match="line break"):
            await upstream.send(UpstreamRequest(b"POST", b"/v1\n", [], b"{}"))
        assert server.connections == 0
        assert upstream.open_connections == 0


async def test_chunked_body_arrives_decoded_and_the_connection_is_reused() -> None:
    parts = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b"data: [DONE]\n\n"]
    release = asyncio.Event()

    async def stream(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        while await read_request(reader, server) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            writer.write(chunked(parts[0])[:-5])  # the first chunk, without the terminator
            await writer.drain()
            await release.wait()
            writer.write(chunked(*parts[1:]))
            await writer.drain()

    async with scripted(stream) as server:
        upstream = pool(server.url)
        answer = await upstream.send(POST)
        assert answer.status == 200
        assert (b"transfer-encoding", b"chunked") in answer.headers
        assert await answer.receive() == parts[0]  # relayed before the rest exists
        release.set()
        assert await read_all(answer) == b"".join(parts[1:])
        await answer.aclose()
        assert await exchange(upstream) == (200, b"".join(parts))
        assert server.connections == 1
        await upstream.aclose()


async def test_body_delimited_by_close_ends_at_close_and_is_not_reused() -> None:
    async def until_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ")
        await writer.drain()
        writer.write(b"world")

    async with scripted(until_close) as server:
        upstream = pool(server.url)
        assert await exchange(upstream) == (200, b"hello world")
        assert upstream.open_connections == 0
        assert await exchange(upstream) == (200, b"hello world")
        assert server.connections == 2
        await upstream.aclose()


async def test_interim_1xx_answers_are_skipped() -> None:
    async def early_hints(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(
            b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + response(b"{}", extra=b"x-real: 1\r\n")
        )
        await writer.drain()
        await reader.read()

    async with scripted(early_hints) as server:
        upstream = pool(server.url)
        answer = await upstream.send(POST)
        assert answer.status == 200
        assert (b"x-real", b"1") in answer.headers
        assert all(name != b"link" for name, _ in answer.headers)
        assert await read_all(answer) == b"{}"
        await answer.aclose()
        await upstream.aclose()


async def test_a_reader_that_lags_pauses_the_backend_and_gets_every_byte() -> None:
    payload = bytes(range(256)) * 4096 * 8  # 8 MiB
    sent = asyncio.Event()

    async def bulk(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for start in range(0, len(payload), 65536):
            writer.write(chunked(payload[start : start + 65536])[:-5])
        writer.write(b"0\r\n\r\n")
        sent.set()
        await writer.drain()
        await reader.read()

    async with scripted(bulk) as server:
        upstream = pool(server.url)
        answer = await upstream.send(POST)
        await sent.wait()
        connection = answer._connection  # type: ignore[attr-defined]
        await wait_until(lambda: connection._reading_paused, what="reading to pause")
        assert connection._buffered <= 2 * 1024 * 1024  # far from the 8 MiB on offer
        assert await read_all(answer) == payload
        assert not connection._reading_paused
        await answer.aclose()
        assert upstream.idle_connections == 1
        await upstream.aclose()


# -- broken backends --------------------------------------------------------------------------


async def test_close_in_the_middle_of_the_body_is_an_error_after_the_bytes_that_came() -> None:
    async def truncated(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()

    async with scripted(truncated) as server:
        upstream = pool(server.url)
        answer = await upstream.send(POST)
        assert await answer.receive() == b"0123456789"
        with pytest.raises(UpstreamClosedError, match="middle of its response") as caught:
            await answer.receive()
        assert caught.value.response_started
        await answer.aclose()
        assert upstream.open_connections == 0
        await upstream.aclose()


async def test_a_stale_keep_alive_connection_is_retried_once_on_a_new_one() -> None:
    async def closes_when_idle(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        if n == 1:  # answers once, then drops the connection on the next request unanswered
            await read_request(reader, server)
            writer.write(response(b"first"))
            await writer.drain()
            await read_request(reader, server)
            return
        await serve_json(reader, writer, server, n)

    async with scripted(closes_when_idle) as server:
        upstream = pool(server.url)
        assert await exchange(upstream) == (200, b"first")
        assert await exchange(upstream) == (200, b'{"ok":3}')  # the dropped one was seen as #2
        assert server.connections == 2
        await upstream.aclose()


async def test_no_retry_on_a_fresh_connection_or_once_the_response_began() -> None:
    async def drops(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)

    async with scripted(drops) as server:
        upstream = pool(server.url)
        with pytest.raises(UpstreamClosedError, match="before responding"):
            await upstream.send(POST)
        assert server.connections == 1

    async def half_answers_the_second(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(response(b"{}"))
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
        await writer.drain()

    async with scripted(half_answers_the_second) as server:
        upstream = pool(server.url)
        await exchange(upstream)
        with pytest.raises(UpstreamClosedError) as caught:
            await upstream.send(POST)
        assert caught.value.response_started
        assert server.connections == 1
        assert upstream.open_connections == 0
        await upstream.aclose()


async def test_a_malformed_response_is_an_upstream_error() -> None:
    async def garbage(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(b"SPDY/9 banana\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with scripted(garbage) as server:
        upstream = pool(server.url)
        with pytest.raises(UpstreamError, match="malformed"):
            await upstream.send(POST)
        assert upstream.open_connections == 0
        await upstream.aclose()


async def test_releasing_an_unfinished_response_closes_its_connection() -> None:
    # How vLLM learns that a client left mid-stream: the connection closes, it aborts.
    backend_saw_close = asyncio.Event()

    async def endless(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(b"data: 1\n\n")[:-5])
        await writer.drain()
        assert await reader.read() == b""
        backend_saw_close.set()

    async with scripted(endless) as server:
        upstream = pool(server.url)
        answer = await upstream.send(POST)
        assert await answer.receive() == b"data: 1\n\n"
        await answer.aclose()
        await answer.aclose()  # idempotent
        async with asyncio.timeout(5):
            await backend_saw_close.wait()
        assert upstream.open_connections == 0
        await upstream.aclose()


async def test_cancelling_the_wait_for_the_head_closes_the_connection() -> None:
    backend_saw_close = asyncio.Event()

    async def silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        assert await reader.read() == b""
        backend_saw_close.set()

    async with scripted(silent) as server:
        upstream = pool(server.url)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):  # what the relay's first-byte deadline does
                await upstream.send(POST)
        async with asyncio.timeout(5):
            await backend_saw_close.wait()
        assert upstream.open_connections == 0
        await upstream.aclose()


async def test_deadlines_for_the_head_and_for_body_bytes() -> None:
    loop = asyncio.get_running_loop()
    hung_up = asyncio.Event()
    release = asyncio.Event()

    async def dawdles(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        if n == 2:  # the second connection answers its head, one chunk, then nothing
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(b"one")[:-5])
            await writer.drain()
            await release.wait()
            writer.write(chunked(b"two"))
            await writer.drain()
        assert await reader.read() == b""
        hung_up.set()

    async with scripted(dawdles) as server:
        upstream = pool(server.url)
        with pytest.raises(TimeoutError):
            await upstream.send(POST, deadline=loop.time() + 0.1)
        async with asyncio.timeout(5):
            await hung_up.wait()
        assert upstream.open_connections == 0

        hung_up.clear()
        answer = await upstream.send(POST, deadline=loop.time() + 5)
        assert await answer.receive(loop.time() + 5) == b"one"
        with pytest.raises(TimeoutError):
            await answer.receive(loop.time() + 0.1)
        release.set()  # what comes later is still delivered to a reader that waits again
        assert await answer.receive(loop.time() + 5) == b"two"
        await answer.aclose()
        assert upstream.idle_connections == 1
        await upstream.aclose()
        async with asyncio.timeout(5):
            await hung_up.wait()


async def test_a_read_times_out_at_its_own_deadline_not_an_earlier_reads() -> None:
    # One timer serves every read of a connection: it fires at the first deadline, finds the
    # waiting read's deadline later, and waits again; a read past its deadline still ends.
    loop = asyncio.get_running_loop()
    send_next = asyncio.Queue[bytes]()

    async def on_demand(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while part := await send_next.get():
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with scripted(on_demand) as server:
        upstream = pool(server.url)
        answer = await upstream.send(POST, deadline=loop.time() + 5)
        send_next.put_nowait(b"one")
        assert await answer.receive(loop.time() + 0.05) == b"one"
        slow = loop.call_later(0.2, send_next.put_nowait, b"two")  # past the first read's deadline
        assert await answer.receive(loop.time() + 3600) == b"two"
        slow.cancel()
        # Not the hour of the read before: the guard would end this one first.
        async with asyncio.timeout(10):
            with pytest.raises(TimeoutError):
                await answer.receive(loop.time() + 0.1)
        send_next.put_nowait(b"three")
        assert await answer.receive(loop.time() + 5) == b"three"
        send_next.put_nowait(b"")
        assert await answer.receive(loop.time() + 5) == b""
        await answer.aclose()
        assert upstream.idle_connections == 1
        await upstream.aclose()


# -- timeouts and the pool's limit ------------------------------------------------------------


async def test_refused_connection_is_an_upstream_error_and_frees_its_slot() -> None:
    async with scripted(serve_json) as server:
        url = server.url
    upstream = pool(url, max_connections=1)
    for _ in range(2):
        with pytest.raises(UpstreamError, match="cannot connect") as caught:
            await upstream.send(POST)
        assert not isinstance(caught.value, UpstreamTimeoutError)
    assert upstream.open_connections == 0


async def test_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    async def never_connects(*args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(asyncio.get_running_loop(), "create_connection", never_connects)
    upstream = pool("http://127.0.0.1:9", connect_timeout_s=0.05)
    with pytest.raises(UpstreamTimeoutError, match="connecting"):
        await upstream.send(POST)
    assert upstream.open_connections == 0


async def test_write_timeout_when_the_backend_stops_reading() -> None:
    async def never_reads(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        await asyncio.Event().wait()

    async with scripted(never_reads) as server:
        upstream = pool(server.url, write_timeout_s=0.2)
        huge = UpstreamRequest(b"POST", b"/v1/completions", [], b"x" * (64 << 20))
        with pytest.raises(UpstreamTimeoutError, match="sending the request"):
            await upstream.send(huge)
        assert upstream.open_connections == 0
        await upstream.aclose()


async def test_a_full_pool_makes_requests_wait_then_time_out() -> None:
    finish = asyncio.Event()

    async def slow(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Scripted, n: int
    ) -> None:
        while await read_request(reader, server) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
            await writer.drain()
            await finish.wait()
            writer.write(b"cd")
            await writer.drain()

    async with scripted(slow) as server:
        upstream = pool(server.url, max_connections=1, connect_timeout_s=0.1)
        first = await upstream.send(POST)
        with pytest.raises(UpstreamTimeoutError, match="no connection"):
            await upstream.send(POST)
        # A waiter gets the connection as soon as it is released.
        waiting = asyncio.create_task(exchange(upstream))
        await wait_until(lambda: len(upstream._waiters) == 1, what="a waiter")
        finish.set()
        assert await read_all(first) == b"abcd"
        await first.aclose()
        assert await waiting == (200, b"abcd")
        assert server.connections == 1
        await upstream.aclose()


async def test_idle_connections_expire() -> None:
    now = [0.0]
    async with scripted(serve_json) as server:
        upstream = pool(server.url, keepalive_expiry_s=4.0, clock=lambda: now[0])
        await exchange(upstream)
        now[0] = 3.0
        await exchange(upstream)
        assert server.connections == 1
        now[0] = 7.5
        await exchange(upstream)
        assert server.connections == 2
        assert upstream.open_connections == 1
        await upstream.aclose()


async def test_https_backend(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    async with scripted(serve_json, tls=server_side) as server:
        trusting = pool(server.url, ssl_context=ssl.create_default_context(cafile=str(cert)))
        assert [await exchange(trusting) for _ in range(2)] == [(200, b'{"ok":1}'), (200, b'{"ok":2}')]
        assert server.connections == 1
        await trusting.aclose()
        # The system's trust store does not know this certificate: no connection, a 502.
        with pytest.raises(UpstreamError, match="cannot connect"):
            await pool(server.url).send(POST)


def test_the_pool_works_on_uvloop() -> None:
    # kvgate serve runs on uvloop, whose transports are not asyncio's classes.
    async def scenario() -> list[tuple[int, bytes]]:
        async with scripted(serve_json) as server:
            upstream = pool(server.url)
            results = [await exchange(upstream) for _ in range(2)]
            assert server.connections == 1
            await upstream.aclose()
            return results

    assert uvloop.run(scenario()) == [(200, b'{"ok":1}'), (200, b'{"ok":2}')]


# -- the httpx adapter ------------------------------------------------------------------------


async def test_httpx_adapter_relays_status_headers_and_body() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        assert message["body"] == b'{"x":1}'
        await send({"type": "http.response.start", "status": 201, "headers": [(b"X-Mixed-Case", b"1")]})
        await send({"type": "http.response.body", "body": b"part1", "more_body": True})
        await send({"type": "http.response.body", "body": b"part2"})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app)) as client:
        upstream = HttpxUpstream(client, "http://backend/")
        status, body = await exchange(upstream)
        assert (status, body) == (201, b"part1part2")
        answer = await upstream.send(POST)
        assert (b"x-mixed-case", b"1") in answer.headers
        await answer.aclose()


async def test_httpx_adapter_wraps_transport_errors() -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slow":
            raise httpx.ReadTimeout("slow", request=request)
        raise httpx.ConnectError("refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(fail)) as client:
        upstream = HttpxUpstream(client, "http://backend")
        with pytest.raises(UpstreamConnectError, match="cannot connect") as refused:
            await upstream.send(POST)
        assert not isinstance(refused.value, UpstreamTimeoutError)
        with pytest.raises(UpstreamTimeoutError):
            await upstream.send(UpstreamRequest(b"GET", b"/slow", []))
