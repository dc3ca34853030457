"""Shared helpers of the fault tier: real processes, the emulator's fault switch, polling.

- `SimProcess`: the emulator as a child process on a fixed port, so that it can be killed
  (SIGKILL, a real crash: the kernel closes its sockets) and started again where kvgate
  expects it.
- `KvgateProcess`: a real `kvgate serve` child process (signals, resident memory, file
  descriptors, log output) on a free port.
- `Served`/`served_gateway`: kvgate under uvicorn in a thread of the test process, when a test
  needs to reach into the gateway's state.
- `poll_until`: wait for a condition that can be polled (never a bare sleep).

Named `faultkit` rather than `conftest` so that test modules import it explicitly, beside the
other test folders' conftest modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from one_backend import OneBackend

from estimator.tokens import TokenCounter
from gateway.app import create_app
from gateway.lifecycle import server_options
from gateway.settings import Settings
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import cli_args, serving

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60.0
POLL_S = 0.01
ADMIN_TOKEN = "fault-tier-admin-token"
# Scrape often, call the budget stale soon: the tests watch it change.
FAST_BUDGET: dict[str, Any] = {
    "metrics_poll_interval_s": 0.02,
    "metrics_stale_after_s": 0.5,
    "settle_s": 0.05,
}
# 5 ms per engine step: streams take long enough to be cut, held or stalled on purpose.
SLOW_STEPS = EngineConfig(step_cost=StepCost(base_s=0.005, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0))
LONG_STREAM: dict[str, Any] = {
    "model": "tiny-llama",
    "prompt": "tell me a long story",
    "max_tokens": 300,
    "ignore_eos": True,
    "stream": True,
}


def poll_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> float:
    """Poll `predicate` until it holds; returns the seconds it took. AssertionError on timeout."""
    started = time.monotonic()
    deadline = started + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic() - started


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tokenizer_dir() -> Path:
    """The testbed's tiny model folder (its tokenizer), as tests/testbed/testbed.py lays it."""
    cache = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
    return cache / "tiny-llama"


def set_faults(sim_url: str, **changes: Any) -> None:
    httpx.post(f"{sim_url}/sim/faults", json=changes, timeout=5).raise_for_status()


def clear_faults(sim_url: str) -> None:
    httpx.delete(f"{sim_url}/sim/faults", timeout=5).raise_for_status()


def sim_state(sim_url: str) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{sim_url}/sim/state", timeout=5).json()
    return state


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


# -- the emulator in a child process ------------------------------------------------------------


class SimProcess:
    """`python -m sim.cli` on a fixed port; `kill` and `start` it at will."""

    def __init__(self, config: SimConfig, *, port: int | None = None, cpu: int | None = None) -> None:
        self.config = config
        self.port = port if port is not None else free_port()
        self.cpu = cpu
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "sim.cli", "--host", "127.0.0.1", "--port", str(self.port)]
        command += cli_args(self.config)
        if self.cpu is not None:
            command = ["taskset", "-c", str(self.cpu), *command]
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the emulator exited with {self.process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the emulator did not start in time")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, the kernel closes its connections."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None


@contextlib.contextmanager
def sim_process(config: SimConfig, *, cpu: int | None = None) -> Iterator[SimProcess]:
    sim = SimProcess(config, cpu=cpu)
    sim.start()
    try:
        yield sim
    finally:
        sim.stop()


# -- kvgate serve in a child process -----------------------------------------------------------


@dataclass
class KvgateProcess:
    """A running `kvgate serve`; output goes to `log`."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path
    admin_token: str | None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def state(self, timeout_s: float = 5.0) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/admin/state", headers=self.admin_headers(), timeout=timeout_s)
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"kvgate serve exited with {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvgate serve did not become ready:\n{self.output()}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_kvgate(
    backend_url: str,
    log: Path,
    *,
    settings: dict[str, Any] | None = None,
    admin_token: str | None = ADMIN_TOKEN,
    config_file: Path | None = None,
    cpu: int | None = None,
    extra_args: Sequence[str] = (),
    wait_ready: bool = True,
) -> KvgateProcess:
    """Start `kvgate serve` in front of `backend_url` with the testbed's tokenizer."""
    port = free_port()
    values = {**FAST_BUDGET, "log_level": "warning", **(settings or {})}
    command = [
        sys.executable, "-m", "gateway.cli", "serve",
        "--backend", backend_url,
        "--port", str(port),
        "--tokenizer", str(tokenizer_dir()),
    ]  # fmt: skip
    for name, value in values.items():
        # Tables (priority_classes) go over as JSON text, which the setting reads.
        text = json.dumps(value) if isinstance(value, dict) else value
        command += ["--set", f"{name}={text}"]
    if config_file is not None:
        command += ["--config", str(config_file)]
    command += list(extra_args)
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    if admin_token is not None:
        env["KVGATE_ADMIN_TOKEN"] = admin_token
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    kvgate = KvgateProcess(process, port, log, admin_token, values)
    if wait_ready:
        try:
            kvgate.wait_ready()
        except BaseException:
            kvgate.stop(signal.SIGKILL)
            raise
    return kvgate


@contextlib.contextmanager
def kvgate_process(backend_url: str, log: Path, **kwargs: Any) -> Iterator[KvgateProcess]:
    kvgate = start_kvgate(backend_url, log, **kwargs)
    try:
        yield kvgate
    finally:
        kvgate.stop(signal.SIGKILL if kvgate.process.poll() is None else signal.SIGTERM)


def ledger_balanced(state: dict[str, Any]) -> bool:
    """The admin state shows nothing in flight and nothing queued."""
    backend = state["backends"][0]
    ledger = backend["ledger"]
    return bool(
        ledger["entries"] == 0
        and ledger["reserved_blocks"] == 0
        and ledger["held_blocks"] == 0
        and sum(backend["queue"]["depth"].values()) == 0
    )


# -- kvgate in a thread of the test process -----------------------------------------------------


@dataclass
class Served:
    url: str
    app: FastAPI
    loop: asyncio.AbstractEventLoop

    @property
    def gateway(self) -> OneBackend:
        return OneBackend(self.app.state.kvgate)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the gateway's event loop (its state is not thread-safe)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def wait_until(
        self, predicate: Callable[[OneBackend], bool], timeout_s: float = 10.0, what: str = "condition"
    ) -> float:
        return poll_until(lambda: bool(self.call(lambda: predicate(self.gateway))), timeout_s, what)


def gateway_idle(gateway: OneBackend) -> bool:
    totals = gateway.ledger.totals()
    return (
        totals.entries == 0
        and totals.reserved_blocks == 0
        and totals.held_blocks == 0
        and not gateway.inflight
        and len(gateway.queue) == 0
    )


@contextlib.contextmanager
def served_gateway(
    backend_url: str | None,
    *,
    wait_ready: bool = True,
    counter: TokenCounter | None = None,
    send_buffer_bytes: int | None = None,
    **overrides: Any,
) -> Iterator[Served]:
    """kvgate in front of `backend_url` (None: the `backends` in `overrides`), under uvicorn in
    a thread of this process, with the
    HTTP server `kvgate serve` runs (`gateway.lifecycle.server_options`).
    `send_buffer_bytes` sets SO_SNDBUF on the listening socket (accepted sockets inherit it)."""
    where = {"backend_url": backend_url} if backend_url is not None else {}
    settings = Settings(**where, **{**FAST_BUDGET, **overrides})
    app = create_app(settings, token_counter=counter or TokenCounter.approximate())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    try:
        with serving(app, sock, **server_options(settings)) as loop:
            served = Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app, loop)
            if wait_ready:
                served.wait_until(lambda gw: gw.readiness()[0], 20, "the gateway to be ready")
            yield served
    finally:
        sock.close()


# -- a backend that records what reaches it -----------------------------------------------------

RECORDER_MODEL = "tiny-llama"
RECORDER_METRICS = (
    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 0.0\n'
    '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 0.0\n'
    '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.0\n'
    '# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{engine="0"} 0.0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
)


@dataclass(frozen=True)
class Seen:
    """One request as the backend received it."""

    method: str
    raw_path: bytes
    query: bytes
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name]


@dataclass
class RecordingBackend:
    """An ASGI stand-in for vLLM that records every request it gets and answers at once:
    /v1/models, /version and /metrics as vLLM would, generation requests with a small
    completion whose response carries hop-by-hop headers of its own."""

    seen: list[Seen] = field(default_factory=list)

    def generation(self) -> list[Seen]:
        return [s for s in self.seen if s.raw_path not in (b"/metrics", b"/v1/models", b"/version")]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append(
            Seen(
                scope["method"],
                scope.get("raw_path") or scope["path"].encode(),
                scope["query_string"],
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]],
                bytes(body),
            )
        )
        if scope["path"] == "/v1/models":
            payload = {"object": "list", "data": [{"id": RECORDER_MODEL, "max_model_len": 4096}]}
            await _answer(send, 200, json.dumps(payload).encode(), b"application/json", [])
        elif scope["path"] == "/metrics":
            await _answer(send, 200, RECORDER_METRICS.encode(), b"text/plain", [])
        elif scope["path"] == "/version":
            await _answer(send, 200, b'{"version": "0.32.0"}', b"application/json", [])
        else:
            answer = b'{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"completion_tokens":1}}'
            hop = [
                (b"connection", b"x-backend-hop"),
                (b"x-backend-hop", b"1"),
                (b"keep-alive", b"timeout=5"),
                (b"upgrade", b"h2c"),
                (b"x-backend-kept", b"1"),
            ]
            await _answer(send, 200, answer, b"application/json", hop)


async def _answer(
    send: Any, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def recording_backend() -> Iterator[tuple[RecordingBackend, str]]:
    backend = RecordingBackend()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        with serving(backend, sock):
            yield backend, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def raw_exchange(url: str, request: bytes, timeout_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send `request` (bytes as they go on the wire) and read the response to the connection's
    end; returns status, headers (lower-case names) and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(request)
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body
