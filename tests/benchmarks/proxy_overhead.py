"""Benchmark: what kvgate adds to a request, against a backend that answers at once (not a test).

    .venv/bin/python tests/benchmarks/proxy_overhead.py [--rounds 2] [--duration-s 10]

Starts `instant_backend.py` pinned to one core and `kvgate serve` (one worker, the real
tokenizer of the testbed model, so every request is tokenized) pinned to the other, then runs
`wrk` with a short non-streaming chat completion at concurrency 1 and 16, straight at the
backend and through kvgate, alternating the two targets round after round (A B A B) so that
machine noise shows. Prints each run's median latency and requests/s, and per concurrency the
latency kvgate adds (its median minus the backend's, from the same round).

The targets (issue 4): added median latency <= 1 ms at concurrency 1, >= 1,500 requests/s
through kvgate at concurrency 16. wrk runs on the backend's core, so kvgate has a core of its
own as it would in front of a real engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_MODEL_DIR = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate")) / "tiny-llama"
CHAT_BODY = {
    "model": "instant",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ],
    "max_tokens": 16,
}
READY_TIMEOUT_S = 60.0
WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{body}]]
"""


@dataclass(frozen=True, slots=True)
class WrkRun:
    target: str
    connections: int
    median_ms: float
    p99_ms: float
    requests_per_s: float
    errors: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except OSError as exc:  # refused, reset, HTTPError (a subclass): not up yet
        return getattr(exc, "code", 0), b""


def wait_for(url: str, process: subprocess.Popen[bytes], what: str) -> bytes:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with {process.returncode}")
        status, body = http_get(url)
        if status == 200:
            return body
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not become ready at {url}")
        time.sleep(0.1)


@contextmanager
def started(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def pinned(cpu: int | None, argv: list[str]) -> list[str]:
    return argv if cpu is None else ["taskset", "-c", str(cpu), *argv]


_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _latency_ms(text: str, percentile: str) -> float:
    match = re.search(rf"^\s*{percentile}%\s+([\d.]+)(us|ms|s)\s*$", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"no {percentile}% latency in wrk's output:\n{text}")
    return float(match.group(1)) * _UNIT_MS[match.group(2)]


def parse_wrk(text: str, target: str, connections: int) -> WrkRun:
    rate = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.MULTILINE)
    if rate is None:
        raise ValueError(f"no Requests/sec in wrk's output:\n{text}")
    errors = 0
    for match in re.finditer(r"Non-2xx or 3xx responses:\s+(\d+)|Socket errors:.*", text):
        errors += int(match.group(1)) if match.group(1) else sum(map(int, re.findall(r"\d+", match.group(0))))
    return WrkRun(
        target, connections, _latency_ms(text, "50"), _latency_ms(text, "99"), float(rate.group(1)), errors
    )


def run_wrk(
    url: str, target: str, connections: int, duration_s: float, script: Path, cpu: int | None
) -> WrkRun:
    argv = pinned(
        cpu,
        ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--latency", "-s", str(script), url],
    )
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    run = parse_wrk(result.stdout, target, connections)
    print(
        f"  {target:7s} c={connections:<3d} median {run.median_ms:7.3f} ms   p99 {run.p99_ms:7.3f} ms   "
        f"{run.requests_per_s:9.1f} req/s" + (f"   {run.errors} errors" if run.errors else ""),
        flush=True,
    )
    return run


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds per concurrency (default 2)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="length of each wrk run")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="tokenizer kvgate loads")
    parser.add_argument("--kvgate-cpu", type=int, default=0)
    parser.add_argument("--backend-cpu", type=int, default=1)
    parser.add_argument("--wrk-cpu", type=int, default=1)
    parser.add_argument(
        "--kvgate-args",
        default="",
        help="more `kvgate serve` arguments, e.g. '--log-level warning' (default: its defaults, "
        "which log one line per request)",
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian package wrk; see tests/system_deps.sh)")
    if not (args.model_dir / "tokenizer.json").exists() and not (args.model_dir / "tokenizer.model").exists():
        raise SystemExit(f"no tokenizer in {args.model_dir}: install the testbed model first")

    workdir = Path(tempfile.mkdtemp(prefix="kvgate-overhead-"))
    script = workdir / "chat.lua"
    script.write_text(WRK_LUA.format(body=json.dumps(CHAT_BODY)))
    backend_port, kvgate_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    kvgate_url = f"http://127.0.0.1:{kvgate_port}"
    python = sys.executable
    kvgate = str(Path(python).with_name("kvgate"))
    backend_argv = pinned(
        args.backend_cpu,
        [
            python,
            str(HERE / "instant_backend.py"),
            "--port",
            str(backend_port),
            "--root",
            str(args.model_dir),
        ],
    )
    kvgate_argv = pinned(
        args.kvgate_cpu,
        [kvgate, "serve", "--backend", backend_url, "--port", str(kvgate_port), *args.kvgate_args.split()],
    )
    print(
        f"backend: {' '.join(backend_argv)}\nkvgate:  {' '.join(kvgate_argv)}\nlogs in {workdir}", flush=True
    )
    with (
        started(backend_argv, workdir / "backend.log") as backend,
        started(kvgate_argv, workdir / "kvgate.log") as gateway,
    ):
        wait_for(f"{backend_url}/v1/models", backend, "the instant backend")
        wait_for(f"{kvgate_url}/readyz", gateway, "kvgate")
        state = json.loads(http_get(f"{kvgate_url}/admin/state")[1])
        tokenizer = state["backends"][0]["tokenizer"]
        if tokenizer == "approximate":
            raise SystemExit("kvgate fell back on approximate counting: the benchmark needs a real tokenizer")
        print(f"kvgate tokenizes with {tokenizer}", flush=True)
        chat = "/v1/chat/completions"
        run_wrk(kvgate_url + chat, "warmup", 16, args.warmup_s, script, args.wrk_cpu)

        runs: list[tuple[WrkRun, WrkRun]] = []
        for round_no in range(1, args.rounds + 1):
            print(f"round {round_no}", flush=True)
            for connections in args.concurrency:
                direct = run_wrk(
                    backend_url + chat, "backend", connections, args.duration_s, script, args.wrk_cpu
                )
                relayed = run_wrk(
                    kvgate_url + chat, "kvgate", connections, args.duration_s, script, args.wrk_cpu
                )
                runs.append((direct, relayed))
        outcomes = json.loads(http_get(f"{kvgate_url}/admin/state")[1])["backends"][0]["queue"]["stats"]

    print("\nsummary (median over rounds)")
    print(
        f"{'c':>3}  {'backend ms':>10}  {'kvgate ms':>10}  {'added ms':>9}  {'backend req/s':>13}  {'kvgate req/s':>12}"
    )
    for connections in args.concurrency:
        pairs = [pair for pair in runs if pair[0].connections == connections]
        added = statistics.median(relayed.median_ms - direct.median_ms for direct, relayed in pairs)
        print(
            f"{connections:>3}  {statistics.median(d.median_ms for d, _ in pairs):>10.3f}  "
            f"{statistics.median(r.median_ms for _, r in pairs):>10.3f}  {added:>9.3f}  "
            f"{statistics.median(d.requests_per_s for d, _ in pairs):>13.1f}  "
            f"{statistics.median(r.requests_per_s for _, r in pairs):>12.1f}"
        )
    print(f"kvgate queue stats: {outcomes}")
    failed = sum(direct.errors + relayed.errors for direct, relayed in runs)
    if failed:
        print(f"{failed} requests failed (non-2xx or socket errors): the figures are not valid")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
