"""The `kvgate serve` process around the app: signals, reloads and the HTTP server's limits.

- SIGTERM (or SIGINT) drains: kvgate stops admitting at once (/readyz false; everyone queued,
  and every later arrival, gets 503 with Retry-After), keeps listening for `shutdown_delay_s`
  so that load balancers see it leave, then stops listening and gives the streams in flight
  `shutdown_grace_s` to finish before cancelling them (their reservations are completed either
  way). The process exits 0. A second signal skips the delay.
- SIGHUP, or `POST /admin/reload`, re-reads the settings from where they came from (flags,
  environment, --config file) and applies those that may change at run time
  (`gateway.settings.RELOADABLE_SETTINGS`) without touching a request in flight.
- The HTTP server bounds what a client may send before kvgate sees it: the request line and
  headers together at most `max_header_bytes` (431 beyond, connection closed); bodies are
  bounded by the app (`max_body_bytes`, 413).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from gateway.request_id import new_request_id
from gateway.service import BackendGateway
from gateway.settings import ConfigFileError, Settings, reloaded

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        gateway: BackendGateway = self._app.state.kvgate
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


def header_limited_protocol(max_header_bytes: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, refusing a request whose line and headers exceed
    `max_header_bytes` with 431 (the parser would otherwise buffer them without bound)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderLimitedProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _in_head = True
        _refused = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._head_bytes = 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if size > max_header_bytes:
                self._refuse_head()  # and no request cycle: the app never sees it
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            # A head that is still incomplete after this read counts whole; the server then
            # holds at most the limit plus one read before refusing.
            if self._in_head and not self._refused and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse_head()

        def _refuse_head(self) -> None:
            body = json.dumps(
                {
                    "error": {
                        "message": f"the request line and headers exceed {max_header_bytes} bytes",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "request_header_fields_too_large",
                    }
                },
                separators=(",", ":"),
            ).encode()
            head = (
                "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nx-request-id: {new_request_id()}\r\nconnection: close\r\n\r\n"
            ).encode()
            self._refused = True
            self.transport.write(head + body)
            self.transport.close()

    return HeaderLimitedProtocol


class KvgateServer(uvicorn.Server):
    """uvicorn's server with kvgate's drain on SIGTERM/SIGINT and reload on SIGHUP."""

    def __init__(self, config: uvicorn.Config, *, app: FastAPI, reloader: Reloader | None) -> None:
        super().__init__(config)
        self._app = app
        self._reloader = reloader
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    def _gateway(self) -> BackendGateway | None:
        gateway: BackendGateway | None = getattr(self._app.state, "kvgate", None)
        return gateway

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self._reloader is not None and threading.current_thread() is threading.main_thread():
            self._loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

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

    def _drain(self, sig: int, gateway: BackendGateway) -> None:
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
    app: FastAPI, settings: Settings, *, load_settings: Callable[[], Settings] | None, **options: Any
) -> None:
    """Run `app` until a stop signal; `options` go to uvicorn.Config (host, port, logging...).
    `load_settings` re-reads the settings for reloads (None: no reloads)."""
    reloader = Reloader(app, load_settings) if load_settings is not None else None
    app.state.reloader = reloader
    config = uvicorn.Config(
        app,
        http=header_limited_protocol(settings.max_header_bytes),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
        **options,
    )
    KvgateServer(config, app=app, reloader=reloader).run()
