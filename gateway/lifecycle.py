"""The `kvgate serve` process around the app: signals, reloads and the HTTP server's limits.

- SIGTERM (or SIGINT) drains: kvgate stops admitting at once (/readyz false; everyone queued,
  and every later arrival, gets 503 with Retry-After), keeps listening for `shutdown_delay_s`
  so that load balancers see it leave, then stops listening and gives the streams in flight
  `shutdown_grace_s` to finish before cancelling them (their reservations are completed either
  way). The process exits 0. A second signal skips the delay.
- SIGHUP, or `POST /admin/reload`, re-reads the settings from where they came from (flags,
  environment, --config file) and applies those that may change at run time
  (`gateway.settings.RELOADABLE_SETTINGS`) without touching a request in flight.
- The HTTP server bounds what a client may send or hold before kvgate sees it: the request
  line and headers together at most `max_header_bytes` (431 beyond, connection closed) and
  complete within `header_timeout_s` (then closed, with 408 when part of a request came); an
  idle connection is closed after CLIENT_KEEPALIVE_TIMEOUT_S; at most `max_client_connections`
  connections are open (503 and closed beyond). Bodies are bounded by the app: `max_body_bytes`
  (413) and `body_timeout_s` (408). See `header_limited_protocol`.
- A response the app started but ended without completing (the relay's `client_write_timeout`
  and `upstream_truncated`, or an exception mid-answer) ends its connection with a reset: the
  kernel's buffers for it are dropped at once and the client cannot take the cut answer for a
  whole one. See `reset_connection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import resource
import signal
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, cast

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from gateway.request_id import new_request_id, request_id_of
from gateway.router import Router
from gateway.settings import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CLIENT_CONNECTIONS,
    ConfigFileError,
    Settings,
    reloaded,
)

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# uvicorn's default: an idle connection between two requests is closed after this long.
CLIENT_KEEPALIVE_TIMEOUT_S = 5
# SO_LINGER on with a zero timeout: close() resets the connection and drops what is unsent.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
# Descriptors kept beside client and backend connections: the listener, the tokenizer's and
# the log's files, the loop's own.
DESCRIPTOR_HEADROOM = 64


@dataclass(frozen=True, slots=True)
class ReloadResult:
    applied: list[str] = field(default_factory=list)
    # Changed in the sources but fixed until a restart; the running values stay.
    needs_restart: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "needs_restart": self.needs_restart, "error": self.error}


class Reloader:
    """Re-reads the settings with `load` and applies what may change at run time. Call on the
    app's event loop."""

    def __init__(self, app: FastAPI, load: Callable[[], Settings]) -> None:
        self._app = app
        self._load = load

    def reload(self) -> ReloadResult:
        try:
            fresh = self._load()
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc']) or 'settings'}: {error['msg']}"
                for error in exc.errors()
            )
            log.error("settings not reloaded, they are invalid: %s", problems)
            return ReloadResult(error=f"invalid settings: {problems}")
        except ConfigFileError as exc:
            log.error("settings not reloaded: %s", exc)
            return ReloadResult(error=str(exc))
        gateway: Router = self._app.state.kvgate
        merged, applied, ignored = reloaded(gateway.settings, fresh)
        gateway.reconfigure(merged)
        self._app.state.settings = merged
        if "log_level" in applied:
            logging.getLogger().setLevel(merged.log_level.upper())
        # Names only: values may be secrets.
        log.warning(
            "settings reloaded: applied %s; changed but kept until a restart: %s",
            ", ".join(applied) or "nothing",
            ", ".join(ignored) or "nothing",
        )
        return ReloadResult(applied=applied, needs_restart=ignored)


def _error_answer(status_line: str, message: str, error_type: str, code: str, *extra: str) -> bytes:
    """A complete HTTP/1.1 answer in OpenAI's error shape that closes the connection, for the
    refusals the server itself makes before (or instead of) a request cycle."""
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}},
        separators=(",", ":"),
    ).encode()
    head = "".join(
        (
            f"HTTP/1.1 {status_line}\r\ncontent-type: application/json\r\n",
            f"content-length: {len(body)}\r\nx-request-id: {new_request_id()}\r\n",
            *(f"{line}\r\n" for line in extra),
            "connection: close\r\n\r\n",
        )
    )
    return head.encode() + body


def reset_connection(transport: asyncio.Transport) -> None:
    """End the connection with a TCP reset. `transport.abort()` alone only drops the transport's
    own buffer: the kernel then still sends what it holds, ends with a FIN (a clean end to a
    client that reads to the end) and, for a client that reads nothing, keeps the socket and up
    to megabytes of its buffer for minutes. Works for asyncio's and uvloop's transports."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Already gone: abort() below is all there is to do.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    transport.abort()


def header_limited_protocol(
    max_header_bytes: int,
    *,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS,
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the bounds on what a client may hold:

    - a request line and headers beyond `max_header_bytes` get 431 (the parser would otherwise
      buffer them without bound);
    - a request line and headers not complete `header_timeout_s` after the connection opened,
      or after the first byte of a later request on it, close the connection: with 408 when
      part of a request came, silently when none did (a browser's idle pre-connection). uvicorn
      itself times only the idle gap between requests (its keep-alive timeout), so a fresh
      connection, or one fed a byte at a time, would otherwise stay open for ever;
    - a response that starts before its request's body is complete (an answer that did not
      need the body, or the app's 408 for a body too slow) says `connection: close` and closes
      the connection: the rest of that body, trickled, would keep it open (every byte resets
      uvicorn's keep-alive timer);
    - beyond `max_client_connections` open connections, a new one gets 503 and is closed
      before anything is read: a flood of idle connections costs a descriptor each for an
      instant, not for the header timeout, and never exhausts the process's descriptors.
      uvicorn's own `limit_concurrency` would count them all the way to their headers and then
      refuse ordinary requests too;
    - a response that the app started and then returned (or raised) without completing ends its
      connection with a reset (`reset_connection`), logged at INFO with its request id, where
      uvicorn would log an ERROR and close the connection gracefully (the request's log line
      says why it ended; an exception is still logged as uvicorn does).

    The app bounds the time a body may take to arrive (`body_timeout_s`, 408) and its size
    (`max_body_bytes`, 413)."""
    from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    if not callable(getattr(HttpToolsProtocol, "_start_asgi_task", None)):
        # Another uvicorn than the one this was written against (0.54): cut answers then end
        # as uvicorn ends them (an ERROR line, a graceful close).
        log.warning("this uvicorn starts requests otherwise: incomplete answers will not be reset")

    class HeaderLimitedProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _in_head = True
        _refused = False
        # Bytes of the next request are awaited (or arriving); its head is timed from the first.
        _awaiting_head = True
        _request_begun = False
        _keep_alive_after_body = True
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_client_connections:
                self._refuse(
                    _error_answer(
                        "503 Service Unavailable",
                        f"kvgate holds {max_client_connections} client connections, its limit; retry",
                        "service_unavailable",
                        "too_many_connections",
                        "retry-after: 1",
                        "x-should-retry: true",
                    )
                )
                return
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._head_bytes = 0
            self._request_begun = True

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._awaiting_head = False
            self._cancel_head_timer()
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if size > max_header_bytes:
                self._refuse_head()  # and no request cycle: the app never sees it
                return
            super().on_headers_complete()
            if self.cycle is not None:
                # Until the body is complete, an answer closes the connection (and says so).
                self._keep_alive_after_body = self.cycle.keep_alive
                self.cycle.keep_alive = False

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
            # uvicorn starts every request's app here (the first one and pipelined ones). What
            # it does when the app returns with the response incomplete (an ERROR line, then a
            # graceful close) is decided in its cycle's run_asgi; the app, wrapped, gets there
            # first. A test in tests/faults/test_fault_relay.py pins this on the installed
            # uvicorn.
            async def app_then_reset(
                scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
            ) -> None:
                try:
                    await app(scope, receive, send)
                except BaseException:
                    if cycle.response_started and not cycle.response_complete:
                        reset_connection(cycle.transport)  # uvicorn then logs the exception
                    raise
                if cycle.response_started and not cycle.response_complete and not cycle.disconnected:
                    reset_connection(cycle.transport)
                    # As connection_lost will find it: run_asgi then has nothing to report.
                    cycle.disconnected = True
                    log.info(
                        "connection reset: the answer to %s %s ended incomplete",
                        cycle.scope["method"],
                        cycle.scope["path"],
                        extra={"request_id": request_id_of(cast("dict[str, Any]", cycle.scope))},
                    )

            super()._start_asgi_task(cycle, app_then_reset)

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            # What comes next on this connection is another request's head.
            self._awaiting_head = True
            self._request_begun = False
            if not self._refused:
                if self.cycle is not None and not self.cycle.response_started:
                    self.cycle.keep_alive = self._keep_alive_after_body
                super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._refused or self.transport.is_closing():
                return
            # A head that is still incomplete after this read counts whole; the server then
            # holds at most the limit plus one read before refusing.
            if self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse_head()
                    return
            if self._awaiting_head and self._head_timer is None:
                self._arm_head_timer()  # the first bytes of a request on a reused connection

        def _arm_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._refused or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # A pipelined request trickles in while the previous answer is written: that
                # answer ends the connection instead of an interleaved 408.
                self.cycle.keep_alive = False
                self.flow.pause_reading()
                return
            if not self._request_begun:
                self._refused = True
                self.transport.close()
                return
            self._refuse(
                _error_answer(
                    "408 Request Timeout",
                    f"the request line and headers did not arrive within {header_timeout_s:g} s",
                    "invalid_request_error",
                    "request_timeout",
                )
            )

        def _refuse_head(self) -> None:
            self._refuse(
                _error_answer(
                    "431 Request Header Fields Too Large",
                    f"the request line and headers exceed {max_header_bytes} bytes",
                    "invalid_request_error",
                    "request_header_fields_too_large",
                )
            )

        def _refuse(self, answer: bytes) -> None:
            self._refused = True
            self._cancel_head_timer()
            self.transport.write(answer)
            self.transport.close()

    return HeaderLimitedProtocol


class KvgateServer(uvicorn.Server):
    """uvicorn's server with kvgate's drain on SIGTERM/SIGINT and reload on SIGHUP."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        app: FastAPI,
        reloader: Reloader | None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._app = app
        self._reloader = reloader
        self._on_started = on_started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    def _gateway(self) -> Router | None:
        gateway: Router | None = getattr(self._app.state, "kvgate", None)
        return gateway

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self._reloader is not None and threading.current_thread() is threading.main_thread():
            self._loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        if self.started and self._on_started is not None:
            self._on_started()

    async def shutdown(self, sockets: Any = None) -> None:
        if self._loop is not None and threading.current_thread() is threading.main_thread():
            self._loop.remove_signal_handler(signal.SIGHUP)
        await super().shutdown(sockets=sockets)

    def _on_sighup(self) -> None:
        assert self._reloader is not None
        self._reloader.reload()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        gateway = self._gateway()
        if sig not in _STOP_SIGNALS or self._draining or self._loop is None or gateway is None:
            # A second signal, or before startup: stop now, as uvicorn would.
            super().handle_exit(sig, frame)
            return
        self._draining = True
        # Runs in the signal handler, on the loop's thread: hand the work to the loop.
        self._loop.call_soon_threadsafe(self._drain, sig, gateway)

    def _drain(self, sig: int, gateway: Router) -> None:
        answered = gateway.begin_drain()
        settings = gateway.settings
        # uvicorn takes whole seconds; round up so that the grace is never shorter.
        self.config.timeout_graceful_shutdown = math.ceil(settings.shutdown_grace_s)
        log.warning(
            "signal %s: draining (%d queued requests answered 503); stopping in %.1f s, "
            "then %.0f s for requests in flight",
            signal.Signals(sig).name,
            answered,
            settings.shutdown_delay_s,
            settings.shutdown_grace_s,
        )
        assert self._loop is not None
        self._loop.call_later(settings.shutdown_delay_s, super().handle_exit, sig, None)


def serve(
    app: FastAPI,
    settings: Settings,
    *,
    load_settings: Callable[[], Settings] | None,
    sockets: list[socket.socket] | None = None,
    on_started: Callable[[], None] | None = None,
    **options: Any,
) -> bool:
    """Run `app` until a stop signal; `options` go to uvicorn.Config (host, port, logging...).
    `load_settings` re-reads the settings for reloads (None: no reloads). With `sockets`, serve
    on those listening sockets (a worker of `gateway.workers`) instead of binding host and port.
    `on_started` is called once the server listens. Returns whether it ever did (False: the
    app's startup failed, or a stop signal came first)."""
    reloader = Reloader(app, load_settings) if load_settings is not None else None
    app.state.reloader = reloader
    config = uvicorn.Config(app, **server_options(settings), **options)
    server = KvgateServer(config, app=app, reloader=reloader, on_started=on_started)
    server.run(sockets=sockets)
    return server.started


def server_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn.Config options that make kvgate's HTTP server (see the module docstring)."""
    return {
        "http": header_limited_protocol(
            settings.max_header_bytes,
            header_timeout_s=settings.header_timeout_s,
            max_client_connections=client_connection_limit(settings),
        ),
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "timeout_keep_alive": CLIENT_KEEPALIVE_TIMEOUT_S,
        "timeout_graceful_shutdown": math.ceil(settings.shutdown_grace_s),
    }


def client_connection_limit(settings: Settings) -> int:
    """`max_client_connections`, within what the process may open: raises the soft limit on
    descriptors towards the hard one when needed (as most servers do), and lowers the bound
    (with a warning) when even that is not enough. Without this, a flood of connections would
    make accept fail with EMFILE and take the descriptors that backend connections and files
    need; the bound refuses the excess cleanly instead."""
    others = settings.max_connections * len(settings.backend_specs()) + DESCRIPTOR_HEADROOM
    wanted = settings.max_client_connections + others
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, raised, exc)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return settings.max_client_connections
    limit = max(1, soft - others)
    log.warning(
        "max_client_connections lowered from %d to %d: the process may open %d descriptors and "
        "keeps %d for backend connections (max_connections per backend) and files",
        settings.max_client_connections,
        limit,
        soft,
        others,
    )
    return limit
