"""Benchmark: normal traffic through kvgate while it is attacked (not a test; prints figures).

    KVGATE_TEST_VLLM_URL=http://127.0.0.1:8031 .venv/bin/python tests/benchmarks/attack.py \\
        [--phase-s 40] [--rate 4] [--slow 300] [--gateway-cpus 0] [--attacker-cpus 0] [--probe-cpus all]

Starts `kvgate serve` (a real process, the testbed model's tokenizer, every setting at its
default) in front of the real testbed (KVGATE_TEST_VLLM_URL or --backend), or of `kvgate sim`
when neither is given, pinned to `--gateway-cpus` (core 0 by default; the testbed's engine has
core 1). This script's attackers run on `--attacker-cpus` (core 0 by default, kvgate's), the
prober on `--probe-cpus` (any core by default): on another core than kvgate's, their work no
longer competes with kvgate's for its CPU.
Then two phases of `--phase-s` seconds each, on loopback only:

1. quiet: normal traffic alone, small completions (a short prompt, 8 tokens) arriving at
   `--rate` per second, open loop;
2. attack: the same normal traffic while, at once,
   - `--slow` slowloris connections (half trickle a request head, half a body, a byte a
     second, reconnecting whenever kvgate cuts them off),
   - request-supplied chat templates (`{{ 'a' * 10**10 }}`, `{{ 1/0 }}`, nested loops, in the
     body and in chat_template_kwargs), `--template-rate` per second,
   - bodies at `max_body_bytes` (a valid completion whose prompt fills it, and one a byte
     over it, streamed without a length), two clients back to back,
   - clients that ask for a stream and never read it (a small receive buffer), four at a time;
   - with `--attacks ...,hugejson`: two more clients sending bodies at `max_body_bytes` of the
     JSON values slowest to parse (a prompt of token ids, a prompt of empty lists).

Throughout, from a process of its own (so that the attackers' work is not measured as
kvgate's latency), /healthz is polled every 50 ms (its latency, max and p99; target < 100 ms), and
kvgate's resident memory is sampled every 100 ms (peak over the quiet phase's peak; target a
small multiple of max_body_bytes). Normal requests' p50/p99 in the attack phase are compared
with the quiet phase's (target within 2x); the same requests sent to the backend itself at
`--control-rate` tell how much of a change is the backend's own (its engine shares this
machine with the attack), and the slowest normal requests are listed with the time kvgate
queued them and the stalls of its loop while they were out. kvgate's own event-loop lag
(`kvgate_event_loop_lag_seconds`, and the stalls of `/admin/state`'s `event_loop` with their
likeliest cause: the loop's own work, other threads, or the process not being scheduled) is read
before and after each phase, and the worst /healthz answers are matched with the stalls kvgate
saw at that time. Everything stops by itself: bounded connections,
bounded time, kvgate stopped at the end. The gateway runs under an address-space cap
(`--memory-cap-gib`), so that a template that allocates without bound fails inside kvgate
instead of bringing the kernel's OOM killer to a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL_DIR = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate")) / "tiny-llama"
MODEL = "tiny-llama"
READY_TIMEOUT_S = 120.0
HEALTH_INTERVAL_S = 0.05
RSS_INTERVAL_S = 0.1
TRICKLE_INTERVAL_S = 1.0
NORMAL_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
TEMPLATES = (
    "{{ 'a' * 10**10 }}",
    "{{ 1/0 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{{ messages * 1000000 }}",
)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # kvgate's default (gateway.settings)
ATTACKS = ("slowloris", "templates", "huge", "nonreaders", "hugejson")
# The default set; `hugejson` (bodies of small JSON values, the slowest to parse) is asked for.
DEFAULT_ATTACKS = ("slowloris", "templates", "huge", "nonreaders")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except OSError as exc:
        return int(getattr(exc, "code", 0) or 0)


def wait_until(predicate: Callable[[], bool], process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not predicate():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not become ready")
        time.sleep(0.1)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_set(text: str) -> set[int]:
    """'all', or a comma-separated list of CPU numbers and ranges ('0', '1', '0-1')."""
    if text == "all":
        return set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_lag_buckets(url: str) -> dict[float, float]:
    """kvgate_event_loop_lag_seconds's cumulative buckets (upper bound -> count) and, under
    -1, its count."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_event_loop_lag_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvgate_event_loop_lag_seconds_count "):
            buckets[-1.0] = float(line.rsplit(" ", 1)[1])
    return buckets


def loop_stalls(url: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"{url}/admin/state", timeout=10) as response:
        stalls: list[dict[str, object]] = json.load(response)["event_loop"]["recent_stalls"]
        return stalls


@contextlib.contextmanager
def started(
    command: list[str], log: Path, cpus: str, memory_cap_bytes: int | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    def limit() -> None:
        if memory_cap_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_cap_bytes, memory_cap_bytes))

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            ["taskset", "-c", cpus, *command],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=limit,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


# -- measurements ------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    normal_ms: list[float] = field(default_factory=list)
    normal_status: Counter[int | str] = field(default_factory=Counter)
    # (monotonic time sent, latency ms, kvgate's x-kvgate-queue-ms) of each normal request
    normal_detail: list[tuple[float, float, float]] = field(default_factory=list)
    control_ms: list[float] = field(default_factory=list)  # the same requests sent to the backend
    health_ms: list[float] = field(default_factory=list)
    health_at: list[float] = field(default_factory=list)  # monotonic time each answer came
    health_failures: int = 0
    rss_peak: int = 0
    rss_samples: list[int] = field(default_factory=list)
    fds_peak: int = 0
    attacks: Counter[str] = field(default_factory=Counter)
    lag_before: dict[float, float] = field(default_factory=dict)
    lag_after: dict[float, float] = field(default_factory=dict)
    stalls: list[dict[str, object]] = field(default_factory=list)
    started_at: float = 0.0
    client_cpu_s: float = 0.0
    gateway_cpu_s: float = 0.0


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def poll_health(url: str, phase: Phase, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        await client.get(f"{url}/healthz")  # the connection, not measured
        while not stop.is_set():
            started_at = time.perf_counter()
            try:
                response = await client.get(f"{url}/healthz")
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            took_ms = (time.perf_counter() - started_at) * 1000
            phase.health_ms.append(took_ms)
            phase.health_at.append(time.monotonic())
            phase.health_failures += not ok
            await asyncio.sleep(max(0.0, HEALTH_INTERVAL_S - took_ms / 1000))


async def sample_rss(pid: int, phase: Phase, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):
            rss = rss_bytes(pid)
            phase.rss_samples.append(rss)
            phase.rss_peak = max(phase.rss_peak, rss)
            phase.fds_peak = max(phase.fds_peak, open_fds(pid))
        await asyncio.sleep(RSS_INTERVAL_S)


async def normal_traffic(
    url: str, rate: float, phase: Phase, stop: asyncio.Event, *, control: bool = False
) -> None:
    """Normal requests at `rate`, open loop; `control`: sent to the backend itself, which
    tells how much of a change under attack is the backend's (its engine shares the machine)."""
    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=64)) as client:

        async def one() -> None:
            sent_at = time.monotonic()
            started_at = time.perf_counter()
            queue_ms = float("nan")
            try:
                response = await client.post(f"{url}/v1/completions", json=NORMAL_BODY)
                status: int | str = response.status_code
                queue_ms = float(response.headers.get("x-kvgate-queue-ms", "nan"))
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            took_ms = (time.perf_counter() - started_at) * 1000
            if control:
                if status == 200:
                    phase.control_ms.append(took_ms)
                return
            phase.normal_status[status] += 1
            if status == 200:
                phase.normal_ms.append(took_ms)
                phase.normal_detail.append((sent_at, took_ms, queue_ms))

        tasks: set[asyncio.Task[None]] = set()
        next_at = time.monotonic()
        while not stop.is_set():
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await asyncio.gather(*tasks, return_exceptions=True)


# -- attackers ---------------------------------------------------------------------------------


async def trickler(port: int, body: bool, phase: Phase, stop: asyncio.Event) -> None:
    """Trickle a head (or, after a complete head, a body) a byte a second; reconnect when cut."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    if body:
        head += b"content-length: 100000\r\n\r\n{"
    kind = "body" if body else "head"
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            phase.attacks[f"{kind}_connect_failed"] += 1
            await asyncio.sleep(TRICKLE_INTERVAL_S)
            continue
        phase.attacks[f"{kind}_connections"] += 1
        try:
            writer.write(head)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TRICKLE_INTERVAL_S):
                        answer = await reader.read(200)
                        status = (
                            answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"
                        )
                        phase.attacks[f"{kind}_cut_{status}"] += 1
                        break
                writer.write(b"x" if not body else b" ")
                await writer.drain()
        except OSError:
            phase.attacks[f"{kind}_cut_reset"] += 1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def template_attacker(url: str, rate: float, phase: Phase, stop: asyncio.Event) -> None:
    """Request-supplied chat templates at `rate` per second (in the body or in
    chat_template_kwargs, in turn), each answer awaited before the next is due."""
    async with httpx.AsyncClient(timeout=60.0) as client:
        n = 0
        next_at = time.monotonic()
        while not stop.is_set():
            template = TEMPLATES[n % len(TEMPLATES)]
            messages = [{"role": "user", "content": "hi"}]
            body: dict[str, object] = {"model": MODEL, "messages": messages, "max_tokens": 4}
            if (n // len(TEMPLATES)) % 2:
                body["chat_template_kwargs"] = {"chat_template": template}
            else:
                body["chat_template"] = template
            n += 1
            try:
                response = await client.post(f"{url}/v1/chat/completions", json=body)
                phase.attacks[f"template_{response.status_code}"] += 1
            except httpx.HTTPError as exc:
                phase.attacks[f"template_{type(exc).__name__}"] += 1
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def huge_body_attacker(
    url: str, max_body_bytes: int, index: int, phase: Phase, stop: asyncio.Event
) -> None:
    # A valid completion whose prompt fills the body to its limit: read, parsed and counted.
    words = (max_body_bytes - 100) // 2
    fits = json.dumps({"model": MODEL, "prompt": "a " * words, "max_tokens": 4}).encode()
    assert len(fits) <= max_body_bytes
    over = b"x" * (max_body_bytes + 1)

    async def chunks(data: bytes) -> AsyncIterator[bytes]:  # no length: read until the limit
        for start in range(0, len(data), 256 * 1024):
            yield data[start : start + 256 * 1024]

    async with httpx.AsyncClient(timeout=120.0) as client:
        n = index
        while not stop.is_set():
            n += 1
            try:
                if n % 2:
                    response = await client.post(
                        f"{url}/v1/completions", content=fits, headers={"content-type": "application/json"}
                    )
                    phase.attacks[f"huge_fits_{response.status_code}"] += 1
                else:
                    response = await client.post(f"{url}/v1/completions", content=chunks(over))
                    phase.attacks[f"huge_over_{response.status_code}"] += 1
            except httpx.HTTPError as exc:
                phase.attacks[f"huge_{type(exc).__name__}"] += 1
                await asyncio.sleep(0.5)


async def huge_json_attacker(
    url: str, max_body_bytes: int, index: int, phase: Phase, stop: asyncio.Event
) -> None:
    """Bodies at `max_body_bytes` made of the JSON values slowest to parse, back to back: a
    prompt of token ids (valid ids, far more than the context holds) and a prompt of empty
    lists (refused once parsed)."""
    ids = json.dumps(
        {"model": MODEL, "prompt": [1000] * ((max_body_bytes - 100) // 5), "max_tokens": 4},
        separators=(",", ":"),
    )
    empty: list[list[int]] = [[] for _ in range((max_body_bytes - 100) // 3)]
    lists = json.dumps({"model": MODEL, "prompt": empty, "max_tokens": 4}, separators=(",", ":"))
    bodies = {"ids": ids.encode(), "lists": lists.encode()}
    assert all(len(body) <= max_body_bytes for body in bodies.values())
    async with httpx.AsyncClient(timeout=120.0) as client:
        n = index
        while not stop.is_set():
            n += 1
            kind = "ids" if n % 2 else "lists"
            try:
                response = await client.post(
                    f"{url}/v1/completions",
                    content=bodies[kind],
                    headers={"content-type": "application/json"},
                )
                phase.attacks[f"hugejson_{kind}_{response.status_code}"] += 1
            except httpx.HTTPError as exc:
                phase.attacks[f"hugejson_{type(exc).__name__}"] += 1
                await asyncio.sleep(0.5)


async def non_reader(port: int, phase: Phase, stop: asyncio.Event) -> None:
    """Ask for a stream, then never read it; a fresh one each time kvgate ends it."""
    body = json.dumps(
        {"model": MODEL, "prompt": "tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    while not stop.is_set():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(sock, request)
            phase.attacks["nonreader_started"] += 1
            # Hold the connection, unread, for a while, then give up on it as a client would.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(20):
                    await stop.wait()
        except OSError:
            phase.attacks["nonreader_failed"] += 1
            await asyncio.sleep(1)
        finally:
            sock.close()


# -- the run -----------------------------------------------------------------------------------


def probe(
    url: str,
    backend: str,
    rate: float,
    control_rate: float,
    duration_s: float,
    cpus: set[int],
    conn: Connection,
) -> None:
    """The measuring side, in a process of its own: /healthz every 50 ms and the normal traffic,
    for `duration_s`; sends back what it measured. Apart from the attackers' event loop, so
    that their work does not show up as kvgate's latency."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)

    async def run() -> Phase:
        phase = Phase("probe")
        stop = asyncio.Event()
        # One request of each kind first: connections and lazy imports are not kvgate's latency.
        async with httpx.AsyncClient(timeout=30.0) as client:
            await client.get(f"{url}/healthz")
            await client.post(f"{url}/v1/completions", json=NORMAL_BODY)
            if control_rate > 0:
                await client.post(f"{backend}/v1/completions", json=NORMAL_BODY)
        conn.send("ready")
        tasks = [
            asyncio.create_task(poll_health(url, phase, stop)),
            asyncio.create_task(normal_traffic(url, rate, phase, stop)),
        ]
        if control_rate > 0:
            tasks.append(
                asyncio.create_task(normal_traffic(backend, control_rate, phase, stop, control=True))
            )
        await asyncio.sleep(duration_s)
        stop.set()
        await asyncio.gather(*tasks)
        return phase

    phase = asyncio.run(run())
    conn.send(
        (
            phase.normal_ms,
            dict(phase.normal_status),
            phase.health_ms,
            phase.health_at,
            phase.health_failures,
            phase.normal_detail,
            phase.control_ms,
        )
    )
    conn.close()


async def backend_idle(backend: str, timeout_s: float = 60.0) -> bool:
    """Wait (bounded) until vLLM reports no request running or waiting; False if it never did
    (other clients of a shared testbed), or when the backend has no such gauges."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                text = (await client.get(f"{backend}/metrics")).text
                busy = [
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
                ]
                if not busy:
                    return False
                if sum(busy) == 0:
                    return True
            await asyncio.sleep(0.2)
    return False


async def run_phase(
    name: str, url: str, port: int, pid: int, args: argparse.Namespace, attack: bool
) -> Phase:
    idle = await backend_idle(args.backend_url)
    print(f"{name} phase: the backend was {'idle' if idle else 'busy (shared)'} at the start", flush=True)
    phase = Phase(name)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    prober = multiprocessing.get_context("spawn").Process(
        target=probe,
        args=(
            url,
            args.backend_url,
            args.rate,
            args.control_rate,
            args.phase_s,
            cpu_set(args.probe_cpus),
            child,
        ),
        daemon=True,
    )
    prober.start()
    loop = asyncio.get_running_loop()
    if await loop.run_in_executor(None, parent.recv) != "ready":
        raise RuntimeError("the probe did not start")
    phase.lag_before = await loop.run_in_executor(None, loop_lag_buckets, url)
    phase.started_at = time.monotonic()
    client_cpu = resource.getrusage(resource.RUSAGE_SELF)
    gateway_cpu = cpu_seconds(pid)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(sample_rss(pid, phase, stop))]
    if attack:
        kinds = set(args.attacks.split(","))
        if "slowloris" in kinds:
            tasks += [asyncio.create_task(trickler(port, n % 2 == 1, phase, stop)) for n in range(args.slow)]
        if "templates" in kinds:
            tasks += [
                asyncio.create_task(template_attacker(url, args.template_rate / 2, phase, stop))
                for _ in range(2)
            ]
        if "huge" in kinds:
            tasks += [
                asyncio.create_task(huge_body_attacker(url, args.max_body_bytes, n, phase, stop))
                for n in range(2)
            ]
        if "hugejson" in kinds:
            tasks += [
                asyncio.create_task(huge_json_attacker(url, args.max_body_bytes, n, phase, stop))
                for n in range(2)
            ]
        if "nonreaders" in kinds:
            tasks += [asyncio.create_task(non_reader(port, phase, stop)) for _ in range(4)]
    normal_ms, statuses, health_ms, health_at, health_failures, detail, control = await loop.run_in_executor(
        None, parent.recv
    )
    stop.set()
    used = resource.getrusage(resource.RUSAGE_SELF)
    phase.client_cpu_s = used.ru_utime + used.ru_stime - client_cpu.ru_utime - client_cpu.ru_stime
    phase.gateway_cpu_s = cpu_seconds(pid) - gateway_cpu
    phase.lag_after = await loop.run_in_executor(None, loop_lag_buckets, url)
    phase.stalls = [
        stall
        for stall in await loop.run_in_executor(None, loop_stalls, url)
        if float(str(stall["at_s"])) >= phase.started_at
    ]
    # Attackers blocked on kvgate get a bounded while to notice, then are cancelled.
    _, pending = await asyncio.wait(tasks, timeout=30)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    prober.join(10)
    phase.normal_ms, phase.health_ms, phase.health_failures = normal_ms, health_ms, health_failures
    phase.health_at = health_at
    phase.normal_detail, phase.control_ms = detail, control
    phase.normal_status.update(statuses)
    return phase


def report(quiet: Phase, attack: Phase, args: argparse.Namespace, alive: bool) -> None:
    print()
    print(f"{'phase':8} {'normal ok':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'healthz p99':>11} {'healthz max':>11} {'hz fail':>7} {'RSS peak MiB':>12} {'fds peak':>8}")  # fmt: skip
    for phase in (quiet, attack):
        print(
            f"{phase.name:8} {len(phase.normal_ms):>9} {quantile(phase.normal_ms, 0.5):>8.1f} "
            f"{quantile(phase.normal_ms, 0.99):>8.1f} {max(phase.normal_ms, default=float('nan')):>8.1f} "
            f"{quantile(phase.health_ms, 0.99):>11.1f} {max(phase.health_ms, default=float('nan')):>11.1f} "
            f"{phase.health_failures:>7} {phase.rss_peak / 2**20:>12.1f} {phase.fds_peak:>8}"
        )
    print()
    for phase in (quiet, attack):
        print(f"{phase.name} normal statuses: {dict(phase.normal_status)}")
    print(f"attack outcomes: {dict(sorted(attack.attacks.items()))}")
    p50 = quantile(attack.normal_ms, 0.5) / quantile(quiet.normal_ms, 0.5)
    p99 = quantile(attack.normal_ms, 0.99) / quantile(quiet.normal_ms, 0.99)
    growth = attack.rss_peak - quiet.rss_peak
    print()
    print(f"normal latency under attack / quiet: p50 x{p50:.2f}, p99 x{p99:.2f} (target <= 2)")
    if quiet.control_ms and attack.control_ms:
        print(
            f"the backend itself (control, {len(attack.control_ms)} requests): "
            f"p50 {quantile(quiet.control_ms, 0.5):.1f} -> {quantile(attack.control_ms, 0.5):.1f} ms "
            f"(x{quantile(attack.control_ms, 0.5) / quantile(quiet.control_ms, 0.5):.2f}), "
            f"p99 {quantile(quiet.control_ms, 0.99):.1f} -> {quantile(attack.control_ms, 0.99):.1f} ms "
            f"(x{quantile(attack.control_ms, 0.99) / quantile(quiet.control_ms, 0.99):.2f})"
        )
    print(
        f"healthz under attack: max {max(attack.health_ms, default=float('nan')):.1f} ms, "
        f"p99 {quantile(attack.health_ms, 0.99):.1f} ms over {len(attack.health_ms)} polls (target < 100 ms)"
    )
    print(
        f"RSS peak growth over the quiet peak: {growth / 2**20:.1f} MiB = "
        f"{growth / args.max_body_bytes:.2f} x max_body_bytes ({args.max_body_bytes / 2**20:.0f} MiB)"
    )
    print(f"kvgate alive at the end: {alive}")
    for phase in (quiet, attack):
        report_loop(phase, args)


def report_loop(phase: Phase, args: argparse.Namespace) -> None:
    """kvgate's event-loop lag over the phase, and what kvgate saw when /healthz was slowest."""
    before, after = phase.lag_before, phase.lag_after
    ticks = after.get(-1.0, 0.0) - before.get(-1.0, 0.0)

    def over(bound: float) -> int:
        return int(ticks - (after.get(bound, 0.0) - before.get(bound, 0.0)))

    print()
    print(
        f"{phase.name}: kvgate's loop over {ticks:.0f} ticks: {over(0.025)} late > 25 ms, {over(0.05)} > 50 ms, "
        f"{over(0.1)} > 100 ms; CPU over the phase: kvgate {phase.gateway_cpu_s:.1f} s, "
        f"this script (attackers) {phase.client_cpu_s:.1f} s of {args.phase_s:.0f} s"
    )
    causes = Counter(str(stall["cause"]) for stall in phase.stalls)
    worst = max((float(str(stall["lag_s"])) for stall in phase.stalls), default=0.0)
    print(f"  stalls >= 50 ms kept (latest 20): {dict(causes)}, worst {worst * 1000:.0f} ms")
    slowest = sorted(zip(phase.health_ms, phase.health_at, strict=True), reverse=True)[:5]
    for took_ms, at in slowest:
        # A stall that ended while this poll was out is the loop's share of its latency.
        seen = [
            stall
            for stall in phase.stalls
            if at - took_ms / 1000 - 0.01 <= float(str(stall["at_s"])) <= at + 0.01
        ]
        loop_ms = sum(float(str(stall["lag_s"])) for stall in seen) * 1000
        why = ", ".join(
            f"{float(str(s['lag_s'])) * 1000:.0f} ms {s['cause']} (loop CPU {float(str(s['loop_cpu_s'])) * 1000:.0f}"
            f" ms, run queue {float(str(s['runqueue_s'] or 'nan')) * 1000:.0f} ms,"
            f" gc {float(str(s.get('gc_s', 'nan'))) * 1000:.0f} ms)"
            for s in seen
        )
        print(f"  /healthz {took_ms:6.1f} ms at +{at - phase.started_at:5.1f} s: kvgate stalls then: {why or 'none'}"
              f" ({loop_ms:.0f} ms)")  # fmt: skip
    for sent_at, took_ms, queue_ms in sorted(phase.normal_detail, key=lambda d: -d[1])[:5]:
        seen = [
            s for s in phase.stalls if sent_at <= float(str(s["at_s"])) <= sent_at + took_ms / 1000 + 0.01
        ]
        loop_ms = sum(float(str(s["lag_s"])) for s in seen) * 1000
        print(
            f"  normal {took_ms:6.1f} ms sent at +{sent_at - phase.started_at:5.1f} s: queued {queue_ms:.0f} ms, "
            f"kvgate stalls then {loop_ms:.0f} ms"
        )


async def main_async(args: argparse.Namespace, url: str, port: int, pid: int) -> tuple[Phase, Phase]:
    # Warm up: the first requests load code paths and the output model.
    async with httpx.AsyncClient(timeout=60.0) as client:
        for _ in range(5):
            await client.post(f"{url}/v1/completions", json=NORMAL_BODY)
    quiet = await run_phase("quiet", url, port, pid, args, attack=False)
    print(f"quiet phase done: {len(quiet.normal_ms)} normal requests", flush=True)
    attack = await run_phase("attack", url, port, pid, args, attack=True)
    print(f"attack phase done: {len(attack.normal_ms)} normal requests", flush=True)
    return quiet, attack


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backend", default=os.environ.get("KVGATE_TEST_VLLM_URL"), help="vLLM URL (else kvgate sim)"
    )
    parser.add_argument("--phase-s", type=float, default=40.0, help="seconds per phase (default 40)")
    parser.add_argument("--rate", type=float, default=4.0, help="normal requests per second (default 4)")
    parser.add_argument(
        "--control-rate",
        type=float,
        default=1.0,
        help="the same requests sent to the backend itself, per second (default 1; 0: none)",
    )
    parser.add_argument("--slow", type=int, default=300, help="slowloris connections (default 300)")
    parser.add_argument("--template-rate", type=float, default=10.0, help="template requests/s (default 10)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument(
        "--attacks",
        default=",".join(DEFAULT_ATTACKS),
        help=f"comma-separated attacks to run together, of {','.join(ATTACKS)} "
        f"(default {','.join(DEFAULT_ATTACKS)})",
    )
    parser.add_argument("--memory-cap-gib", type=float, default=6.0, help="kvgate's address-space cap")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--gateway-cpus", default="0", help="CPUs for kvgate (taskset list; default 0)")
    parser.add_argument("--attacker-cpus", default="0", help="CPUs for this script's attackers (default 0)")
    parser.add_argument("--probe-cpus", default="all", help="CPUs for the prober process (default all)")
    args = parser.parse_args()
    if not set(args.attacks.split(",")) <= set(ATTACKS):
        parser.error(f"--attacks takes a comma-separated subset of {','.join(ATTACKS)}")
    if (
        not 1 <= args.slow <= 2000
        or not 0 < args.rate <= 50
        or not 1 <= args.phase_s <= 600
        or not 0 < args.template_rate <= 200
        or not 0 <= args.control_rate <= 50
    ):
        parser.error(
            "--slow within 1..2000, --rate within (0, 50], --phase-s within 1..600, --template-rate within (0, 200], --control-rate within [0, 50]"
        )
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpu_set(args.attacker_cpus))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvgate-attack-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        backend = args.backend or None
        if backend is None:
            sim_port = free_port()
            sim = stack.enter_context(
                started(
                    [sys.executable, "-m", "gateway.cli", "sim", "--port", str(sim_port)],
                    log_dir / "sim.log",
                    args.gateway_cpus,
                )
            )
            backend = f"http://127.0.0.1:{sim_port}"
            wait_until(lambda: http_status(f"{backend}/health") == 200, sim, "kvgate sim")
        for attempt in range(3):
            port = free_port()
            command = [
                sys.executable, "-m", "gateway.cli", "serve",
                "--backend", backend, "--port", str(port), "--tokenizer", str(MODEL_DIR),
                "--log-level", "warning", "--set", f"max_body_bytes={args.max_body_bytes}",
            ]  # fmt: skip
            gateway = stack.enter_context(
                started(
                    command,
                    log_dir / f"kvgate-{attempt}.log",
                    args.gateway_cpus,
                    int(args.memory_cap_gib * 2**30),
                )
            )
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until(lambda: http_status(f"{url}/readyz") == 200, gateway, "kvgate serve")  # noqa: B023
                break
            except RuntimeError:  # the free port was taken before kvgate bound it: another one
                if attempt == 2:
                    raise
        args.backend_url = backend
        print(f"kvgate pid {gateway.pid} on {url} in front of {backend}; logs in {log_dir}", flush=True)
        quiet, attack = asyncio.run(main_async(args, url, port, gateway.pid))
        alive = gateway.poll() is None and http_status(f"{url}/healthz") == 200
        report(quiet, attack, args, alive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
