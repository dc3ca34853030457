"""Benchmark: kvgate's CPU per relayed token with many streams, the emulator as backend (not a test).

    .venv/bin/python tests/benchmarks/relay_cpu.py [--streams 1000] [--tokens-per-stream 100]
        [--repeat 3] [--direct] [--kvgate-repo PATH ...] [--json]

Starts the emulator (`python -m sim.cli`, a pool far larger than the streams need so that
nothing queues or preempts, every step the same fixed time) and, per run, a fresh
`kvgate serve` child process in front of it, then opens `--streams` streaming completions at
once, each `--tokens-per-stream` tokens long (`ignore_eos`), through kvgate. It reads each
process's CPU time (user + system, all threads) from the kernel before and after, and
reports microseconds of kvgate CPU per relayed token:

- `whole`: from before the first request to after the last answer, so per-request work
  (parsing, counting, admission, the request log) is spread over the tokens;
- `steady`: from the moment every stream has its first token to the moment the first stream
  ends: the relay alone, with every stream open.

kvgate runs pinned to `--kvgate-cpu`, the emulator and this client on `--sim-cpu` /
`--client-cpu` (the other core of a 2-core machine). The client is a bare asyncio protocol
around httptools' parser (a few microseconds per token) that counts the SSE events with
choices as they arrive; the run fails when any stream does not end with `[DONE]` or when the
count differs from the tokens the emulator generated (its `/sim/state`). The emulator's own
CPU per token is reported beside kvgate's, and its share of a core: near 1 it is the
bottleneck and the figures are not kvgate's (raise `--step-ms`). So is kvgate's share: near 1
kvgate falls behind the emulator, reads several events per chunk and looks cheaper per token
than it is at the offered rate.

`--direct` also runs the same load straight at the emulator (client-side numbers and the
emulator's CPU per token without kvgate); `--kvgate-repo` names checkouts whose `gateway`
package is run (default this one), several of them alternating run after run, for a
before/after comparison on one machine state.

`--reference pipe` and `--reference nginx` run, in every round beside kvgate and pinned to the
same core, a relay that does less than kvgate, so that kvgate's figure has a scale on the same
machine state: `pipe` is tests/benchmarks/byte_pipe.py (bytes piped between two sockets on
uvloop, the floor of a Python relay on kvgate's event loop), `nginx` one nginx process
(`master_process off`, `proxy_buffering off`, keep-alive to the emulator; it needs the nginx
binary: `apt-get install nginx-light`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sim.bench_concurrency import bench_config  # noqa: E402
from sim.config import SimConfig  # noqa: E402
from sim.testing import engine_idle, sim_process, wait_for  # noqa: E402

DEFAULT_STREAMS = 1000
DEFAULT_TOKENS_PER_STREAM = 100
# 1,000 streams at one token per 100 ms step offer 10,000 tokens/s: half a core at 50 us per
# token, so that kvgate keeps up (a relay that falls behind reads several events per chunk).
DEFAULT_STEP_MS = 100.0
DEFAULT_PROMPT_TOKENS = 16
# The pool is this many times what the streams need: kvgate must admit every stream at once.
POOL_HEADROOM = 4
KVGATE_READY_TIMEOUT_S = 60.0
# Streams of the warm-up load, each of a few tokens: the first requests' lazy paths
# (imports, the tokenizer, the connection pool) are not measured.
WARMUP_STREAMS = 50
WARMUP_TOKENS = 4
# kvgate's default pool of backend connections; more streams need more.
KVGATE_DEFAULT_MAX_CONNECTIONS = 1024
# On a shared machine the emulator's /metrics can come late under the load; with the default
# freshness kvgate then counts the budget unknown and sheds (503). What is measured is the
# relay: kvgate waits longer for a scrape here.
KVGATE_BUDGET_SETTINGS = ("metrics_timeout_s=5", "metrics_stale_after_s=10")
MODEL = "tiny-llama"
REFERENCES = ("pipe", "nginx")
NGINX_CONFIG = """daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 16384;
error_log {workdir}/nginx-error.log warn;
pid {workdir}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    upstream emulator {{ server {backend}; keepalive 2048; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://emulator;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 60s;
        }}
    }}
}}
"""


# -- CPU counters -------------------------------------------------------------------------------


def system_seconds(pid: int) -> float:
    """Of the CPU time of `pid`, the part in the kernel (/proc/<pid>/stat, in clock ticks): on
    loopback, a send also runs the receiving side's TCP processing, counted to the sender."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process `pid` and all its threads, dead ones included.

    The process's CPU-time clock (what glibc's clock_getcpuclockid returns: the kernel's
    MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)) counts in nanoseconds, where /proc/<pid>/stat
    counts in clock ticks (10 ms), too coarse for a short run."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Sample:
    """What the counters read at one moment of a load."""

    at: float  # perf_counter seconds
    tokens: int  # counted by the client so far
    cpu_s: dict[str, float]  # per process name ("client" is this one)
    system_s: dict[str, float]  # of which in the kernel


def sample(pids: dict[str, int], tokens: int) -> Sample:
    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    cpu["client"] = time.process_time()
    system = {name: system_seconds(pid) for name, pid in pids.items()}
    system["client"] = os.times().system
    return Sample(time.perf_counter(), tokens, cpu, system)


# -- the client ---------------------------------------------------------------------------------


def completion_request(host: str, port: int, index: int, prompt_tokens: int, tokens: int) -> bytes:
    # A prompt of token ids: counted exactly without a tokenizer, by kvgate and the emulator.
    prompt = ",".join([str(1000 + index % 20000)] * prompt_tokens)
    body = (
        f'{{"model":"{MODEL}","prompt":[{prompt}],"max_tokens":{tokens},"ignore_eos":true,"stream":true}}'
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


# An event with a token; the emulator's events are compact JSON, one per token (completions:
# no role event; a usage event, not asked for here, would have empty choices).
_EVENT = b'data: {"'
_NO_CHOICES = b'"choices":[]'
_DONE = b"data: [DONE]\n\n"


class _Load:
    """Counts over every stream of one load, and the two samples of its steady window."""

    def __init__(self, streams: int, pids: dict[str, int]) -> None:
        self.streams = streams
        self.pids = pids
        self.tokens = 0
        self.started = 0  # streams that have a first token
        self.finished = 0
        self.errors: list[str] = []
        self.gaps: list[float] = []
        self.first_token_at: list[float] = []
        self.steady_start: Sample | None = None
        self.steady_end: Sample | None = None

    def first_token(self, now: float) -> None:
        self.first_token_at.append(now)
        self.started += 1
        if self.started == self.streams and self.steady_end is None:
            self.steady_start = sample(self.pids, self.tokens)

    def stream_done(self) -> None:
        self.finished += 1
        if self.finished == 1:
            self.steady_end = sample(self.pids, self.tokens)


class _Stream(asyncio.Protocol):
    """One request on its own connection (`connection: close`), its SSE events counted."""

    def __init__(self, load: _Load, request: bytes, done: asyncio.Future[None]) -> None:
        self._load = load
        self._request = request
        self._done = done
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._pending = b""  # the start of an event whose end has not arrived
        self._tokens = 0
        self._last: float | None = None
        self._ended = False  # [DONE] seen
        self._complete = False
        self._status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed response: {exc}")

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        data = self._pending + body if self._pending else body
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return
        end += 2
        self._pending = data[end:]
        tokens = data.count(_EVENT, 0, end) - data.count(_NO_CHOICES, 0, end)
        if data.find(_DONE, 0, end) >= 0:
            self._ended = True
        if tokens <= 0:
            return
        now = time.perf_counter()
        load = self._load
        load.tokens += tokens
        self._tokens += tokens
        if self._last is None:
            load.first_token(now)
        else:
            load.gaps.append(now - self._last)
        self._last = now

    def on_message_complete(self) -> None:
        self._complete = True
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._complete:
            self._fail(f"connection lost before the end of the response ({exc})")
        elif self._status != 200:
            self._fail(f"status {self._status}")
        elif not self._ended or self._pending:
            self._fail("the stream did not end with [DONE]")
        if not self._done.done():
            self._load.stream_done()
            self._done.set_result(None)

    def _fail(self, why: str) -> None:
        if not self._done.done():
            self._load.errors.append(why)
            self._load.stream_done()
            self._done.set_result(None)
        if self._transport is not None:
            self._transport.close()


@dataclass(frozen=True, slots=True)
class Window:
    """CPU seconds per process over one span of a load, and the tokens counted in it."""

    seconds: float
    tokens: int
    cpu_s: dict[str, float]
    system_s: dict[str, float]

    def us_per_token(self, name: str) -> float:
        return self.cpu_s[name] / self.tokens * 1e6 if self.tokens else float("nan")

    def us_per_token_net(self, name: str, idle_share: float) -> float:
        """us per token net of what the process spends idle (its pollers and timers) over
        the window's length: what the tokens cost, whatever their rate."""
        spent = self.cpu_s[name] - idle_share * self.seconds
        return spent / self.tokens * 1e6 if self.tokens else float("nan")

    def core_share(self, name: str) -> float:
        return self.cpu_s[name] / self.seconds if self.seconds > 0 else float("nan")


def window(start: Sample, end: Sample) -> Window:
    return Window(
        seconds=end.at - start.at,
        tokens=end.tokens - start.tokens,
        cpu_s={name: end.cpu_s[name] - start.cpu_s[name] for name in start.cpu_s},
        system_s={name: end.system_s[name] - start.system_s[name] for name in start.system_s},
    )


@dataclass(frozen=True, slots=True)
class LoadResult:
    target: str  # "kvgate", "emulator" or a reference relay (REFERENCES)
    label: str  # which kvgate checkout, "direct", or the reference's name
    streams: int
    tokens_per_stream: int
    tokens_counted: int
    tokens_generated: int  # by the emulator, from /sim/state
    errors: list[str]
    whole: Window
    steady: Window | None
    all_first_token_s: float
    gap_p50_ms: float
    gap_p99_ms: float
    idle_cpu_share: dict[str, float] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return not self.errors and self.tokens_counted == self.tokens_generated == self.expected

    @property
    def expected(self) -> int:
        return self.streams * self.tokens_per_stream

    def to_json(self) -> dict[str, Any]:
        def describe(span: Window | None) -> dict[str, Any] | None:
            if span is None:
                return None
            idle = self.idle_cpu_share
            return {
                "us_per_token_net_of_idle": {
                    name: round(span.us_per_token_net(name, idle[name]), 3) for name in idle
                },
                "seconds": round(span.seconds, 4),
                "tokens": span.tokens,
                "cpu_s": {name: round(value, 6) for name, value in span.cpu_s.items()},
                "us_per_token": {name: round(span.us_per_token(name), 3) for name in span.cpu_s},
                "core_share": {name: round(span.core_share(name), 3) for name in span.cpu_s},
                "system_share": {
                    name: round(span.system_s[name] / span.cpu_s[name], 3) if span.cpu_s[name] > 0 else None
                    for name in span.cpu_s
                },
            }

        return {
            "target": self.target,
            "label": self.label,
            "streams": self.streams,
            "tokens_per_stream": self.tokens_per_stream,
            "tokens_expected": self.expected,
            "tokens_counted": self.tokens_counted,
            "tokens_generated": self.tokens_generated,
            "exact": self.exact,
            "errors": len(self.errors),
            "first_errors": self.errors[:5],
            "whole": describe(self.whole),
            "steady": describe(self.steady),
            "all_first_token_s": round(self.all_first_token_s, 4),
            "gap_p50_ms": round(self.gap_p50_ms, 3),
            "gap_p99_ms": round(self.gap_p99_ms, 3),
            "idle_cpu_share": {name: round(value, 4) for name, value in self.idle_cpu_share.items()},
        }


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def generated_tokens(sim_url: str) -> int:
    total: int = _get_json(f"{sim_url}/sim/state")["generation_tokens_total"]
    return total


async def _run_streams(
    url: str,
    streams: int,
    prompt_tokens: int,
    tokens: int,
    pids: dict[str, int],
    make_load: Callable[[int, dict[str, int]], _Load] = _Load,
) -> tuple[_Load, Sample, Sample]:
    host, _, port_text = url.removeprefix("http://").partition(":")
    port = int(port_text)
    loop = asyncio.get_running_loop()
    load = make_load(streams, pids)
    requests = [completion_request(host, port, i, prompt_tokens, tokens) for i in range(streams)]
    done = [loop.create_future() for _ in range(streams)]
    before = sample(pids, 0)

    async def open_one(request: bytes, finished: asyncio.Future[None]) -> None:
        try:
            await loop.create_connection(lambda: _Stream(load, request, finished), host, port)
        except OSError as exc:
            load.errors.append(f"connect: {exc}")
            load.stream_done()
            finished.set_result(None)

    await asyncio.gather(*(open_one(r, d) for r, d in zip(requests, done, strict=True)))
    await asyncio.gather(*done)
    after = sample(pids, load.tokens)
    return load, before, after


def run_load(
    url: str,
    sim_url: str,
    *,
    target: str,
    label: str,
    streams: int,
    tokens: int,
    prompt_tokens: int,
    pids: dict[str, int],
    idle_cpu_share: dict[str, float] | None = None,
    make_load: Callable[[int, dict[str, int]], _Load] = _Load,
) -> LoadResult:
    """One load through `url`. `make_load(streams, pids)` builds its counters: a subclass of
    _Load may look at the processes at its moments (tests/benchmarks/workers_cpu.py does)."""
    generated_before = generated_tokens(sim_url)
    load, before, after = asyncio.run(_run_streams(url, streams, prompt_tokens, tokens, pids, make_load))
    wait_for(lambda: engine_idle(sim_url), timeout_s=30.0)
    generated = generated_tokens(sim_url) - generated_before
    gaps = sorted(load.gaps)
    steady = None
    if load.steady_start is not None and load.steady_end is not None:
        steady = window(load.steady_start, load.steady_end)
    return LoadResult(
        target=target,
        label=label,
        streams=streams,
        tokens_per_stream=tokens,
        tokens_counted=load.tokens,
        tokens_generated=generated,
        errors=load.errors,
        whole=window(before, after),
        steady=steady,
        all_first_token_s=(max(load.first_token_at) - before.at) if load.first_token_at else float("nan"),
        gap_p50_ms=statistics.median(gaps) * 1e3 if gaps else float("nan"),
        gap_p99_ms=gaps[int(0.99 * (len(gaps) - 1))] * 1e3 if gaps else float("nan"),
        idle_cpu_share=idle_cpu_share or {},
    )


# -- processes ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sim_config(streams: int, prompt_tokens: int, tokens: int, step_ms: float) -> SimConfig:
    """The emulator's shape: sim.bench_concurrency's (every stream scheduled in every step of a
    fixed time), with a pool POOL_HEADROOM times larger for kvgate's budget."""
    config = bench_config(streams, prompt_tokens, tokens, step_ms)
    engine = config.engine
    needed = engine.num_blocks - 64
    engine = dataclasses.replace(engine, num_blocks=needed * POOL_HEADROOM + 64)
    return dataclasses.replace(config, engine=engine, model_name=MODEL)


@contextlib.contextmanager
def kvgate_process(
    repo: Path, backend_url: str, cpu: int | None, log: Path, extra_args: Sequence[str], streams: int
) -> Iterator[tuple[str, int]]:
    """`kvgate serve` from checkout `repo` in front of `backend_url`; yields (url, pid)."""
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--backend", backend_url, "--port", str(port)]
    for assignment in KVGATE_BUDGET_SETTINGS:
        command += ["--set", assignment]
    if streams + WARMUP_STREAMS > KVGATE_DEFAULT_MAX_CONNECTIONS:
        command += ["--set", f"max_connections={streams + WARMUP_STREAMS}"]
    command += list(extra_args)
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]  # taskset execs: the pid is kvgate's
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONPATH"] = str(repo)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/readyz", timeout=2) as answer:
            return bool(answer.status == 200)
        return False

    with _ready_child("kvgate", command, log, ready, cwd=repo, env=env) as pid:
        yield url, pid


@contextlib.contextmanager
def _ready_child(
    name: str,
    command: list[str],
    log: Path,
    ready: Callable[[], bool],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[int]:
    """Start `command` (output to `log`), wait until `ready()`, yield its pid; stop it after
    (SIGTERM, then SIGKILL after 20 s)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + KVGATE_READY_TIMEOUT_S
        while not ready():
            if process.poll() is not None:
                raise SystemExit(f"{name} exited with {process.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} did not become ready; see {log}")
            time.sleep(0.1)
        yield process.pid
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _accepting(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def reference_process(
    name: str, backend_url: str, cpu: int | None, workdir: Path, log: Path
) -> Iterator[tuple[str, int]]:
    """One reference relay (see REFERENCES) in front of `backend_url`; yields (url, pid)."""
    port = free_port()
    backend = backend_url.removeprefix("http://")
    if name == "pipe":
        command = [sys.executable, str(HERE / "byte_pipe.py"), "--port", str(port), "--upstream", backend]
    else:
        nginx = shutil.which("nginx") or next(
            (path for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(path)), None
        )
        if nginx is None:
            raise SystemExit("--reference nginx needs the nginx binary: apt-get install nginx-light")
        config = workdir / f"nginx-{port}.conf"
        config.write_text(NGINX_CONFIG.format(workdir=workdir, backend=backend, port=port))
        command = [nginx, "-c", str(config), "-p", str(workdir)]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    with _ready_child(name, command, log, lambda: _accepting(port)) as pid:
        yield f"http://127.0.0.1:{port}", pid


def idle_share(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's share of a core while nothing is asked of it (pollers, timers)."""
    start = sample(pids, 0)
    time.sleep(seconds)
    span = window(start, sample(pids, 0))
    return {name: span.core_share(name) for name in pids}


# -- the benchmark ------------------------------------------------------------------------------


@dataclass
class Options:
    streams: int = DEFAULT_STREAMS
    tokens_per_stream: int = DEFAULT_TOKENS_PER_STREAM
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    step_ms: float = DEFAULT_STEP_MS
    repeat: int = 1
    direct: bool = False
    repos: list[Path] = field(default_factory=lambda: [REPO])
    kvgate_cpu: int | None = 0
    sim_cpu: int | None = 1
    client_cpu: int | None = 1
    kvgate_args: list[str] = field(default_factory=list)
    references: list[str] = field(default_factory=list)
    idle_s: float = 1.0
    workdir: Path | None = None


def run_benchmark(
    options: Options, report: Callable[[LoadResult], None] = lambda result: None
) -> list[LoadResult]:
    """Every run of the benchmark, in the order they ran."""
    if options.client_cpu is not None:
        os.sched_setaffinity(0, {options.client_cpu})
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="kvgate-relay-cpu-"))
    config = sim_config(options.streams, options.prompt_tokens, options.tokens_per_stream, options.step_ms)
    results: list[LoadResult] = []

    def measure(url: str, target: str, label: str, pids: dict[str, int], idle: dict[str, float]) -> None:
        result = run_load(url, sim.url, target=target, label=label, pids=pids,
                          streams=options.streams, tokens=options.tokens_per_stream,
                          prompt_tokens=options.prompt_tokens, idle_cpu_share=idle)  # fmt: skip
        results.append(result)
        report(result)

    with sim_process(config, cpu=options.sim_cpu, log=workdir / "sim.log") as sim:
        for round_no in range(options.repeat):
            for index, repo in enumerate(options.repos):
                label = str(repo) if len(options.repos) > 1 else "kvgate"
                log = workdir / f"kvgate-{round_no}-{index}.log"
                with kvgate_process(
                    repo, sim.url, options.kvgate_cpu, log, options.kvgate_args, options.streams
                ) as (url, pid):
                    pids = {"kvgate": pid, "emulator": sim.pid}
                    run_load(url, sim.url, target="kvgate", label=label, pids=pids,
                             streams=WARMUP_STREAMS, tokens=WARMUP_TOKENS,
                             prompt_tokens=options.prompt_tokens)  # fmt: skip
                    idle = idle_share(pids, options.idle_s) if options.idle_s > 0 else {}
                    measure(url, "kvgate", label, pids, idle)
            for name in options.references:
                log = workdir / f"{name}-{round_no}.log"
                with reference_process(name, sim.url, options.kvgate_cpu, workdir, log) as (url, pid):
                    pids = {"relay": pid, "emulator": sim.pid}
                    run_load(url, sim.url, target=name, label=name, pids=pids,
                             streams=WARMUP_STREAMS, tokens=WARMUP_TOKENS,
                             prompt_tokens=options.prompt_tokens)  # fmt: skip
                    idle = idle_share(pids, options.idle_s) if options.idle_s > 0 else {}
                    measure(url, name, name, pids, idle)
            if options.direct:
                pids = {"emulator": sim.pid}
                idle = idle_share(pids, options.idle_s) if options.idle_s > 0 else {}
                measure(sim.url, "emulator", "direct", pids, idle)
    return results


def describe(result: LoadResult) -> str:
    def figures(span: Window | None, what: str) -> str:
        if span is None:
            return f"{what}: none"
        parts = [f"{what} {span.tokens} tokens in {span.seconds:.2f} s:"]
        for name in ("kvgate", "relay", "emulator", "client"):
            if name in span.cpu_s:
                system = span.system_s[name] / span.cpu_s[name] if span.cpu_s[name] > 0 else 0.0
                parts.append(
                    f"{name} {span.us_per_token(name):6.2f} us/token "
                    f"({span.core_share(name):.2f} core, {system:.0%} sys)"
                )
        return "  ".join(parts)

    check = "exact" if result.exact else "NOT EXACT"
    lines = [
        f"{result.target} [{result.label}]: {result.tokens_counted} tokens counted, "
        f"{result.tokens_generated} generated, {result.expected} expected ({check}); "
        f"{len(result.errors)} errors; all first tokens at {result.all_first_token_s:.2f} s; "
        f"gap p50 {result.gap_p50_ms:.1f} ms p99 {result.gap_p99_ms:.1f} ms",
        "  " + figures(result.whole, "whole "),
        "  " + figures(result.steady, "steady"),
    ]
    if result.idle_cpu_share:
        lines.append(
            "  idle: "
            + ", ".join(f"{name} {share:.3f} core" for name, share in result.idle_cpu_share.items())
        )
    if result.errors:
        lines.append(f"  first errors: {result.errors[:3]}")
    return "\n".join(lines)


def _relay_name(target: str) -> str:
    """The process a run's figures are about, by its name in the run's counters."""
    if target == "kvgate":
        return "kvgate"
    return "relay" if target in REFERENCES else "emulator"


def summary(results: list[LoadResult]) -> dict[str, dict[str, float]]:
    """Per label: the median over its runs of kvgate's (or the emulator's) us per token."""
    figures: dict[str, dict[str, float]] = {}
    for label in dict.fromkeys(result.label for result in results):
        runs = [result for result in results if result.label == label]
        name = _relay_name(runs[0].target)
        steady = [r.steady.us_per_token(name) for r in runs if r.steady is not None]
        net = [
            r.steady.us_per_token_net(name, r.idle_cpu_share[name])
            for r in runs
            if r.steady is not None and name in r.idle_cpu_share
        ]
        figures[label] = {
            "runs": len(runs),
            "whole_us_per_token": round(statistics.median(r.whole.us_per_token(name) for r in runs), 3),
            "steady_us_per_token": round(statistics.median(steady), 3) if steady else float("nan"),
            "steady_net_of_idle_us_per_token": round(statistics.median(net), 3) if net else float("nan"),
            "emulator_whole_us_per_token": round(
                statistics.median(r.whole.us_per_token("emulator") for r in runs), 3
            ),
        }
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=DEFAULT_STREAMS, help="concurrent streams")
    parser.add_argument("--tokens-per-stream", type=int, default=DEFAULT_TOKENS_PER_STREAM)
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS, help="the emulator's step time")
    parser.add_argument("--repeat", type=int, default=1, help="runs per kvgate checkout")
    parser.add_argument("--direct", action="store_true", help="also run the load straight at the emulator")
    parser.add_argument(
        "--kvgate-repo",
        type=Path,
        action="append",
        default=None,
        help="checkout whose gateway package kvgate runs (repeatable: runs alternate; default this one)",
    )
    parser.add_argument("--kvgate-cpu", type=int, default=0)
    parser.add_argument("--sim-cpu", type=int, default=1)
    parser.add_argument("--client-cpu", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="pin no process to a core")
    parser.add_argument("--kvgate-args", default="", help="more `kvgate serve` arguments")
    parser.add_argument(
        "--reference",
        choices=REFERENCES,
        action="append",
        default=[],
        help="also run this relay in every round, on kvgate's core (repeatable; see above)",
    )
    parser.add_argument("--idle-s", type=float, default=1.0, help="idle CPU measured this long before a run")
    parser.add_argument("--json", action="store_true", help="print every run and the summary as JSON")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.tokens_per_stream < 1:
        parser.error("--streams and --tokens-per-stream must be at least 1")
    pins = (None, None, None) if args.no_pin else (args.kvgate_cpu, args.sim_cpu, args.client_cpu)
    options = Options(
        streams=args.streams,
        tokens_per_stream=args.tokens_per_stream,
        prompt_tokens=args.prompt_tokens,
        step_ms=args.step_ms,
        repeat=args.repeat,
        direct=args.direct,
        repos=[path.resolve() for path in args.kvgate_repo] if args.kvgate_repo else [REPO],
        kvgate_cpu=pins[0],
        sim_cpu=pins[1],
        client_cpu=pins[2],
        kvgate_args=args.kvgate_args.split(),
        references=list(dict.fromkeys(args.reference)),
        idle_s=args.idle_s,
    )

    def report(result: LoadResult) -> None:
        if not args.json:
            print(describe(result), flush=True)

    results = run_benchmark(options, report)
    figures = summary(results)
    if args.json:
        print(json.dumps({"runs": [r.to_json() for r in results], "summary": figures}, indent=2))
    else:
        print("\nsummary (median over runs): us of CPU per relayed token")
        for label, row in figures.items():
            print(
                f"  {label}: whole {row['whole_us_per_token']:.2f}  steady {row['steady_us_per_token']:.2f}  "
                f"steady net of idle {row['steady_net_of_idle_us_per_token']:.2f}  "
                f"(emulator {row['emulator_whole_us_per_token']:.2f}; {row['runs']:g} runs)"
            )
    return 0 if all(result.exact for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
