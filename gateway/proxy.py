"""The streaming forwarder: one admitted request, relayed byte for byte, completed once.

`RelayResponse` is the ASGI response of an admitted request. It owns the upstream exchange
from connect to close: it sends the request to the backend, relays the backend's status,
headers (minus hop-by-hop ones) and body bytes as they come, counts streamed tokens on a copy
(`gateway.sse`) to grow the ledger, and in one `finally` closes the upstream and reports the
outcome exactly once through `RelayObserver.on_finish`:

- finished: the backend's answer was relayed to its end;
- client gone: a task watches the client's side of the connection (`http.disconnect`) and
  cancels the relay; so does a write to the client that stays blocked for the client write
  timeout (a client that stopped reading: the server's flow control holds `send` while the
  client's TCP window is full). Closing the upstream response makes vLLM abort the request and
  free its blocks;
- upstream failed: connect error (502), timeout (504), or a broken answer. Once bytes have gone
  out the status line cannot change: a stream ends with an SSE `error` event; a plain answer
  ends without its last bytes (the relay returns without completing the response, so the server
  closes the connection and the client sees a truncated answer, never a spliced one).

A plain answer (JSON, an error) is held until it is complete or PLAIN_HOLD_BYTES long, so that a
failure before then is still a clean 502/504; past that it is relayed as it comes, and its usage
is found on the way (`gateway.sse.BodyUsage`): an answer of hundreds of MB (echo, logprobs, many
prompts) costs the relay a bounded amount of memory and no parse of the whole.

The relay measures how long it was blocked writing to the client (`RelayResult.client_wait_s`):
that time is the client's, not the backend's, and the backend's measured pace must not count it.

Timeouts are explicit: connect, pool and write (the `Upstream`'s own, see `gateway.upstream`),
first byte (from sending until the first body bytes: for a non-streaming answer that is the
whole generation), between chunks, and the write to the client.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, InvalidRequestError, UpstreamError, UpstreamTimeoutError, to_http
from gateway.outcomes import Outcome
from gateway.sse import BodyUsage, StreamTally, Usage
from gateway.upstream import READ_HIGH_WATER_BYTES, Upstream, UpstreamRequest, UpstreamResponse

# RFC 9110 section 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Request headers the gateway sets itself or keeps to itself.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"}
_REQUEST_DROP_BYTES = frozenset(name.encode("latin-1") for name in _REQUEST_DROP)
# The server in front of the client adds its own.
_RESPONSE_DROP = frozenset(name.encode("latin-1") for name in HOP_BY_HOP | {"date", "server"})
_KVGATE_PREFIX = b"x-kvgate-"
# Relayed bytes are counted as they pass: they must not be compressed.
_IDENTITY_ENCODING = (b"accept-encoding", b"identity")
# A plain answer up to this size is sent whole once complete (a failure before its end is still
# a clean 502/504); a longer one is relayed as it comes. About what the upstream connection
# buffers for one response anyway: typical answers (a few KiB) are never split.
PLAIN_HOLD_BYTES = READ_HIGH_WATER_BYTES
# The `code` of a request whose client stopped reading (its request log line shows it).
CLIENT_WRITE_TIMEOUT_CODE = "client_write_timeout"


def _connection_tokens(pairs: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names a `Connection` header declares hop-by-hop (RFC 9110, section 7.6.1)."""
    return frozenset(
        token.strip().lower() for name, value in pairs if name == b"connection" for token in value.split(b",")
    )


def upstream_headers(
    client_headers: Iterable[tuple[bytes, bytes]], *, authorization: bytes | None
) -> list[tuple[bytes, bytes]]:
    """Headers to send upstream: the client's (raw ASGI pairs, names lower-case), minus
    hop-by-hop ones and kvgate's own hints, and minus the client's credentials when the gateway
    has its own for the backend (`authorization`, the whole header value)."""
    pairs = list(client_headers)
    named_by_connection = _connection_tokens(pairs)
    kept = [
        (name, value)
        for name, value in pairs
        if name not in _REQUEST_DROP_BYTES
        and name not in named_by_connection
        and not name.startswith(_KVGATE_PREFIX)
        and not (authorization is not None and name == b"authorization")
    ]
    kept.append(_IDENTITY_ENCODING)
    if authorization is not None:
        kept.append((b"authorization", authorization))
    return kept


def downstream_headers(response_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The backend's response headers (names lower-case) minus hop-by-hop ones."""
    pairs = list(response_headers)
    named_by_connection = _connection_tokens(pairs)
    return [
        (name, value)
        for name, value in pairs
        if name not in _RESPONSE_DROP and name not in named_by_connection
    ]


def _header(pairs: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in pairs:
        if key == name:
            return value
    return b""


@dataclass(frozen=True, slots=True)
class RelayTimeouts:
    first_byte_s: float
    between_chunks_s: float
    # One write to the client blocked this long (it stopped reading) ends the relay.
    client_write_s: float


@dataclass(slots=True)
class RelayResult:
    """What the relay saw; handed to `on_finish`."""

    status: int | None = None
    streamed: bool = False
    usage: Usage | None = None
    tokens_by_choice: dict[int, int] = field(default_factory=dict)
    choices: int = 0
    first_byte_at: float | None = None
    error: str | None = None
    # The connection to the backend failed (refused, closed or reset mid-response, garbled): a
    # sign that the backend itself may be gone, unlike a timeout or an HTTP error status.
    backend_failed: bool = False
    # Why it ended as it did, when the outcome alone does not say (e.g. client_write_timeout).
    code: str | None = None
    # Seconds the relay spent in writes to the client that waited for it (the server's flow
    # control holding them while the client's window is full), in all and before the first
    # byte from the backend.
    client_wait_s: float = 0.0
    client_wait_before_first_byte_s: float = 0.0
    # False when the observer found the token counts unusable (see Reservation.on_finish).
    counts_trusted: bool = True


class RelayObserver(Protocol):
    """Receives the relay's events. All calls happen on the event loop and must not block."""

    def on_first_byte(self, now: float) -> None: ...

    def on_tokens(self, choice: int, tokens: int) -> None: ...

    def on_finish(self, outcome: Outcome, result: RelayResult, now: float) -> None:
        """Called exactly once per relay, whatever happened."""
        ...


class _ClientGoneError(Exception):
    pass


class _Ending(enum.Enum):
    """Why the relay's own task was cancelled."""

    GONE = "gone"  # the client disconnected
    STALLED = "stalled"  # a write to the client stayed blocked for the client write timeout


class RelayResponse(Response):
    """ASGI response that forwards one request upstream. See the module docstring."""

    _loop: asyncio.AbstractEventLoop  # the loop it runs on, set when called

    def __init__(
        self,
        *,
        upstream: Upstream,
        request: UpstreamRequest,
        observer: RelayObserver,
        timeouts: RelayTimeouts,
        extra_headers: Mapping[str, str],
        clock: Callable[[], float],
    ) -> None:
        # Starlette's Response.__init__ is bypassed: this class writes its own messages.
        self.status_code = 200
        self.background = None
        self._upstream_client = upstream
        self._request = request
        self._observer = observer
        self._timeouts = timeouts
        self._extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra_headers.items()]
        self._clock = clock
        self._result = RelayResult()
        self._upstream: UpstreamResponse | None = None
        self._task: asyncio.Task[object] | None = None
        self._done = False
        self._ending: _Ending | None = None
        self._sending_since: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._yielded = False

    def _now(self) -> float:
        return self._clock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._loop = asyncio.get_running_loop()

        async def watch_client() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self._end(_Ending.GONE)
                    return

        watcher = asyncio.create_task(watch_client())
        outcome = Outcome.UPSTREAM_ERROR
        try:
            try:
                outcome = await self._relay(send)
            except asyncio.CancelledError:
                outcome = Outcome.CLIENT_GONE
                if self._ending is None:
                    raise  # cancelled from outside (shutdown, test harness): let it propagate
                task.uncancel()
                if self._ending is _Ending.STALLED:
                    self._result.code = CLIENT_WRITE_TIMEOUT_CODE
                    self._result.error = f"the client read nothing for {self._timeouts.client_write_s:g} s"
            except _ClientGoneError:
                outcome = Outcome.CLIENT_GONE
            finally:
                self._done = True
                watcher.cancel()
                if self._watchdog is not None:
                    self._watchdog.cancel()
        finally:
            try:
                if self._upstream is not None:
                    # Closing the response mid-stream closes the connection: vLLM aborts.
                    await self._upstream.aclose()
            finally:
                self._observer.on_finish(outcome, self._result, self._now())

    def _end(self, why: _Ending) -> None:
        """Cancel the relay for `why`, unless it is over or already ending."""
        if not self._done and self._ending is None and self._task is not None:
            self._ending = why
            self._task.cancel()

    async def _send(self, send: Send, message: dict[str, object]) -> None:
        loop = self._loop
        started = loop.time()
        self._sending_since = started
        if self._watchdog is None:
            # One timer per relay at a time, re-armed only while a write is pending: the cost
            # of a timer per chunk would show on the proxy's overhead.
            self._watchdog = loop.call_at(started + self._timeouts.client_write_s, self._check_write)
        # Runs only if `send` gives the loop a turn, i.e. waits for the client (flow control):
        # the time of a send that never yields (its bytes went straight to the transport, or
        # another thread held the GIL meanwhile) is not the client's.
        self._yielded = False
        probe = loop.call_soon(self._mark_yielded)
        try:
            await send(message)
        except OSError as exc:  # a server that reports the client gone instead of dropping
            raise _ClientGoneError() from exc
        finally:
            self._sending_since = None
            if self._yielded:
                self._result.client_wait_s += loop.time() - started
            else:
                probe.cancel()

    def _mark_yielded(self) -> None:
        self._yielded = True

    def _check_write(self) -> None:
        self._watchdog = None
        since = self._sending_since
        if since is None or self._done:
            return  # no write pending: the next one arms the timer again
        due = since + self._timeouts.client_write_s
        if self._loop.time() >= due:
            self._end(_Ending.STALLED)
        else:
            self._watchdog = self._loop.call_at(due, self._check_write)

    async def _send_error(self, send: Send, error: GatewayError) -> None:
        http = to_http(error)
        headers = [(b"content-type", b"application/json"), *self._extra]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in http.headers.items()]
        self._result.status = http.status
        self._result.error = error.message
        await self._send(send, {"type": "http.response.start", "status": http.status, "headers": headers})
        await self._send(send, {"type": "http.response.body", "body": http.body, "more_body": False})

    async def _relay(self, send: Send) -> Outcome:
        loop = asyncio.get_running_loop()
        first_byte_deadline = loop.time() + self._timeouts.first_byte_s
        try:
            upstream = await self._upstream_client.send(self._request, first_byte_deadline)
        except TimeoutError:
            await self._send_error(send, UpstreamTimeoutError("the backend did not answer in time"))
            return Outcome.UPSTREAM_ERROR
        except UpstreamError as exc:  # UpstreamTimeoutError (504) included
            self._result.backend_failed = not isinstance(exc, UpstreamTimeoutError)
            await self._send_error(send, exc)
            return Outcome.UPSTREAM_ERROR
        except ValueError as exc:  # a header that cannot be forwarded (a line break in it)
            await self._send_error(send, InvalidRequestError(f"the request cannot be forwarded: {exc}"))
            return Outcome.REJECTED_INVALID
        self._upstream = upstream
        self._result.status = upstream.status
        raw_headers = upstream.headers
        content_type = _header(raw_headers, b"content-type")
        headers = downstream_headers(raw_headers) + self._extra

        async def next_chunk(deadline: float | None) -> bytes | None:
            if deadline is None:
                deadline = loop.time() + self._timeouts.between_chunks_s
            return await upstream.receive(deadline) or None

        if not content_type.startswith(b"text/event-stream"):
            return await self._relay_plain(send, upstream, headers, next_chunk, first_byte_deadline)

        self._result.streamed = True
        tally = StreamTally()
        await self._send(send, {"type": "http.response.start", "status": upstream.status, "headers": headers})
        deadline: float | None = first_byte_deadline
        try:
            while True:
                chunk = await next_chunk(deadline)
                if chunk is None:
                    break
                if deadline is not None:
                    deadline = None
                    self._first_byte()
                for choice, tokens in tally.feed(chunk):
                    self._observer.on_tokens(choice, tokens)
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
        except (TimeoutError, UpstreamError) as exc:
            if isinstance(exc, UpstreamError) and not isinstance(exc, UpstreamTimeoutError):
                message, code = f"the backend broke off the stream: {exc.message}", 502
                self._result.backend_failed = True
            else:
                message, code = "the backend stopped streaming", 504
            self._result.error = message
            event = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
            payload = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
            await self._send(send, {"type": "http.response.body", "body": payload, "more_body": False})
            self._finish_tally(tally)
            return Outcome.UPSTREAM_ERROR
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        self._finish_tally(tally)
        if tally.error:
            return Outcome.UPSTREAM_ERROR
        return _status_outcome(upstream.status)

    def _first_byte(self) -> None:
        self._result.first_byte_at = self._now()
        self._result.client_wait_before_first_byte_s = self._result.client_wait_s
        self._observer.on_first_byte(self._result.first_byte_at)

    async def _relay_plain(
        self,
        send: Send,
        upstream: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        next_chunk: Callable[[float | None], Awaitable[bytes | None]],
        first_byte_deadline: float,
    ) -> Outcome:
        """Relay a plain answer: held while short (see PLAIN_HOLD_BYTES), then as it comes."""
        usage = BodyUsage()
        held: list[bytes] = []
        held_bytes = 0
        try:
            chunk = await next_chunk(first_byte_deadline)
            if chunk is not None:
                self._first_byte()
            while chunk is not None:
                usage.feed(chunk)
                held.append(chunk)
                held_bytes += len(chunk)
                if held_bytes > PLAIN_HOLD_BYTES:
                    break
                chunk = await next_chunk(None)
        except (TimeoutError, UpstreamTimeoutError):
            await self._send_error(send, UpstreamTimeoutError("the backend stopped answering"))
            return Outcome.UPSTREAM_ERROR
        except UpstreamError as exc:
            self._result.backend_failed = True
            await self._send_error(send, UpstreamError(f"the backend broke off its answer: {exc.message}"))
            return Outcome.UPSTREAM_ERROR
        start = {"type": "http.response.start", "status": upstream.status, "headers": headers}
        await self._send(send, start)
        answer = b"".join(held)
        held.clear()
        if chunk is None:  # complete: in one write, as the backend's Content-Length says
            await self._send(send, {"type": "http.response.body", "body": answer, "more_body": False})
        else:
            await self._send(send, {"type": "http.response.body", "body": answer, "more_body": True})
            del answer
            try:
                while (chunk := await next_chunk(None)) is not None:
                    usage.feed(chunk)
                    await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            except (TimeoutError, UpstreamError) as exc:
                if isinstance(exc, UpstreamError) and not isinstance(exc, UpstreamTimeoutError):
                    self._result.backend_failed = True
                    self._result.error = f"the backend broke off its answer: {exc.message}"
                else:
                    self._result.error = "the backend stopped answering"
                self._result.code = "upstream_truncated"
                # Not completed: the server closes the connection, the client sees it cut short.
                return Outcome.UPSTREAM_ERROR
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        # Read only to learn from: after the client has its answer.
        if 200 <= upstream.status < 300:
            self._result.usage = usage.result()
        return _status_outcome(upstream.status)

    def _finish_tally(self, tally: StreamTally) -> None:
        self._result.usage = tally.usage
        self._result.tokens_by_choice = dict(tally.tokens_by_choice)
        self._result.choices = len(tally.tokens_by_choice)


def _status_outcome(status: int) -> Outcome:
    if 200 <= status < 300:
        return Outcome.COMPLETED
    if 400 <= status < 500:
        return Outcome.REJECTED_BY_BACKEND
    return Outcome.UPSTREAM_ERROR
