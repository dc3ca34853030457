"""Run an emulator as a real HTTP server for tests and benchmarks of other components.

    with running_sim(SimConfig(...)) as url:        # uvicorn in a background thread
        httpx.get(f"{url}/health")

    with running_sim_process(SimConfig(...)) as url:  # `kvgate sim` in a child process
        ...

The thread form starts in well under a second and shares the test's process; use the process
form when the emulator must not compete with the client for the GIL (load benchmarks).
Both bind a free port on 127.0.0.1 and stop the server (and any hung responses) on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from sim.config import SimConfig
from sim.faults import Faults
from sim.server import SimApp, create_sim_app

STARTUP_TIMEOUT_S = 30.0
# Hung responses are released by the runtime on shutdown; this only bounds a stuck client.
GRACEFUL_SHUTDOWN_S = 5.0
POLL_INTERVAL_S = 0.02


class SimServer:
    """A started emulator: its base URL and, in thread mode, the app (for its runtime)."""

    def __init__(self, url: str, app: SimApp | None) -> None:
        self.url = url
        self.app = app


def _free_socket() -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the
    # socket says it is TCP, and without it each response's second write waits out the
    # client's delayed ACK (about 40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def serving(
    app: Any, sock: socket.socket, *, name: str = "uvicorn-test", **config: Any
) -> Iterator[asyncio.AbstractEventLoop]:
    """Serve any ASGI app with uvicorn on `sock` in a background thread; yields its event loop.

    `config` overrides uvicorn.Config options (quiet, no access log, lifespan on by default).
    Raises RuntimeError if the server fails to start, TimeoutError if it does not start in time.
    """
    options: dict[str, Any] = {"log_level": "warning", "access_log": False, "lifespan": "on", "backlog": 2048}
    options.update(config)
    sock.listen(options["backlog"])
    server = uvicorn.Server(uvicorn.Config(app, **options))
    loop_box: list[asyncio.AbstractEventLoop] = []
    failure: list[BaseException] = []

    def serve() -> None:
        async def main() -> None:
            loop_box.append(asyncio.get_running_loop())
            await server.serve(sockets=[sock])

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if failure or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"{name} failed to start") from (failure[0] if failure else None)
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"{name} did not start in time")
        time.sleep(POLL_INTERVAL_S)
    try:
        yield loop_box[0]
    finally:
        server.should_exit = True
        thread.join(STARTUP_TIMEOUT_S)


@contextlib.contextmanager
def running_sim_server(config: SimConfig) -> Iterator[SimServer]:
    """Serve `config` with uvicorn in a background thread; yields the server handle."""
    app = create_sim_app(config)
    sock = _free_socket()
    port = sock.getsockname()[1]
    try:
        with serving(
            app, sock, name=f"sim-{port}", timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S)
        ) as loop:
            try:
                yield SimServer(f"http://127.0.0.1:{port}", app)
            finally:
                # Release hung and streaming responses so uvicorn's graceful shutdown is quick.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(app.begin_shutdown)
    finally:
        sock.close()


@contextlib.contextmanager
def running_sim(config: SimConfig | None = None) -> Iterator[str]:
    """Serve an emulator in a background thread; yields its base URL (no trailing slash)."""
    with running_sim_server(config or SimConfig()) as server:
        yield server.url


def cli_args(config: SimConfig) -> list[str]:
    """`kvgate sim` arguments that reproduce `config` (tokenizer, engine, faults)."""
    engine = config.engine
    cost = engine.step_cost
    args = [
        "--num-blocks", str(engine.num_blocks),
        "--block-size", str(engine.block_size),
        "--max-model-len", str(engine.max_model_len),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--watermark", str(engine.watermark),
        "--long-prefill-token-threshold", str(engine.long_prefill_token_threshold),
        "--step-base-ms", repr(cost.base_s * 1000),
        "--step-per-token-ms", repr(cost.per_token_s * 1000),
        "--step-per-seq-ms", repr(cost.per_seq_s * 1000),
        "--step-per-request-ms", repr(cost.per_request_s * 1000),
        "--model-name", config.model_name,
        "--eos-token-id", str(config.eos_token_id),
        "--output-len", config.output_len.spec(),
        "--seed", str(config.seed),
    ]  # fmt: skip
    if not engine.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if config.tokenizer is not None:
        args += ["--tokenizer", config.tokenizer]
    if config.max_num_queued_reqs is not None:
        args += ["--max-num-queued-reqs", str(config.max_num_queued_reqs)]
    if config.max_num_queued_tokens is not None:
        args += ["--max-num-queued-tokens", str(config.max_num_queued_tokens)]
    faults = config.faults
    defaults = Faults()
    for name, value in faults.to_json().items():
        if value != defaults.to_json()[name]:
            flag = "--fault-" + name.replace("_", "-")
            args += [flag] if isinstance(value, bool) else [flag, str(value)]
    return args


@contextlib.contextmanager
def running_sim_process(
    config: SimConfig | None = None, *, cpu: int | None = None, log: Path | None = None
) -> Iterator[str]:
    """Run `python -m sim.cli` in a child process (pinned to `cpu` if given); yields its URL."""
    with sim_process(config, cpu=cpu, log=log) as server:
        yield server.url


@dataclasses.dataclass(frozen=True, slots=True)
class SimProcess:
    """A started emulator process: its base URL and pid (for reading its CPU counters)."""

    url: str
    pid: int


@contextlib.contextmanager
def sim_process(
    config: SimConfig | None = None, *, cpu: int | None = None, log: Path | None = None
) -> Iterator[SimProcess]:
    """`running_sim_process`, yielding the process's pid beside its URL."""
    config = config or SimConfig()
    sock = _free_socket()
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "sim.cli", "--host", "127.0.0.1", "--port", str(port)]
    command += cli_args(config)
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "wb")) if log is not None else subprocess.DEVNULL
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        stack.callback(_stop_process, process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the emulator exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the emulator process did not start in time")
            time.sleep(POLL_INTERVAL_S)
        # taskset execs the emulator: the pid is the emulator's own.
        yield SimProcess(url, process.pid)


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(GRACEFUL_SHUTDOWN_S * 2)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until `predicate` holds; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(POLL_INTERVAL_S)


def engine_idle(url: str) -> bool:
    """True when the emulator at `url` holds no request, no block and no open response."""
    state = httpx.get(f"{url}/sim/state").json()
    return bool(
        state["num_running"] == 0
        and state["num_waiting"] == 0
        and state["num_free_blocks"] == state["num_usable_blocks"]
        and state["open_responses"] == 0
    )
