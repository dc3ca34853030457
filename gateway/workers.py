"""Several kvgate processes on one host: `kvgate serve --workers N`.

The parent process validates the settings, binds host:port and starts N workers. Each is a
`python -m gateway.workers` process that inherits a listening socket and runs a whole kvgate
(its own poller, queue and ledger) built from the parent's validated settings; the workers
coordinate only through Redis (`redis_url`, which settings require for workers > 1). The
parent serves nothing itself.

Each worker slot has a listening socket of its own, all bound to the one port with
SO_REUSEPORT, so that the kernel spreads new connections evenly over the slots by their
addresses. One shared socket would not: a worker woken for a burst of connections accepts every
one queued by then, and one worker took 77% of a benchmark's streams. The parent holds every
slot's socket for as long as it runs, so a worker's replacement inherits the socket its
predecessor accepted on and the connections that reached it meanwhile wait there, unrefused,
for the replacement. Where SO_REUSEPORT is missing, all slots share one socket.

- SIGTERM or SIGINT on the parent reaches every worker as SIGTERM, on which it drains as a lone
  kvgate does (gateway.lifecycle). The parent exits once all of them have: 0 when every one
  stopped cleanly. A second signal is passed on as well (the workers then skip the delay).
- SIGHUP is passed to every worker that serves; each reloads from the sources the parent was
  given (flags, environment, --config file). A worker still starting gets it once it serves,
  and a worker started later applies the same reload when it starts.
- A worker that ends by itself after it served is replaced after RESTART_PAUSE_S. One that ends
  before it ever served tells of settings or a host that are wrong, and restarting it would
  only repeat that: the parent stops the others and exits 1.
- A worker whose parent is gone (its stdin, a pipe from the parent, reaches end of file) drains
  and exits by itself, so that no worker is left serving without the parent.

Parent to worker: the listening socket and the write end of a pipe as inherited descriptors
(`--listen-fd`, `--ready-fd`), and one line of JSON on stdin (`worker_message`). The worker
writes READY to the pipe once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

from gateway.logs import configure_logging
from gateway.settings import ConfigFileError, Settings, load_settings, reloaded

log = logging.getLogger(__name__)

# Pause before a worker that ended is replaced: a worker that fails soon after each start is
# restarted at most this often.
RESTART_PAUSE_S = 1.0
# Connections the kernel queues for the workers to accept (uvicorn's default).
LISTEN_BACKLOG = 2048
READY = b"1"
EXIT_FAILURE = 1
# A worker's exit code when it never served (its app did not start).
EXIT_NOT_SERVED = 3
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How a worker may end when asked to stop: by itself, or by SIGTERM itself when it came before
# the worker had its handlers in place (it was still importing; nothing was served).
_CLEAN_EXITS = frozenset({0, -signal.SIGTERM})


@dataclass(frozen=True, slots=True)
class SettingsSources:
    """Where the settings of `kvgate serve` came from, to read them again on a reload: the
    command line's values (`gateway.serve_cli.overrides_from`; JSON-safe) and the --config
    file. The environment is the process's own."""

    overrides: Mapping[str, Any]
    config_file: Path | None

    def load(self) -> Settings:
        """Settings from the sources as they are now; raises as `load_settings` does."""
        return load_settings(self.overrides, config_file=self.config_file)


def settings_values(settings: Settings) -> dict[str, Any]:
    """Every setting's value with secrets revealed, as values `json.dumps` writes (floats may be
    infinite) and `Settings.model_validate` turns back into equal settings."""
    values = settings.model_dump(mode="python")
    for name, value in values.items():
        if isinstance(value, SecretStr):
            values[name] = value.get_secret_value()
    return values


def worker_message(settings: Settings, sources: SettingsSources, *, reload: bool) -> bytes:
    """The line a worker reads on stdin: the validated settings, their sources, and whether to
    apply a reload at once (the parent passed a SIGHUP on before this worker started)."""
    message = {
        "settings": settings_values(settings),
        "overrides": dict(sources.overrides),
        "config_file": None if sources.config_file is None else str(sources.config_file),
        "reload": reload,
    }
    return json.dumps(message).encode() + b"\n"


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per worker slot on host:port (port 0: one the kernel picks, the
    same for all); raises OSError when one cannot be bound, having closed the others."""
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    reuse_port = hasattr(socket, "SO_REUSEPORT")

    def bind(on_port: int) -> socket.socket:
        return socket.create_server(
            (address, on_port), family=family, backlog=LISTEN_BACKLOG, reuse_port=reuse_port
        )

    sockets = [bind(port)]
    if not reuse_port:
        return sockets * count
    try:
        for _ in range(count - 1):
            sockets.append(bind(sockets[0].getsockname()[1]))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def supervise(settings: Settings, sources: SettingsSources) -> int:
    """Run settings.workers workers on host:port until a stop signal; returns the exit code."""
    configure_logging(settings.log_level, settings.log_format)
    try:
        sockets = listening_sockets(settings.host, settings.port, settings.workers)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
        return EXIT_FAILURE
    with contextlib.ExitStack() as held:
        for sock in set(sockets):
            held.enter_context(sock)
        host, port = sockets[0].getsockname()[:2]
        log.info("listening on %s:%d, %d workers (parent pid %d)", host, port, settings.workers, os.getpid())

        def message(reload: bool) -> bytes:
            return worker_message(settings, sources, reload=reload)

        return asyncio.run(Supervisor(message, sockets).run())


class Supervisor:
    """Keeps one worker running on each of `sockets` (a slot each) until stopped (see the module
    docstring). `message(reload)` is the line each new worker is sent (`worker_message`)."""

    def __init__(
        self,
        message: Callable[[bool], bytes],
        sockets: Sequence[socket.socket],
        *,
        command: Sequence[str] = (sys.executable, "-m", "gateway.workers"),
    ) -> None:
        self._message = message
        self._sockets = tuple(sockets)
        self._command = tuple(command)
        self._running: dict[int, asyncio.subprocess.Process] = {}
        self._serving: set[int] = set()
        self._stopped = asyncio.Event()
        self._failed = False
        # SIGHUPs passed on so far: a worker started before the last one reloads once it serves.
        self._reloads = 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self._stop, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            codes = await asyncio.gather(*(self._keep(slot) for slot in range(len(self._sockets))))
        finally:
            for sig in (*_STOP_SIGNALS, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        if self._failed or not all(code in _CLEAN_EXITS for code in codes):
            return EXIT_FAILURE
        log.info("all %d workers stopped", len(self._sockets))
        return 0

    def _stop(self, sig: int) -> None:
        if not self._stopped.is_set():
            log.warning("signal %s: stopping %d workers", signal.Signals(sig).name, len(self._running))
        self._stopped.set()
        # SIGTERM whatever came: a worker ends on it with 0, where SIGINT would leave a
        # KeyboardInterrupt behind once it has drained.
        for process in self._running.values():
            _send(process, signal.SIGTERM)

    def _reload(self) -> None:
        if self._stopped.is_set():
            return
        self._reloads += 1
        log.info("SIGHUP: %d serving workers reload", len(self._serving))
        for slot in self._serving:
            _send(self._running[slot], signal.SIGHUP)

    async def _keep(self, slot: int) -> int:
        """Run the worker of one slot, replacing it while it serves; returns its last exit code."""
        while True:
            reloads = self._reloads
            process, served = await self._start(slot, reload=reloads > 0)
            if served:
                self._serving.add(slot)
                if self._reloads != reloads:
                    _send(process, signal.SIGHUP)
            code = await process.wait()
            self._serving.discard(slot)
            del self._running[slot]
            if process.stdin is not None:
                process.stdin.close()
            if self._stopped.is_set():
                return code
            if not served:
                log.error(
                    "worker %d (pid %d) ended before it served (exit code %d): stopping the others",
                    slot,
                    process.pid,
                    code,
                )
                self._failed = True
                self._stop(signal.SIGTERM)
                return code
            log.error(
                "worker %d (pid %d) ended (exit code %d); starting another in %.0f s",
                slot,
                process.pid,
                code,
                RESTART_PAUSE_S,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), RESTART_PAUSE_S)
            if self._stopped.is_set():
                return 0

    async def _start(self, slot: int, *, reload: bool) -> tuple[asyncio.subprocess.Process, bool]:
        """Start the worker of `slot`; returns it and whether it came to serve (False: it ended
        first)."""
        ready_read, ready_write = os.pipe()
        listen_fd = self._sockets[slot].fileno()
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command,
                "--listen-fd",
                str(listen_fd),
                "--ready-fd",
                str(ready_write),
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(listen_fd, ready_write),
                # Its own process group: a terminal's Ctrl-C reaches the parent only, which
                # passes it on once, rather than every worker twice.
                process_group=0,
            )
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            os.close(ready_write)
        self._running[slot] = process
        if self._stopped.is_set():
            _send(process, signal.SIGTERM)
        log.info("worker %d started (pid %d)", slot, process.pid)
        assert process.stdin is not None
        # The worker may have ended already; then the pipe tells so at once, below.
        with contextlib.suppress(ConnectionError):
            process.stdin.write(self._message(reload))
            await process.stdin.drain()
        return process, await _ready(ready_read)


def _send(process: asyncio.subprocess.Process, sig: int) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)


async def _ready(fd: int) -> bool:
    """Wait until the worker at the other end of the pipe `fd` writes READY (True) or ends (False)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    try:
        return await reader.read(len(READY)) == READY
    finally:
        transport.close()


def _read_line(fd: int) -> bytes:
    # Unbuffered, so that nothing past the line is taken from the pipe and the descriptor stays
    # free for the watch below (a buffered reader's lock in a daemon thread breaks the exit).
    line = bytearray()
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise EOFError("the parent closed the pipe before its message was complete")
        line += chunk
    return bytes(line)


def _stop_when_parent_is_gone(fd: int) -> None:
    # Blocks until the parent's end of the pipe closes: the parent ended, however it did.
    while os.read(fd, 65536):
        pass
    log.error("the parent process is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """A worker: read the parent's message, serve on the inherited socket until stopped."""
    # A SIGHUP before the server handles it (a reload) must not end the worker (its default).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m gateway.workers", description=__doc__)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(argv)
    message = json.loads(_read_line(sys.stdin.fileno()))
    settings = Settings.model_validate(message["settings"])
    config_file = message["config_file"]
    sources = SettingsSources(message["overrides"], None if config_file is None else Path(config_file))
    configure_logging(settings.log_level, settings.log_format)
    threading.Thread(
        target=_stop_when_parent_is_gone, args=(sys.stdin.fileno(),), name="parent-watch", daemon=True
    ).start()
    if message["reload"]:
        try:
            settings, _, _ = reloaded(settings, sources.load())
        except (ValidationError, ConfigFileError) as exc:
            # The serving workers kept their settings on such a failure too.
            log.error("reload failed, serving with the settings the parent started with: %s", exc)

    def on_started() -> None:
        os.write(args.ready_fd, READY)
        os.close(args.ready_fd)

    from gateway.serve_cli import serve_gateway

    # Inherited, both are inheritable: keep them from any process this one starts.
    os.set_inheritable(args.ready_fd, False)
    sock = socket.socket(fileno=args.listen_fd)
    sock.set_inheritable(False)
    served = serve_gateway(settings, sources, sockets=[sock], on_started=on_started)
    return 0 if served else EXIT_NOT_SERVED


if __name__ == "__main__":
    sys.exit(worker_main())
