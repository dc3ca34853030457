"""The streaming forwarder: one admitted request, relayed byte for byte, completed once.

`RelayResponse` is the ASGI response of an admitted request. It owns the upstream exchange
from connect to close: it sends the request to the backend, relays the backend's status,
headers (minus hop-by-hop ones) and body bytes exactly as they come, counts streamed tokens
on a copy (`gateway.sse`) to grow the ledger, and in one `finally` closes the upstream and
reports the outcome exactly once through `RelayObserver.on_finish`:

- finished: the backend's answer was relayed to its end;
- client gone: a task watches the client's side of the connection (`http.disconnect`) and
  cancels the relay; closing the upstream response makes vLLM abort the request and free its
  blocks;
- upstream failed: connect error (502), timeout (504), or a broken stream (an SSE `error` event,
  then end of stream, since the status line has already gone out).

Timeouts are explicit: connect (httpx), first byte (from sending until the first body bytes:
for a non-streaming answer that is the whole generation), and between chunks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, UpstreamError, UpstreamTimeoutError, to_http
from gateway.outcomes import Outcome
from gateway.sse import StreamTally, Usage, body_usage

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
# The server in front of the client adds its own.
_RESPONSE_DROP = HOP_BY_HOP | {"date", "server"}
_KVGATE_PREFIX = "x-kvgate-"


def upstream_headers(
    client_headers: Iterable[tuple[str, str]], *, api_key: str | None
) -> list[tuple[str, str]]:
    """Headers to send upstream: the client's, minus hop-by-hop ones, kvgate's own hints, and
    the client's credentials when the gateway has its own key for the backend."""
    pairs = [(name.lower(), value) for name, value in client_headers]
    named_by_connection = {
        token.strip().lower() for name, value in pairs if name == "connection" for token in value.split(",")
    }
    kept = [
        (name, value)
        for name, value in pairs
        if name not in _REQUEST_DROP
        and name not in named_by_connection
        and not name.startswith(_KVGATE_PREFIX)
        and not (api_key is not None and name == "authorization")
    ]
    # Relayed bytes are counted as they pass: they must not be compressed.
    kept.append(("accept-encoding", "identity"))
    if api_key is not None:
        kept.append(("authorization", f"Bearer {api_key}"))
    return kept


def downstream_headers(response_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    pairs = list(response_headers)
    named_by_connection = {
        token.strip().lower()
        for name, value in pairs
        if name.lower() == b"connection"
        for token in value.split(b",")
    }
    return [
        (name, value)
        for name, value in pairs
        if name.lower().decode("latin-1") not in _RESPONSE_DROP and name.lower() not in named_by_connection
    ]


@dataclass(frozen=True, slots=True)
class RelayTimeouts:
    first_byte_s: float
    between_chunks_s: float


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


class RelayObserver(Protocol):
    """Receives the relay's events. All calls happen on the event loop and must not block."""

    def on_first_byte(self, now: float) -> None: ...

    def on_tokens(self, choice: int, tokens: int) -> None: ...

    def on_finish(self, outcome: Outcome, result: RelayResult, now: float) -> None:
        """Called exactly once per relay, whatever happened."""
        ...


class _ClientGoneError(Exception):
    pass


class RelayResponse(Response):
    """ASGI response that forwards one request upstream. See the module docstring."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        request: httpx.Request,
        observer: RelayObserver,
        timeouts: RelayTimeouts,
        extra_headers: Mapping[str, str],
        clock: Callable[[], float],
    ) -> None:
        # Starlette's Response.__init__ is bypassed: this class writes its own messages.
        self.status_code = 200
        self.background = None
        self._client = client
        self._request = request
        self._observer = observer
        self._timeouts = timeouts
        self._extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra_headers.items()]
        self._clock = clock
        self._result = RelayResult()
        self._upstream: httpx.Response | None = None

    def _now(self) -> float:
        return self._clock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"gone": False, "done": False}

        async def watch_client() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not state["done"]:
                        state["gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.create_task(watch_client())
        outcome = Outcome.UPSTREAM_ERROR
        try:
            try:
                outcome = await self._relay(send)
            except asyncio.CancelledError:
                outcome = Outcome.CLIENT_GONE
                if not state["gone"]:
                    raise  # cancelled from outside (shutdown, test harness): let it propagate
                task.uncancel()
            except _ClientGoneError:
                outcome = Outcome.CLIENT_GONE
            finally:
                state["done"] = True
                watcher.cancel()
        finally:
            try:
                if self._upstream is not None:
                    # Closing the response mid-stream closes the connection: vLLM aborts.
                    await self._upstream.aclose()
            finally:
                self._observer.on_finish(outcome, self._result, self._now())

    async def _send(self, send: Send, message: dict[str, object]) -> None:
        try:
            await send(message)
        except OSError as exc:  # a server that reports the client gone instead of dropping
            raise _ClientGoneError() from exc

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
            async with asyncio.timeout_at(first_byte_deadline):
                upstream = await self._client.send(self._request, stream=True)
        except (TimeoutError, httpx.TimeoutException) as exc:
            await self._send_error(
                send, UpstreamTimeoutError(f"the backend did not answer in time ({type(exc).__name__})")
            )
            return Outcome.UPSTREAM_ERROR
        except httpx.HTTPError as exc:
            await self._send_error(send, UpstreamError(f"cannot reach the backend: {exc!r}"))
            return Outcome.UPSTREAM_ERROR
        self._upstream = upstream
        self._result.status = upstream.status_code
        content_type = upstream.headers.get("content-type", "")
        headers = downstream_headers(upstream.headers.raw) + self._extra
        chunks = upstream.aiter_raw()

        async def next_chunk(deadline: float | None) -> bytes | None:
            try:
                if deadline is not None:
                    async with asyncio.timeout_at(deadline):
                        return await anext(chunks)
                async with asyncio.timeout(self._timeouts.between_chunks_s):
                    return await anext(chunks)
            except StopAsyncIteration:
                return None

        if not content_type.startswith("text/event-stream"):
            # A plain answer (JSON, an error): read it whole first, so a failure on the way can
            # still become a clean 502/504; these bodies are small.
            body = bytearray()
            try:
                chunk = await next_chunk(first_byte_deadline)
                if chunk is not None:
                    self._result.first_byte_at = self._now()
                    self._observer.on_first_byte(self._result.first_byte_at)
                while chunk is not None:
                    body += chunk
                    chunk = await next_chunk(None)
            except (TimeoutError, httpx.TimeoutException):
                await self._send_error(send, UpstreamTimeoutError("the backend stopped answering"))
                return Outcome.UPSTREAM_ERROR
            except httpx.HTTPError as exc:
                await self._send_error(send, UpstreamError(f"the backend broke off its answer: {exc!r}"))
                return Outcome.UPSTREAM_ERROR
            if 200 <= upstream.status_code < 300:
                self._result.usage, self._result.choices = body_usage(bytes(body))
            await self._send(
                send, {"type": "http.response.start", "status": upstream.status_code, "headers": headers}
            )
            await self._send(send, {"type": "http.response.body", "body": bytes(body), "more_body": False})
            return _status_outcome(upstream.status_code)

        self._result.streamed = True
        tally = StreamTally()
        await self._send(
            send, {"type": "http.response.start", "status": upstream.status_code, "headers": headers}
        )
        deadline: float | None = first_byte_deadline
        try:
            while True:
                chunk = await next_chunk(deadline)
                if chunk is None:
                    break
                if deadline is not None:
                    deadline = None
                    self._result.first_byte_at = self._now()
                    self._observer.on_first_byte(self._result.first_byte_at)
                for choice, tokens in tally.feed(chunk):
                    self._observer.on_tokens(choice, tokens)
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
        except (TimeoutError, httpx.TimeoutException, httpx.HTTPError) as exc:
            timed_out = isinstance(exc, TimeoutError | httpx.TimeoutException)
            message = (
                "the backend stopped streaming" if timed_out else f"the backend broke off the stream: {exc!r}"
            )
            self._result.error = message
            event = {
                "error": {
                    "message": message,
                    "type": "upstream_error",
                    "param": None,
                    "code": 504 if timed_out else 502,
                }
            }
            payload = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
            await self._send(send, {"type": "http.response.body", "body": payload, "more_body": False})
            self._finish_tally(tally)
            return Outcome.UPSTREAM_ERROR
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        self._finish_tally(tally)
        if tally.error:
            return Outcome.UPSTREAM_ERROR
        return _status_outcome(upstream.status_code)

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
