"""Benchmark: one kvgate in front of a fleet of emulated backends at scale (not a test).

    .venv/bin/python tests/benchmarks/fleet_scale.py [--backends 4] [--concurrency 2000]
        [--requests 20000] [--tokens 16] [--json build/fleet_scale.json]

Starts `--backends` emulators (`python -m sim.cli`, each with room for its share of the
streams, fixed-time steps) and one `kvgate serve --backend ... --backend ...` in front of
them, then keeps `--concurrency` streaming completions open at once until `--requests` have
been sent, each on its own connection, each `--tokens` tokens long (`ignore_eos`, a prompt of
token ids). It passes when every request ended with 200 and `[DONE]` (none lost, none refused
for want of a connection: no 503/504/connection error), the tokens the clients counted equal
the tokens the emulators generated, kvgate's ledgers and queues are empty at the end, and the
backends carried even shares (each within EVEN_SHARE of 1/N of the requests: the identical
emulators and prompts that share nothing leave no reason to favour one). It prints each
backend's share of the requests, the codes of kvgate's refusals, the throughput and kvgate's CPU
per token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sim.config import SimConfig  # noqa: E402
from sim.engine import EngineConfig, StepCost  # noqa: E402
from sim.testing import cli_args  # noqa: E402

MODEL = "tiny-llama"
PROMPT_TOKENS = 32
ADMIN_TOKEN = "fleet-scale"
_EVENT = b'data: {"'
_NO_CHOICES = b'"choices":[]'
_DONE = b"data: [DONE]\n\n"
# How far a backend's share of the requests may stray from an even 1/N, relative to it: the
# fleet issue's 40-60% for two backends.
EVEN_SHARE = 0.2


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    tokens: int = 0
    failures: Counter[str] = field(default_factory=Counter)


class _Stream(asyncio.Protocol):
    """One streaming request on its own connection; counts its token events."""

    def __init__(self, tally: Tally, request: bytes, done: asyncio.Future[None]) -> None:
        self._tally, self._request, self._done = tally, request, done
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._pending = b""
        self._status = 0
        self._complete = self._ended = False
        self._tokens = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(f"malformed response: {exc}")

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
        self._tokens += data.count(_EVENT, 0, end) - data.count(_NO_CHOICES, 0, end)
        if data.find(_DONE, 0, end) >= 0:
            self._ended = True

    def on_message_complete(self) -> None:
        self._complete = True
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._status != 200 and self._status:
            self._end(f"status {self._status}")
        elif not self._complete:
            self._end("connection lost before the end")
        elif not self._ended:
            self._end("no [DONE]")
        else:
            self._end(None)

    def _end(self, failure: str | None) -> None:
        if self._done.done():
            return
        if failure is None:
            self._tally.ok += 1
            self._tally.tokens += self._tokens
        else:
            self._tally.failures[failure] += 1
        self._done.set_result(None)
        if self._transport is not None:
            self._transport.close()


def request_bytes(port: int, index: int, tokens: int) -> bytes:
    prompt = ",".join([str(1000 + index % 20000)] * PROMPT_TOKENS)
    body = f'{{"model":"{MODEL}","prompt":[{prompt}],"max_tokens":{tokens},"ignore_eos":true,"stream":true}}'.encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


def _same(stream: _Stream) -> _Stream:
    return stream


async def drive(port: int, concurrency: int, requests: int, tokens: int) -> Tally:
    loop = asyncio.get_running_loop()
    tally = Tally()

    async def worker() -> None:
        while tally.sent < requests:
            index = tally.sent
            tally.sent += 1
            done: asyncio.Future[None] = loop.create_future()
            stream = _Stream(tally, request_bytes(port, index, tokens), done)
            try:
                await loop.create_connection(functools.partial(_same, stream), "127.0.0.1", port)
            except OSError as exc:
                tally.failures[f"connect: {exc.__class__.__name__}"] += 1
                continue
            await done

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


@contextlib.contextmanager
def process(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        child = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def wait_for(url: str, what: str, timeout_s: float = 60.0, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            request = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not come up")
        time.sleep(0.1)


def sim_config(streams_each: int, tokens: int, step_ms: float) -> SimConfig:
    blocks = -(-(PROMPT_TOKENS + tokens) // 32)
    return SimConfig(
        engine=EngineConfig(
            num_blocks=2 * streams_each * blocks + 64,
            block_size=32,
            max_num_seqs=streams_each * 2,
            max_num_batched_tokens=max(2048, 2 * streams_each * PROMPT_TOKENS),
            step_cost=StepCost(base_s=step_ms / 1e3, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
        ),
        model_name=MODEL,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-fleet-scale-"))
    config = sim_config(-(-args.concurrency // args.backends), args.tokens, args.step_ms)
    ports = [free_port() for _ in range(args.backends)]
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports):
            command = [
                sys.executable,
                "-m",
                "sim.cli",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *cli_args(config),
            ]
            stack.enter_context(process(command, workdir / f"sim{i}.log"))
        for port in ports:
            wait_for(f"http://127.0.0.1:{port}/health", "an emulator")
        kvgate_port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(kvgate_port)]
        for i, port in enumerate(ports):
            command += ["--backend", f"sim{i}=http://127.0.0.1:{port}"]
        command += ["--set", "log_level=warning"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        env["KVGATE_ADMIN_TOKEN"] = ADMIN_TOKEN
        kvgate = stack.enter_context(process(command, workdir / "kvgate.log", env))
        wait_for(f"http://127.0.0.1:{kvgate_port}/readyz", "kvgate")
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        generated_before = sum(
            get_json(f"http://127.0.0.1:{p}/sim/state")["generation_tokens_total"] for p in ports
        )
        cpu_before, started = cpu_seconds(kvgate.pid), time.monotonic()
        tally = asyncio.run(drive(kvgate_port, args.concurrency, args.requests, args.tokens))
        elapsed, cpu = time.monotonic() - started, cpu_seconds(kvgate.pid) - cpu_before
        state = get_json(f"http://127.0.0.1:{kvgate_port}/admin/state", admin)
        generated = (
            sum(get_json(f"http://127.0.0.1:{p}/sim/state")["generation_tokens_total"] for p in ports)
            - generated_before
        )
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{kvgate_port}/metrics", timeout=10).read().decode()
        )
    completed = Counter[str]()
    shed = Counter[str]()
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "kvgate_shed_total":
                shed[sample.labels["code"]] += int(sample.value)
            elif sample.name == "kvgate_requests_total" and sample.labels["outcome"] == "completed":
                completed[sample.labels["backend"]] += int(sample.value)
    balanced = all(
        b["ledger"]["entries"] == 0
        and b["ledger"]["reserved_blocks"] == 0
        and sum(b["queue"]["depth"].values()) == 0
        for b in state["backends"]
    )
    shares = {name: completed[name] / max(1, tally.ok) for name in (f"sim{i}" for i in range(args.backends))}
    even = all(abs(share * args.backends - 1) <= EVEN_SHARE for share in shares.values())
    result = {
        "backends": args.backends,
        "concurrency": args.concurrency,
        "requests": tally.sent,
        "ok": tally.ok,
        "failures": dict(tally.failures),
        "shed_codes": {code: count for code, count in sorted(shed.items()) if count},
        "tokens_counted": tally.tokens,
        "tokens_generated": generated,
        "ledger_balanced": balanced,
        "share": {name: round(share, 3) for name, share in shares.items()},
        "even_shares": even,
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(tally.sent / elapsed, 1),
        "kvgate_cpu_us_per_token": round(cpu / max(1, tally.tokens) * 1e6, 1),
        "passed": tally.ok == tally.sent == args.requests and tally.tokens == generated and balanced and even,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the emulators' step time")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
