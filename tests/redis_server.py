"""A real redis-server as a child process, for the tests and benchmarks of the shared budget.

`RedisServer` runs `redis-server` on a free loopback port with persistence off (every start is
an empty Redis), waits until it answers PING, and can be paused (SIGSTOP: connections stay
open and hang, as with a stalled server), resumed (SIGCONT), killed (SIGKILL: the kernel
closes its sockets) and started again on the same port. The `fresh_redis` fixture yields one
per test and stops it after; a test module imports the fixture by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REDIS_SERVER = "/usr/bin/redis-server"
STARTUP_TIMEOUT_S = 20.0
POLL_S = 0.01


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: the kernel stops this server when the test process dies,
    however it dies (a test killed by a timeout runs no clean-up)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_server_command() -> str | None:
    """The redis-server executable, or None when the machine has none."""
    if Path(REDIS_SERVER).exists():
        return REDIS_SERVER
    return shutil.which("redis-server")


class RedisServer:
    """One redis-server on 127.0.0.1:`port`; `start` again after `kill` reuses the port."""

    def __init__(
        self, log: Path | None = None, *, port: int | None = None, extra_args: Sequence[str] = ()
    ) -> None:
        command = redis_server_command()
        if command is None:
            raise RuntimeError("redis-server is not installed")
        self.command = command
        self.port = port if port is not None else free_port()
        self.log = log
        self.extra_args = list(extra_args)  # more redis-server options (TLS, users)
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        """A new synchronous client (decoded strings), for reading what kvgate wrote."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            db=0,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
            # One try: a paused server should read as unavailable now, not after retries.
            retry=Retry(NoBackoff(), 0),
        )

    def start(self) -> None:
        """Start on `port` (an empty Redis) and return once it answers PING."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("redis-server is already running")
        command = [
            self.command,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            *self.extra_args,
        ]  # fmt: skip
        with open(self.log if self.log is not None else os.devnull, "ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        self.paused = False
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.answers():
            if self.process.poll() is not None:
                told = self.log.read_text(errors="replace") if self.log is not None else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{told}")
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not answer PING in time")
            time.sleep(POLL_S)

    def answers(self) -> bool:
        """Whether it answers PING right now (False while paused or down)."""
        client = self.client(timeout_s=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets and data but answers nothing."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL: the server and everything it held are gone; the port is free again."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None
        self.paused = False

    def restart(self) -> None:
        """Kill it and start it again, empty, on the same port (a Redis without persistence
        that restarted)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.process = None
            return
        if self.paused:
            # A stopped process does not act on SIGTERM until it is continued.
            self.resume()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def _signal(self, sig: int) -> None:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError("redis-server is not running")
        self.process.send_signal(sig)


@contextlib.contextmanager
def running_redis(log: Path | None = None) -> Iterator[RedisServer]:
    server = RedisServer(log)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """An empty redis-server of this test's own (`make system-deps` installs it: a missing one
    fails the test rather than skip a claim about sharing)."""
    with running_redis(tmp_path / "redis.log") as server:
        yield server
