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
import types
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import (
    GatewayError,
    InvalidRequestError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
    to_http,
)
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


# Given the failed connection's error, the upstream and request to try instead, or None.
Reroute = Callable[[UpstreamConnectError], "tuple[Upstream, UpstreamRequest] | None"]


class RelayObserver(Protocol):
    """Receives the relay's events. All calls happen on the event loop and must not block."""

    def on_first_byte(self, now: float) -> None: ...

    def on_tokens(self, choice: int, tokens: int) -> None: ...

    def on_finish(self, outcome: Outcome, result: RelayResult, now: float) -> None:
        """Called exactly once per relay, whatever happened."""
        ...


class _ClientGoneError(Exception):
    pass


@types.coroutine
def _resumed(steps: Generator[Any, None, object], waiting_for: Any) -> Generator[Any, None, object]:
    """Go on awaiting `steps`, an awaitable's iterator whose first step yielded `waiting_for`:
    hand that to the task, then resume the rest as `await` would (`yield from`), passing
    anything thrown in while it waits (the task's cancellation) to the awaitable."""
    while True:
        try:
            yield waiting_for
        except BaseException as exc:
            try:
                waiting_for = steps.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        return (yield from steps)


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
        reroute: Reroute | None = None,
    ) -> None:
        # Starlette's Response.__init__ is bypassed: this class writes its own messages.
        self._reroute = reroute
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
        started = self._loop.time()
        waiting = self._start_write(send, message)
        if waiting is not None:
            await self._wait_for_client(*waiting, started)

    def _start_write(
        self, send: Send, message: dict[str, object]
    ) -> tuple[Generator[Any, None, object], Any] | None:
        """Run the first step of a write: None when it is done, else the write's steps and what
        they wait for (see `_wait_for_client`).

        The first step is run here rather than awaited, to learn whether the write waits for
        the client (the server's flow control holds it while the client's window is full) or
        goes straight to the transport, which is almost every write. Only a wait is the client's
        time: a write that never waits but took long (another thread held the GIL meanwhile) is
        not. (A probe callback per write said the same and cost more than the rest of the write.)
        """
        steps = send(message).__await__()
        try:
            return steps, steps.send(None)
        except StopIteration:
            return None
        except OSError as exc:  # a server that reports the client gone instead of dropping
            raise _ClientGoneError() from exc

    async def _wait_for_client(
        self, steps: Generator[Any, None, object], waiting_for: Any, started: float
    ) -> None:
        """The rest of a write that waits, begun at `started`: its time is the client's."""
        loop = self._loop
        self._sending_since = started
        if self._watchdog is None:
            # One timer per relay at a time, armed only by a write that waits.
            self._watchdog = loop.call_at(started + self._timeouts.client_write_s, self._check_write)
        try:
            await _resumed(steps, waiting_for)
        except OSError as exc:
            raise _ClientGoneError() from exc
        finally:
            self._sending_since = None
            self._result.client_wait_s += loop.time() - started

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
            try:
                upstream = await self._upstream_client.send(self._request, first_byte_deadline)
            except UpstreamConnectError as exc:
                # The backend never saw it: another one of the model may take it, once.
                elsewhere = self._reroute(exc) if self._reroute is not None else None
                if elsewhere is None:
                    raise
                self._upstream_client, self._request = elsewhere
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
        between_chunks_s = self._timeouts.between_chunks_s
        on_tokens = self._observer.on_tokens
        try:
            chunk = await upstream.receive(first_byte_deadline)
            if chunk:
                self._first_byte()
            while chunk:
                growth = tally.feed(chunk)
                if len(growth) == 1:
                    on_tokens(*growth[0])
                elif growth:
                    # One call per choice and chunk: a chunk of many events (a relay that fell
                    # behind, several tokens per engine step) costs the ledger one growth.
                    per_choice: dict[int, int] = {}
                    for choice, tokens in growth:
                        per_choice[choice] = per_choice.get(choice, 0) + tokens
                    for choice, tokens in per_choice.items():
                        on_tokens(choice, tokens)
                # What _send does, without a coroutine of its own per chunk.
                started = loop.time()
                waiting = self._start_write(
                    send, {"type": "http.response.body", "body": chunk, "more_body": True}
                )
                if waiting is not None:
                    await self._wait_for_client(*waiting, started)
                chunk = await upstream.receive(loop.time() + between_chunks_s)
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
