"""Is the bench fast enough not to be the bottleneck? `python -m bench.selfcheck`

Drives a fast server with Poisson arrivals at `--rate` requests/s for `--duration` seconds,
each response streaming for about `--stream-s` seconds, so that rate x stream time requests
are open at once (200/s x 2.5 s = 500 streams), and reports how late requests started against
their schedule (p50/p99/max) and the most streams open at once. It passes when the start-lag
p99 is under `--max-lag-ms` (10 ms), the concurrency target was reached and every request
finished.

The server is `bench.instant` in a child process (so it does not share the client's event
loop), or any OpenAI-compatible emulator given with `--against URL`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from bench.cli import run_on_fast_loop
from bench.payload import PayloadOptions, plan_requests
from bench.report import Outcome, classify, percentile
from bench.runner import RunOptions, quiet_gc, run_target
from bench.workload import LengthDist, SyntheticSpec, generate_synthetic, offered_seconds

PROMPT_WORDS = 16
# The emulator sized so that nothing waits for KV blocks or batch slots, and a step costs only
# its base time (--step-base-ms, set to the token interval).
SIM_FLAGS = (
    "--num-blocks",
    "200000",
    "--block-size",
    "16",
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    "4096",
    "--max-num-batched-tokens",
    "1000000",
    "--step-per-token-ms",
    "0",
    "--step-per-seq-ms",
    "0",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    tokens = max(1, round(args.stream_s * 1000 / args.token_interval_ms) + 1)
    n = round(args.rate * args.duration)
    spec = SyntheticSpec(
        n=n, rate=args.rate, prompt=LengthDist("const", PROMPT_WORDS), output=LengthDist("const", tokens)
    )
    work = generate_synthetic(spec, seed=0)
    prompt = " ".join(["word"] * PROMPT_WORDS)
    # The forced length (the private vllm_xargs field) is what the fake writes.
    options = PayloadOptions(model=args.model, max_tokens_cap=tokens + 1)
    plan = plan_requests(work.requests, [prompt] * len(work), options)
    run_options = RunOptions(metrics_urls=(f"{url}/metrics",), sample_period_s=0.5, idle_timeout_s=30.0)
    cpu_before = time.process_time()
    with quiet_gc():
        result = run_on_fast_loop(run_target(url, plan, run_options))
    # CPU the client spent, a figure that other load on the machine does not distort much
    cpu_s = time.process_time() - cpu_before
    lags_ms = [r.start_lag_s * 1000 for r in result.records]
    outcomes = [classify(r, None) for r in result.records]
    chunks = sum(r.streamed_tokens for r in result.records)
    return {
        "requests": len(result.records),
        "rate_per_s": args.rate,
        "offered_s": round(offered_seconds(work), 2),
        "run_s": round(result.duration_s, 2),
        "tokens_per_stream": tokens,
        "token_interval_ms": args.token_interval_ms,
        "chunks_per_s": round(chunks / result.duration_s) if result.duration_s else 0,
        "max_in_flight": result.max_in_flight,
        "client_cpu_s": round(cpu_s, 2),
        "client_cpu_share": round(cpu_s / result.duration_s, 3) if result.duration_s else 0.0,
        "ok": outcomes.count(Outcome.OK),
        "not_ok": len(outcomes) - outcomes.count(Outcome.OK),
        "start_lag_ms_p50": round(percentile(lags_ms, 50) or 0.0, 3),
        "start_lag_ms_p99": round(percentile(lags_ms, 99) or 0.0, 3),
        "start_lag_ms_max": round(max(lags_ms, default=0.0), 3),
        "ttft_ms_p50": round(
            1000 * (percentile([r.ttft_s for r in result.records if r.ttft_s is not None], 50) or 0.0), 3
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.selfcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--stream-s", type=float, default=2.5)
    parser.add_argument("--token-interval-ms", type=float, default=100.0)
    parser.add_argument("--min-streams", type=int, default=500)
    parser.add_argument("--max-lag-ms", type=float, default=10.0)
    parser.add_argument("--against", metavar="URL", help="use this server instead of a child")
    parser.add_argument(
        "--sim",
        action="store_true",
        help="use the vLLM emulator (`python -m sim.cli`) as the child, with "
        "a pool too large to preempt and one engine step per token "
        "interval: all streams then receive their tokens at once, in "
        "steps, as from a real engine",
    )
    parser.add_argument("--model", default="instant")
    parser.add_argument("--server-cpu", type=int, help="pin the child server to this CPU")
    parser.add_argument("--client-cpu", type=int, help="pin this process to this CPU")
    args = parser.parse_args(argv)

    from bench.instant import wait_until_up

    if args.client_cpu is not None:
        os.sched_setaffinity(0, {args.client_cpu})
    child: subprocess.Popen[bytes] | None = None
    url = args.against
    if url is None:
        port = _free_port()
        if args.sim:
            command = [
                sys.executable,
                "-m",
                "sim.cli",
                "--port",
                str(port),
                "--model-name",
                args.model,
                *SIM_FLAGS,
                "--step-base-ms",
                str(args.token_interval_ms),
            ]
        else:
            command = [
                sys.executable,
                "-m",
                "bench.instant",
                "--port",
                str(port),
                "--token-interval-ms",
                str(args.token_interval_ms),
            ]
        if args.server_cpu is not None:
            command = ["taskset", "-c", str(args.server_cpu), *command]
        child = subprocess.Popen(command)
        url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, alive=lambda: child is None or child.poll() is None)
        figures = measure(url.rstrip("/"), args)
    finally:
        if child is not None:
            child.terminate()
            child.wait(timeout=10)
    figures["server"] = args.against or (
        "sim.cli (child process)" if args.sim else "bench.instant (child process)"
    )
    passed = (
        figures["start_lag_ms_p99"] < args.max_lag_ms
        and figures["max_in_flight"] >= args.min_streams
        and figures["not_ok"] == 0
    )
    figures["passed"] = passed
    print(json.dumps(figures, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
