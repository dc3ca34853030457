"""The shell: send a planned workload to one target on schedule and record what happens.

Two threads share the work. A dispatcher thread only starts requests: it sleeps until a
request's scheduled time, notes the start on the injected clock, opens a TCP connection
(blocking socket, TCP_NODELAY, plus the TLS handshake for https), writes the whole HTTP/1.1
request (serialised with h11 before the wait) and hands the connected socket with its h11
state to the event loop. The event loop (uvloop when the caller runs one) reads every
response: it feeds the bytes to h11, splits the server-sent events, parses the chunks and
keeps the per-request notes, enforces deadlines, and scrapes the `/metrics` URLs meanwhile.

Why a thread: an engine emits a token to every running request in the same step, so the
client receives hundreds of chunks at once. When one event loop both read and started
requests, a request whose time fell inside such a burst began only after every chunk queued
before it was handled, tens of milliseconds late with 500+ open streams. The dispatcher
instead is woken by the OS at the scheduled time and needs only the GIL: `run_target` lowers
the interpreter's switch interval to `DISPATCH_SWITCH_INTERVAL_S` for the run (and restores
it after), so a busy reader hands the GIL over within about that long. Each call that
releases the GIL (connect, send) may cost the dispatcher one more interval before the request
is written; the start lag counts to the moment just before connecting. (`bench.selfcheck
--sim`, 1,100+ open streams at 200 requests/s: p99 start lag 75 ms with one loop, 2-4 ms
with the thread.)

A connection cannot pass from a client in one thread to a client in another's event loop,
so the bench speaks HTTP/1.1 itself through h11, the protocol library underneath httpx.
Reading a chunk that way also costs about a third of what httpx and httpx_sse took.

Each request has a connection of its own, as independent clients would, and says
`Connection: close`: the server closes first, so TIME_WAIT stays on its side and a long run
cannot use up the client's ephemeral ports (the reader waits up to `CLOSE_GRACE_S` for that
close before closing its end). TTFT therefore includes a TCP handshake (tens of microseconds
on loopback) and, for https, a TLS handshake, both made in the dispatcher thread. The loop
watches the handed-over socket with `add_reader` and reads it itself, which works the same
for a plain and an already wrapped TLS socket (an asyncio transport cannot adopt the latter).
A connect or write that blocks (a server that neither accepts nor reads) holds up the
requests scheduled after it, bounded by `CONNECT_TIMEOUT_S` / `WRITE_TIMEOUT_S`; they show
as start lag, so the figure stays honest.

A request's own deadline (`deadline_s` after it started) and a silent connection
(`request_timeout_s`) are loop timers: the client closes the connection, as a real client
that gives up would, and vLLM aborts the request. Failures (refused, reset, TLS, a malformed
or cut response) become the record's `error`. Everything measured uses one injected
monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx

from bench.payload import PlannedRequest
from bench.promtext import Reading, parse_reading
from bench.records import MetricPoint, RequestRecord, RunResult
from bench.sse import EventDataDecoder

Clock = Callable[[], float]

# The first request is scheduled this far after the run starts, so that it is not late merely
# because the loop was busy starting the sampler and the dispatcher.
SCHEDULE_LEAD_S = 0.05
# How long a thread that wants the GIL waits for it during a run (Python's default: 5 ms).
DISPATCH_SWITCH_INTERVAL_S = 0.0005
CONNECT_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 2.0
# After a complete response, how long the reader waits for the server to close first.
CLOSE_GRACE_S = 1.0
RECV_BYTES = 65536
# Error bodies are kept for the record, cut to this many characters.
ERROR_TEXT_CHARS = 300
USER_AGENT = "kvgate-bench"
DISPATCHER_THREAD = "kvgate-bench-dispatcher"


# --------------------------------------------------------------------------------------------
# Pure helpers (tested without a server)


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What one SSE data payload says: tokens it carries, finish reason, usage, error."""

    tokens: int = 0
    finish_reason: str | None = None
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    error: str | None = None


def read_chunk(payload: Mapping[str, Any]) -> ChunkInfo:
    """Interpret one parsed chunk of an OpenAI-style stream (completions or chat).

    A choice carries `len(token_ids)` tokens when vLLM returns token ids; otherwise one token
    when it has text or content or ends the stream (the EOS chunk has empty text), and none for
    chat's opening role-only delta.
    """
    error = payload.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, Mapping) else error
        return ChunkInfo(error=str(message)[:ERROR_TEXT_CHARS])
    tokens = 0
    finish: str | None = None
    for choice in payload.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        ids = choice.get("token_ids")
        reason = choice.get("finish_reason")
        if isinstance(ids, list):
            tokens += len(ids)
        else:
            delta = choice.get("delta")
            text = choice.get("text")
            if text is None and isinstance(delta, Mapping):
                text = delta.get("content") or delta.get("reasoning_content")
            if text or reason is not None:
                tokens += 1
        if reason is not None:
            finish = str(reason)
    usage = payload.get("usage")
    completion = prompt = None
    if isinstance(usage, Mapping):
        if isinstance(usage.get("completion_tokens"), int):
            completion = int(usage["completion_tokens"])
        if isinstance(usage.get("prompt_tokens"), int):
            prompt = int(usage["prompt_tokens"])
    return ChunkInfo(tokens, finish, completion, prompt)


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """The retry delay a shed response asked for: `retry-after-ms` (the OpenAI SDK's
    precise form) when present, else `retry-after` in seconds (HTTP dates are ignored)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) * scale
        except ValueError:
            continue
    return None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where requests go: `host`/`port` to connect to, the `Host` header, a path prefix from
    the base URL, and a TLS context for https (None for http)."""

    host: str
    port: int
    host_header: str
    path_prefix: str
    tls: ssl.SSLContext | None

    @classmethod
    def from_url(cls, base: str) -> Endpoint:
        """ValueError for anything but an http or https URL with a host."""
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"target {base!r} is not an http:// or https:// URL")
        https = parts.scheme == "https"
        return cls(
            host=parts.hostname,
            port=parts.port or (443 if https else 80),
            host_header=parts.netloc.rpartition("@")[2],
            path_prefix=parts.path.rstrip("/"),
            # Building a context loads the CA bundle (some 20 ms): once per run.
            tls=ssl.create_default_context() if https else None,
        )


def serialise(endpoint: Endpoint, request: PlannedRequest) -> tuple[h11.Connection, bytes]:
    """The bytes of `request` as HTTP/1.1 and the client-side h11 state that sent them (the
    reader goes on with it). h11.LocalProtocolError for a header HTTP cannot carry."""
    conn = h11.Connection(h11.CLIENT)
    head = h11.Request(
        method="POST",
        target=endpoint.path_prefix + request.path,
        headers=[
            ("Host", endpoint.host_header),
            ("User-Agent", USER_AGENT),
            ("Accept", "*/*"),
            ("Connection", "close"),
            ("Content-Length", str(len(request.body))),
            *request.headers,
        ],
    )
    data = conn.send(head) + conn.send(h11.Data(data=request.body)) + conn.send(h11.EndOfMessage())
    return conn, data


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS]


# --------------------------------------------------------------------------------------------
# One request


@dataclass(slots=True)
class _Observation:
    """Mutable notes taken while a request is in flight; frozen into a record at the end."""

    status: int | None = None
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    streamed: int = 0
    usage_completion: int | None = None
    usage_prompt: int | None = None
    retry_after_s: float | None = None
    retry_after_header: str | None = None
    retry_after_ms_header: str | None = None
    finish_reason: str | None = None
    error: str | None = None

    def on_tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            self.gaps.append(now - self.last_token_at)
        self.last_token_at = now
        self.streamed += count

    def to_record(
        self,
        request: PlannedRequest,
        *,
        scheduled_at: float,
        run_start: float,
        started: float,
        ended: float,
        gave_up: bool,
    ) -> RequestRecord:
        spec = request.spec
        return RequestRecord(
            index=request.index,
            tenant=spec.tenant,
            priority=spec.priority,
            scheduled_s=scheduled_at - run_start,
            start_lag_s=started - scheduled_at,
            prompt_tokens_wanted=spec.prompt_tokens,
            output_tokens_wanted=spec.output_tokens,
            status=self.status,
            finished=self.finished and not gave_up,
            gave_up=gave_up,
            ttft_s=None if self.first_token_at is None else self.first_token_at - started,
            e2e_s=ended - started,
            output_tokens=self.usage_completion if self.usage_completion is not None else self.streamed,
            streamed_tokens=self.streamed,
            usage_completion_tokens=self.usage_completion,
            usage_prompt_tokens=self.usage_prompt,
            gaps_s=tuple(self.gaps),
            retry_after_s=self.retry_after_s,
            retry_after_header=self.retry_after_header,
            retry_after_ms_header=self.retry_after_ms_header,
            finish_reason=self.finish_reason,
            error=self.error,
        )


class _Stream:
    """One response, read on the event loop from a socket the dispatcher connected.

    The record is taken exactly once: at the end of the response, at the first failure, or
    when the deadline passes; the socket is closed exactly once, after the server closed
    (or at once when the client gives up or the response is broken).
    """

    __slots__ = (
        "_conn",
        "_deadline",
        "_decoder",
        "_error_body",
        "_fd",
        "_gave_up",
        "_idle",
        "_last_read_at",
        "_linger",
        "_obs",
        "_reason",
        "_recorded",
        "_run",
        "_sock",
        "_tls_sock",
        "request",
        "scheduled_at",
        "started",
    )

    def __init__(
        self,
        run: _Run,
        sock: socket.socket,
        conn: h11.Connection,
        request: PlannedRequest,
        scheduled_at: float,
        started: float,
    ) -> None:
        self._run = run
        self._sock: socket.socket | None = sock
        self._tls_sock = sock if isinstance(sock, ssl.SSLSocket) else None
        self._fd = sock.fileno()
        self._conn = conn
        self.request = request
        self.scheduled_at = scheduled_at
        self.started = started
        self._obs = _Observation()
        self._decoder = EventDataDecoder()
        self._error_body = bytearray()
        self._reason = ""
        self._recorded = False
        self._gave_up = False
        self._last_read_at = 0.0
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None

    def open(self) -> None:
        run = self._run
        loop = run.loop
        assert self._sock is not None
        self._sock.setblocking(False)
        loop.add_reader(self._fd, self._on_readable)
        self._last_read_at = loop.time()
        deadline_s = run.options.deadline_s
        if deadline_s is not None:
            delay = self.started + deadline_s - run.clock()
            self._deadline = loop.call_later(max(0.0, delay), self._give_up)
        self._idle = loop.call_later(run.options.request_timeout_s, self._check_idle)

    def close(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        self._run.loop.remove_reader(self._fd)
        sock.close()
        for timer in (self._deadline, self._idle, self._linger):
            if timer is not None:
                timer.cancel()
        self._run.open_streams.discard(self)

    # -- reading

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            data = sock.recv(RECV_BYTES)
            # OpenSSL may hold decrypted bytes that the kernel no longer reports as readable.
            while data and self._tls_sock is not None and self._tls_sock.pending():
                data += self._tls_sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            # Nothing to read after all (a TLS record not yet whole); pending() bytes are
            # already decrypted, so reading them never ends here with data in hand.
            return
        except OSError as exc:
            self._fail(_describe(exc))
            return
        self._last_read_at = self._run.loop.time()
        self._receive(data)

    def _receive(self, data: bytes) -> None:
        """Feed bytes (b"" at the end of the connection) to h11 and act on its events."""
        conn = self._conn
        try:
            conn.receive_data(data)
            while self._sock is not None:
                event = conn.next_event()
                if isinstance(event, h11.Data):
                    self._on_body(event.data)
                elif event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                elif isinstance(event, h11.Response):
                    self._on_response(event)
                elif isinstance(event, h11.EndOfMessage):
                    self._on_complete()
                elif isinstance(event, h11.ConnectionClosed):
                    self.close()
        except h11.ProtocolError as exc:
            self._fail(_describe(exc))
            return
        if not data and self._sock is not None:
            self._fail("RemoteProtocolError: connection closed")

    def _on_response(self, response: h11.Response) -> None:
        obs = self._obs
        obs.status = response.status_code
        self._reason = response.reason.decode("latin-1")
        if response.status_code != 200:
            wanted = (b"retry-after", b"retry-after-ms")
            headers = {
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in response.headers
                if name in wanted
            }
            obs.retry_after_s = retry_after_seconds(headers)
            obs.retry_after_header = headers.get("retry-after")
            obs.retry_after_ms_header = headers.get("retry-after-ms")

    def _on_body(self, data: bytes) -> None:
        if self._recorded:
            return
        if self._obs.status != 200:
            room = 4 * ERROR_TEXT_CHARS - len(self._error_body)
            if room > 0:
                self._error_body += data[:room]
            return
        for event_data in self._decoder.feed(data):
            self._on_event(event_data)
            if self._recorded:
                return

    def _on_event(self, data: str) -> None:
        obs = self._obs
        if data == "[DONE]":
            obs.finished = True
            return
        if not data or obs.finished:
            return
        try:
            payload = json.loads(data)
        except ValueError:
            payload = None
        if not isinstance(payload, Mapping):
            self._fail(f"bad chunk: {data[:80]!r}")
            return
        info = read_chunk(payload)
        if info.error is not None:
            self._fail(info.error)
            return
        obs.on_tokens(info.tokens, self._run.clock())
        if info.finish_reason is not None:
            obs.finish_reason = info.finish_reason
        if info.usage_completion_tokens is not None:
            obs.usage_completion = info.usage_completion_tokens
        if info.usage_prompt_tokens is not None:
            obs.usage_prompt = info.usage_prompt_tokens

    def _on_complete(self) -> None:
        obs = self._obs
        if obs.status != 200:
            obs.error = self._error_body.decode("utf-8", "replace")[:ERROR_TEXT_CHARS] or self._reason
        elif not obs.finished:
            obs.error = "stream ended without [DONE]"
        self._record()
        # The server closes next (we asked for it); closing first would leave TIME_WAIT here.
        self._linger = self._run.loop.call_later(CLOSE_GRACE_S, self.close)

    # -- endings

    def _record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        for timer in (self._deadline, self._idle):
            if timer is not None:
                timer.cancel()
        run = self._run
        run.add(
            self._obs.to_record(
                self.request,
                scheduled_at=self.scheduled_at,
                run_start=run.run_start,
                started=self.started,
                ended=run.clock(),
                gave_up=self._gave_up,
            )
        )

    def _fail(self, error: str) -> None:
        if not self._recorded:
            self._obs.error = error
            self._record()
        self.close()

    def _give_up(self) -> None:
        self._gave_up = True
        self._record()
        self.close()

    def _check_idle(self) -> None:
        timeout_s = self._run.options.request_timeout_s
        idle_s = self._run.loop.time() - self._last_read_at
        if idle_s >= timeout_s:
            self._fail(f"ReadTimeout: nothing received for {timeout_s:g} s")
        else:
            self._idle = self._run.loop.call_later(timeout_s - idle_s, self._check_idle)


# --------------------------------------------------------------------------------------------
# One run: the loop's side and the dispatcher thread


class _Run:
    """The event loop's bookkeeping of one run. Only the loop thread touches it, except the
    start counters, which only the dispatcher writes (`note_started`) and `unadopted`, a
    dict that the dispatcher fills and the loop empties (single operations, atomic)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        planned: int,
        run_start: float,
        options: RunOptions,
        clock: Clock,
        on_record: Callable[[RequestRecord], None] | None,
    ) -> None:
        self.loop = loop
        self.planned = planned
        self.run_start = run_start
        self.options = options
        self.clock = clock
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self.done: asyncio.Future[None] = loop.create_future()
        self.open_streams: set[_Stream] = set()
        self.unadopted: dict[int, socket.socket] = {}
        self.started = 0
        self.max_in_flight = 0
        self.closing = False
        if planned == 0:
            self.done.set_result(None)

    def note_started(self) -> None:
        """Dispatcher thread: one more request started. A record counts as ended once it is
        in `records`, which only grows, so the difference read here is never too small."""
        self.started += 1
        self.max_in_flight = max(self.max_in_flight, self.started - len(self.records))

    def adopt(
        self,
        sock: socket.socket,
        conn: h11.Connection,
        request: PlannedRequest,
        scheduled_at: float,
        started: float,
    ) -> None:
        self.unadopted.pop(request.index, None)
        if self.closing:
            sock.close()
            return
        stream = _Stream(self, sock, conn, request, scheduled_at, started)
        self.open_streams.add(stream)
        stream.open()

    def failed(
        self, request: PlannedRequest, scheduled_at: float, started: float, ended: float, error: str
    ) -> None:
        record = _Observation(error=error).to_record(
            request,
            scheduled_at=scheduled_at,
            run_start=self.run_start,
            started=started,
            ended=ended,
            gave_up=False,
        )
        self.add(record)

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.on_record is not None:
            try:
                self.on_record(record)
            except Exception as exc:
                self.crashed(exc)
                return
        if len(self.records) == self.planned and not self.done.done():
            self.done.set_result(None)

    def crashed(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def close(self) -> None:
        """After the dispatcher stopped: close every socket still open."""
        self.closing = True
        for stream in list(self.open_streams):
            stream.close()
        for sock in self.unadopted.values():
            sock.close()
        self.unadopted.clear()


class _Dispatcher:
    """The thread that starts every request of `plan` at its time (see the module docstring)."""

    def __init__(
        self,
        endpoint: Endpoint,
        plan: Sequence[PlannedRequest],
        run: _Run,
        clock: Clock,
    ) -> None:
        self._endpoint = endpoint
        self._plan = plan
        self._run = run
        self._loop = run.loop
        self._clock = clock
        self._stop = threading.Event()
        self._addresses: list[Any] | None = None
        self._thread = threading.Thread(target=self._main, name=DISPATCHER_THREAD, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop starting requests (after the one being sent, if any) and wait for the thread."""
        self._stop.set()
        self._thread.join()

    def _main(self) -> None:
        try:
            for request in self._plan:
                if not self._start_on_time(request):
                    return
        except Exception as exc:
            self._loop.call_soon_threadsafe(self._run.crashed, exc)

    def _start_on_time(self, request: PlannedRequest) -> bool:
        """Wait for `request`'s time, then start it; False when told to stop."""
        run = self._run
        scheduled_at = run.run_start + request.spec.arrival_s
        # Serialised while there is time to spare, before the wait.
        try:
            conn, data = serialise(self._endpoint, request)
        except h11.LocalProtocolError as exc:
            conn, data, problem = None, b"", f"bad request: {exc}"
        while (delay := scheduled_at - self._clock()) > 0:
            if self._stop.wait(delay):
                return False
        if self._stop.is_set():
            return False
        started = self._clock()
        run.note_started()
        if conn is not None:
            try:
                sock = self._open(data)
            except OSError as exc:
                problem = _describe(exc)
            else:
                run.unadopted[request.index] = sock
                self._loop.call_soon_threadsafe(run.adopt, sock, conn, request, scheduled_at, started)
                return True
        self._loop.call_soon_threadsafe(run.failed, request, scheduled_at, started, self._clock(), problem)
        return True

    def _open(self, data: bytes) -> socket.socket:
        """A socket connected to the endpoint that has sent `data` (OSError when not)."""
        endpoint = self._endpoint
        sock = self._connect()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls is not None:
                sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
            sock.settimeout(WRITE_TIMEOUT_S)
            sock.sendall(data)
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect(self) -> socket.socket:
        endpoint = self._endpoint
        if self._addresses is None:
            # Resolved once: a lookup per request would cost time and a GIL hand-over.
            self._addresses = socket.getaddrinfo(
                endpoint.host, endpoint.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
            )
        failure: OSError | None = None
        for i, (family, kind, proto, _, address) in enumerate(self._addresses):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect(address)
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            if i:  # try the address that answered first next time
                self._addresses.insert(0, self._addresses.pop(i))
            return sock
        raise failure or OSError(f"no address for {endpoint.host}")


@contextlib.contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


# --------------------------------------------------------------------------------------------
# Metrics


def metrics_url(base: str) -> str:
    """A /metrics URL from a base URL or a full metrics URL."""
    base = base.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


async def scrape(client: httpx.AsyncClient, url: str) -> Reading | None:
    """One scrape; None when the URL does not answer with parseable metrics."""
    try:
        response = await client.get(url, timeout=METRICS_TIMEOUT_S)
        if response.status_code != 200:
            return None
        return parse_reading(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def scrape_all(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, Reading]:
    readings = await asyncio.gather(*(scrape(client, url) for url in urls))
    return {url: r for url, r in zip(urls, readings, strict=True) if r is not None}


async def wait_idle(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    *,
    timeout_s: float,
    poll_s: float = 0.25,
    clock: Clock = time.monotonic,
) -> dict[str, Reading]:
    """Poll until every URL that reports engine or queue load reports none (no running or
    waiting request, empty kvgate queue), or until `timeout_s`. Returns the last readings."""
    give_up_at = clock() + timeout_s
    while True:
        readings = await scrape_all(client, urls)
        if all(_idle(r) for r in readings.values()) or clock() >= give_up_at:
            return readings
        await asyncio.sleep(poll_s)


def _idle(reading: Reading) -> bool:
    return (reading.busy or 0.0) == 0.0 and (reading.queue_depth or 0.0) == 0.0


class Sampler:
    """Scrapes `urls` every `period_s` until stopped; points carry run-relative times."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Sequence[str],
        period_s: float,
        run_start: float,
        clock: Clock,
    ) -> None:
        self._client = client
        self._urls = list(urls)
        self._period_s = period_s
        self._run_start = run_start
        self._clock = clock
        self.points: list[MetricPoint] = []

    async def run(self) -> None:
        next_at = self._clock()
        while True:
            at = self._clock()
            readings = await scrape_all(self._client, self._urls)
            self.points.extend(MetricPoint(at - self._run_start, url, r) for url, r in readings.items())
            next_at += self._period_s
            await asyncio.sleep(max(0.0, next_at - self._clock()))


# --------------------------------------------------------------------------------------------
# One run


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Knobs of one run. `metrics_urls` are scraped during the run (target and backends);
    `request_timeout_s` bounds a silent connection (with or without a deadline)."""

    deadline_s: float | None = None
    metrics_urls: tuple[str, ...] = ()
    sample_period_s: float = 0.5
    idle_timeout_s: float = 120.0
    request_timeout_s: float = 600.0


async def run_target(
    target: str,
    plan: Sequence[PlannedRequest],
    options: RunOptions,
    *,
    clock: Clock = time.monotonic,
    on_record: Callable[[RequestRecord], None] | None = None,
    label: str | None = None,
) -> RunResult:
    """Replay `plan` against `target` (a base URL such as http://host:8000; ValueError for
    other schemes). `on_record` is called on the event loop as each request ends. The result
    is named `label` (default: the target)."""
    endpoint = Endpoint.from_url(target.rstrip("/").removesuffix("/v1"))
    loop = asyncio.get_running_loop()
    metrics_http = httpx.AsyncClient(timeout=METRICS_TIMEOUT_S)
    try:
        urls = list(dict.fromkeys(options.metrics_urls))
        baseline = await wait_idle(metrics_http, urls, timeout_s=options.idle_timeout_s, clock=clock)
        vllm_sources = tuple(url for url, r in baseline.items() if r.is_vllm)

        run_start = clock() + SCHEDULE_LEAD_S
        sampler = Sampler(metrics_http, urls, options.sample_period_s, run_start, clock)
        sampler_task = asyncio.create_task(sampler.run()) if urls else None
        run = _Run(loop, len(plan), run_start, options, clock, on_record)
        dispatcher = _Dispatcher(endpoint, plan, run, clock)
        try:
            with _switch_interval(DISPATCH_SWITCH_INTERVAL_S):
                dispatcher.start()
                try:
                    await run.done
                finally:
                    dispatcher.stop()
        finally:
            run.close()
            if sampler_task is not None:
                sampler_task.cancel()
                await asyncio.gather(sampler_task, return_exceptions=True)
        duration = clock() - run_start
        final = await wait_idle(metrics_http, urls, timeout_s=options.idle_timeout_s, clock=clock)
        return RunResult(
            target=label or target,
            records=tuple(sorted(run.records, key=lambda r: r.index)),
            samples=tuple(sampler.points),
            baseline=baseline,
            final=final,
            vllm_sources=vllm_sources,
            duration_s=duration,
            max_in_flight=run.max_in_flight,
        )
    finally:
        await metrics_http.aclose()


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Keep the cyclic collector's full (oldest-generation) collections out of a run.

    With hundreds of open streams a full collection walks every live object and stalled the
    event loop for 100-200 ms, which delayed reading (and, before the dispatcher had a thread
    of its own, starting) requests. Long-lived objects built before the run (plan, prompts)
    are frozen out of collection; young generations are still collected as usual (cheap, and
    where the garbage of finished requests is), and a full collection runs when the block ends.
    """
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1_000_000_000)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        gc.collect()


def records_from_jsonl(lines: Iterable[str]) -> list[RequestRecord]:
    return [RequestRecord.from_json(json.loads(line)) for line in lines if line.strip()]
