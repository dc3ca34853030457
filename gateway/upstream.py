"""The hop from kvgate to its backend: the `Upstream` interface and a keep-alive HTTP/1.1 client.

`Upstream.send` sends one request and returns once the response head has arrived; the
`UpstreamResponse` then hands over the body as it arrives (transfer coding removed, bytes
otherwise untouched) and is released with `aclose`: its connection goes back to the pool when
the body was read to its end, and is closed otherwise, which is how a backend learns that
nobody waits for the answer any more (vLLM then aborts the request and frees its blocks).

Two implementations:

- `HttpUpstream`, the default: a pool of keep-alive connections to one origin, on asyncio
  protocols and httptools' parser (the parser uvicorn uses). Under load httpx took most of
  kvgate's time per request, more as connections multiplied (its pool probes every idle
  connection's socket on every request); a proxy to one backend needs much less than a
  general client.
- `HttpxUpstream` adapts an `httpx.AsyncClient`, so that tests and embedders can route the hop
  through `httpx.ASGITransport` to a backend in the same process.

Errors are the gateway's own (`gateway.errors`): `UpstreamError` (502) when no connection can
be made, the connection breaks or the response is malformed; `UpstreamTimeoutError` (504) when
connecting, waiting for a free connection or sending the request body takes too long. Waiting for
the head and for body bytes is bounded by the caller's deadlines (the relay's first-byte and
between-chunk timeouts), given as event-loop times and answered with the built-in TimeoutError:
the pool arms a timer only when it really has to wait, which asyncio.timeout would do for every
call, and the body reads of a connection share one timer (`_Connection._arm`). Cancelling any
await here is safe too and leaves the pool consistent.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools
import httpx

from gateway.errors import UpstreamConnectError, UpstreamError, UpstreamTimeoutError, failure_reason

# vLLM's server (uvicorn) closes a connection after 5 s idle; dropping ours a little earlier
# keeps the pool from picking a connection the server is closing at that very moment.
DEFAULT_KEEPALIVE_EXPIRY_S = 4.0
# Reading from the backend pauses while this much of its answer waits for a slow client, and
# resumes below the low mark: a stalled client must not make kvgate buffer a whole stream.
READ_HIGH_WATER_BYTES = 256 * 1024
READ_LOW_WATER_BYTES = 64 * 1024
# Bodies up to this size go out in one write with the head (one packet for typical requests).
_JOIN_BODY_MAX_BYTES = 64 * 1024
_NO_BODY_METHODS = frozenset({b"GET", b"DELETE", b"OPTIONS"})


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """One request to the backend. `target` is the path (and query) under the backend's base
    URL; `headers` are lower-case name/value pairs without `host` or `content-length`, which the
    upstream sets itself."""

    method: bytes
    target: bytes
    headers: Sequence[tuple[bytes, bytes]]
    body: bytes = b""


class UpstreamResponse(Protocol):
    """A response whose head has arrived. Used by one task at a time."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        """As received, names lower-cased, hop-by-hop ones included."""
        ...

    async def receive(self, deadline: float | None = None) -> bytes:
        """The body bytes that arrived since the last call, waiting for some if none did (until
        `deadline`, in `loop.time()` seconds: TimeoutError); b"" once the body is complete.
        Raises UpstreamError when the connection breaks."""
        ...

    async def aclose(self) -> None:
        """Release the response: idempotent, never raises. An unfinished body closes the
        connection (the backend sees the client leave)."""
        ...


class Upstream(Protocol):
    """The backend as the relay sees it. Shared by every request of one event loop."""

    async def send(self, request: UpstreamRequest, deadline: float | None = None) -> UpstreamResponse:
        """Send `request`; return when the response head has arrived, or raise TimeoutError at
        `deadline` (`loop.time()` seconds). The caller must `aclose` what it gets. Raises
        UpstreamError / UpstreamTimeoutError (see the module)."""
        ...

    async def aclose(self) -> None:
        """Close idle connections; responses still open close theirs when released."""
        ...


class UpstreamClosedError(UpstreamError):
    """The backend closed the connection before the response was complete."""

    def __init__(self, message: str, *, response_started: bool) -> None:
        super().__init__(message)
        self.response_started = response_started


# -- HttpUpstream -------------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One connection to the backend; httptools calls the `on_*` methods while parsing.

    One exchange at a time (no pipelining). Futures here are wake-up signals that resolve to
    None (or to TimeoutError at the deadline of the task awaiting them); failures of the
    connection are kept in `error` and raised by whoever waits, so that a waiter that went away
    never leaves an unretrieved exception behind.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.exchanges = 0  # responses begun on it: > 0 means the connection is a reused one
        self.idle_since = 0.0
        self._writing_paused = False
        self._drain: asyncio.Future[None] | None = None
        # The deadline of the body read waiting now, and one timer for all the reads of the
        # connection (see `_arm`).
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._reset()

    def _reset(self) -> None:
        self._expecting = False
        self._started = False  # some byte of the response has arrived
        self._informational = False
        self._head: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._reading_paused = False
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the backend switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"the backend sent a malformed response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._expecting and not self.complete and self.error is None:
            if exc is None and self._head_done() and self._delimited_by_close():
                self._finish(keep_alive=False)
            else:
                reason = f": {failure_reason(exc)}" if exc is not None else ""
                started = self._started
                where = "in the middle of its response" if started else "before responding"
                self._fail(
                    UpstreamClosedError(
                        f"the backend closed the connection {where}{reason}", response_started=started
                    )
                )
        self._disarm()
        self._wake_drain()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_drain()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if not self._expecting:  # bytes nobody asked for: this connection cannot be trusted
            self._fail(UpstreamError("the backend sent data without a request"))
            return
        self._started = True
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # 1xx interim answers (103 Early Hints...): the real one follows
            self._informational = True
            return
        self.status = status
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if not body:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if (
            self._buffered > READ_HIGH_WATER_BYTES
            and not self._reading_paused
            and self._transport is not None
        ):
            self._transport.pause_reading()
            self._reading_paused = True
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self._finish(keep_alive=self._parser.should_keep_alive())

    # the exchange

    async def exchange(self, data: Sequence[bytes], write_timeout_s: float, deadline: float | None) -> None:
        """Write one request and wait for its response head; raises UpstreamError, or
        TimeoutError at `deadline`."""
        self._reset()
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            raise UpstreamClosedError(
                "the backend closed the connection before responding", response_started=False
            )
        self._expecting = True
        self._head = self._loop.create_future()
        for part in data:
            transport.write(part)
        if self._writing_paused:
            await self._drained(write_timeout_s, deadline)
        if not self._head.done():
            await self._until(self._head, deadline)
        if self.error is not None:
            raise self.error

    async def _drained(self, timeout_s: float, deadline: float | None) -> None:
        # Only large bodies get here: the cost of asyncio.timeout does not matter.
        write_deadline = self._loop.time() + timeout_s
        until = write_deadline if deadline is None else min(write_deadline, deadline)
        try:
            async with asyncio.timeout_at(until):
                while self._writing_paused and not self.closed:
                    self._drain = self._loop.create_future()
                    await self._drain
        except TimeoutError as exc:
            self.close()
            if until < write_deadline:
                raise  # the caller's own deadline
            raise UpstreamTimeoutError(
                f"sending the request to the backend took over {timeout_s:g} s"
            ) from exc

    async def _until(self, future: asyncio.Future[None], deadline: float | None) -> None:
        """Wait for `future`; TimeoutError at `deadline`, when one is given."""
        if deadline is None:
            await future
            return
        timer = self._loop.call_at(deadline, _expire, future)
        try:
            await future
        finally:
            timer.cancel()

    async def receive(self, deadline: float | None = None) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._reading_paused and self._transport is not None:
                    self._reading_paused = False
                    self._transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._waiter = waiter = self._loop.create_future()
            self._deadline = deadline
            if deadline is not None:
                self._arm(deadline)
            try:
                await waiter
            finally:
                self._waiter = None
                self._deadline = None

    def _arm(self, deadline: float) -> None:
        """Have the timer fire by `deadline`. A stream waits once per chunk, each time with a
        deadline a little later: arming a timer per wait (and cancelling it when the chunk
        comes) cost more than reading the chunk. One timer serves them all: it stays armed for
        the first deadline, and when it fires early for a later one, it is armed again."""
        timer = self._timer
        if timer is not None:
            if self._timer_at <= deadline:
                return
            timer.cancel()
        self._timer = self._loop.call_at(deadline, self._on_timer)
        self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = None
        waiter, deadline = self._waiter, self._deadline
        if waiter is None or deadline is None or waiter.done():
            return  # no read waits (the next one arms the timer again)
        if self._loop.time() >= deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(deadline)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def reusable(self) -> bool:
        transport = self._transport
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.closed
            and transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
        )

    def close(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            # Bytes still queued for a backend that stopped reading would hold a graceful close
            # open forever; abort then.
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()
        self.closed = True
        self._disarm()

    # internals

    def _head_done(self) -> bool:
        return self._head is not None and self._head.done()

    def _delimited_by_close(self) -> bool:
        """True when the response has neither Content-Length nor chunked coding: its body
        ends where the connection does (RFC 9112, section 6.3)."""
        return not any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers)

    def _finish(self, *, keep_alive: bool) -> None:
        self._disarm()
        self.complete = True
        self.keep_alive = keep_alive
        self._expecting = False
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        if self._head is not None and not self._head.done():
            self._head.set_result(None)
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain(self) -> None:
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class _Receive(Protocol):
    def __call__(self, deadline: float | None = None) -> Coroutine[Any, Any, bytes]: ...


class _PooledResponse:
    __slots__ = ("_connection", "_pool", "_released", "receive")

    # The connection's own method (UpstreamResponse.receive): the relay calls it once per
    # chunk, and a method here that only passed the call on cost a coroutine per chunk.
    receive: _Receive

    def __init__(self, pool: HttpUpstream, connection: _Connection) -> None:
        self._pool = pool
        self._connection = connection
        self._released = False
        self.receive = connection.receive

    @property
    def status(self) -> int:
        return self._connection.status

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self._connection.headers

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self._connection)


class HttpUpstream:
    """A keep-alive connection pool to one backend origin (http or https).

    At most `max_connections` connections are open; a request that finds none free waits up to
    `connect_timeout_s` for one. Idle connections are reused newest first (the oldest expire
    after `keepalive_expiry_s`). A request that fails on a reused connection before any byte of
    its response arrived is sent once more on a new connection: that is the connection the
    server closed while idle, just as the request went out, and the server never saw it.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        write_timeout_s: float,
        max_connections: int,
        keepalive_expiry_s: float = DEFAULT_KEEPALIVE_EXPIRY_S,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/").encode("ascii")
        self._host_header = parts.netloc.rpartition("@")[2].encode("idna")
        self._connect_timeout_s = connect_timeout_s
        self._write_timeout_s = write_timeout_s
        self._max_connections = max_connections
        self._keepalive_expiry_s = keepalive_expiry_s
        self._clock = clock
        self._idle: list[_Connection] = []
        self._open = 0  # connections open or being opened
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def send(self, request: UpstreamRequest, deadline: float | None = None) -> UpstreamResponse:
        data = self._serialize(request)
        connection = await self._acquire()
        try:
            await self._exchange(connection, data, deadline)
        except UpstreamClosedError as exc:
            if connection.exchanges == 0 or exc.response_started:
                raise
            connection = await self._acquire()
            await self._exchange(connection, data, deadline)
        return _PooledResponse(self, connection)

    async def _exchange(self, connection: _Connection, data: Sequence[bytes], deadline: float | None) -> None:
        try:
            await connection.exchange(data, self._write_timeout_s, deadline)
        except BaseException:
            self._discard(connection)
            raise
        connection.exchanges += 1

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
            self._open -= 1

    def _serialize(self, request: UpstreamRequest) -> list[bytes]:
        if request.method == b"HEAD":
            raise ValueError("HEAD is not supported: its response has a length but no body")
        lines = [
            request.method,
            b" ",
            self._prefix,
            request.target,
            b" HTTP/1.1\r\nhost: ",
            self._host_header,
        ]
        body = request.body
        line_count = 2  # the request line and host
        if body or request.method not in _NO_BODY_METHODS:
            lines += (b"\r\ncontent-length: ", b"%d" % len(body))
            line_count += 1
        for name, value in request.headers:
            lines += (b"\r\n", name, b": ", value)
        line_count += len(request.headers)
        lines.append(b"\r\n\r\n")
        head = b"".join(lines)
        # The header bytes come from a parsed request, but a line break inside one would let
        # whoever chose it smuggle a second request to the backend: count the line ends.
        if head.count(b"\n") != line_count + 1 or head.count(b"\r") != line_count + 1:
            raise ValueError("a request header or the target contains a line break")
        if len(body) <= _JOIN_BODY_MAX_BYTES:
            return [head + body]
        return [head, body]

    async def _acquire(self) -> _Connection:
        if self._closed:
            raise UpstreamError("the gateway is shutting down")
        while True:
            now = self._clock()
            while self._idle:
                connection = self._idle.pop()
                if not connection.closed and now - connection.idle_since < self._keepalive_expiry_s:
                    return connection
                self._discard(connection)
            if self._open < self._max_connections:
                return await self._connect()
            await self._wait_for_slot()

    async def _connect(self) -> _Connection:
        self._open += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(loop),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except TimeoutError as exc:
            self._slot_freed()
            raise UpstreamTimeoutError(
                f"connecting to the backend took over {self._connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:  # refused, unreachable, name resolution, TLS handshake
            self._slot_freed()
            raise UpstreamConnectError(f"cannot connect to the backend: {failure_reason(exc)}") from exc
        except BaseException:
            self._slot_freed()
            raise
        return protocol

    async def _wait_for_slot(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken just as this task gave up: pass the free slot on
            if isinstance(exc, TimeoutError):
                raise UpstreamTimeoutError(
                    f"no connection to the backend became free within {self._connect_timeout_s:g} s "
                    f"({self._max_connections} in use)"
                ) from exc
            raise

    def _release(self, connection: _Connection) -> None:
        if not self._closed and connection.reusable():
            connection.idle_since = self._clock()
            self._idle.append(connection)
            self._wake_one()
        else:
            self._discard(connection)

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        self._slot_freed()

    def _slot_freed(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


# -- HttpxUpstream ------------------------------------------------------------------------------


class _HttpxResponse:
    __slots__ = ("_chunks", "_response")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._chunks = response.aiter_raw()

    @property
    def status(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        return [(name.lower(), value) for name, value in self._response.headers.raw]

    async def receive(self, deadline: float | None = None) -> bytes:
        try:
            if deadline is None:
                return await anext(self._chunks)
            async with asyncio.timeout_at(deadline):
                return await anext(self._chunks)
        except StopAsyncIteration:
            return b""
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(f"the backend timed out: {failure_reason(exc)}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamClosedError(
                f"the backend broke off its response: {failure_reason(exc)}", response_started=True
            ) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """`Upstream` over an httpx.AsyncClient that the caller owns (and closes)."""

    def __init__(self, client: httpx.AsyncClient, base_url: str) -> None:
        self._client = client
        self._base_url = base_url.rstrip("/")

    async def send(self, request: UpstreamRequest, deadline: float | None = None) -> UpstreamResponse:
        try:
            built = self._client.build_request(
                request.method.decode("ascii"),
                self._base_url + request.target.decode("latin-1"),
                headers=list(request.headers),
                content=request.body,
            )
            async with asyncio.timeout_at(deadline):
                response = await self._client.send(built, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(f"the backend did not answer in time: {failure_reason(exc)}") from exc
        except httpx.ConnectError as exc:
            raise UpstreamConnectError(f"cannot connect to the backend: {failure_reason(exc)}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"cannot reach the backend: {failure_reason(exc)}") from exc
        return _HttpxResponse(response)

    async def aclose(self) -> None:
        """The client belongs to the caller: nothing to close here."""
