"""Benchmark: what reading one /metrics body costs on the event loop (not a test; prints figures).

    .venv/bin/python tests/benchmarks/metrics_parse.py [--url URL] [--repeat N]

Feeds bodies to `MetricsBody` in chunks of 64 KiB (what httpcore reads at a time) and reports,
per body: the slowest single `feed` (the longest the loop is held by the filter), the whole
filter, and the parse of the kept lines (on the loop up to INLINE_PARSE_BYTES, in a thread
above), in CPU time of this thread (`time.thread_time`: other processes on a shared machine
do not inflate it). Bodies: the real testbed's /metrics (or the recorded fixture), and hostile ones built
to be as costly as the bounds allow.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from gateway.budget import (
    INLINE_PARSE_BYTES,
    MAX_METRICS_BODY_BYTES,
    MAX_METRICS_KEPT_BYTES,
    MAX_METRICS_LINE_BYTES,
    MetricsBody,
)
from gateway.vllm_metrics import MetricsFormatError

CHUNK = 64 << 10
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics_0.32.0.txt"
CONFIG = (
    'vllm:cache_config_info{block_size="32",engine="0",kv_cache_size_tokens="2048",num_gpu_blocks="64"} 1.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
)


def run(body: bytes) -> tuple[float, float, float, str]:
    """(slowest feed, all feeds, parse) in seconds, and the outcome."""
    reader = MetricsBody()
    slowest = total = 0.0
    try:
        for offset in range(0, len(body), CHUNK):
            start = time.thread_time()
            reader.feed(body[offset : offset + CHUNK])
            spent = time.thread_time() - start
            slowest, total = max(slowest, spent), total + spent
        start = time.thread_time()
        try:
            reading = reader.reading()
            outcome = f"read: {reading.total_blocks} blocks"
        finally:
            parse = time.thread_time() - start
    except MetricsFormatError as exc:
        return slowest, total, 0.0, f"refused: {str(exc)[:70]}"
    return slowest, total, parse, outcome


def hostile_bodies() -> dict[str, Callable[[], bytes]]:
    big = MAX_METRICS_BODY_BYTES
    relevant_line = b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    kept_fill = relevant_line * ((MAX_METRICS_KEPT_BYTES - 400) // len(relevant_line))
    long_label = 'vllm:num_requests_waiting{engine="0",x="' + "a" * (MAX_METRICS_LINE_BYTES - 64) + '"} 1\n'
    return {
        "16 MiB of empty lines": lambda: b"\n" * big,
        "16 MiB of 'a' lines": lambda: b"a\n" * (big // 2),
        "16 MiB of '# TYPE vllm:' lines": lambda: b"# TYPE vllm:\n" * (big // 13),
        "16 MiB of one line": lambda: b"x" * big,
        "16 MiB of binary": lambda: bytes(range(256)) * (big // 256),
        "kept lines at the bound": lambda: CONFIG.encode() + kept_fill,
        "kept line at the length bound, x15": lambda: (CONFIG + long_label * 15).encode(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=None, help="a live /metrics (default: the recorded fixture)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    real = httpx.get(args.url, timeout=5).content if args.url else FIXTURE.read_bytes()
    bodies: dict[str, Callable[[], bytes]] = {
        f"real /metrics ({len(real)} bytes)": lambda: real,
        **hostile_bodies(),
    }
    print(f"inline parse up to {INLINE_PARSE_BYTES} kept bytes; best of {args.repeat} runs, CPU ms")
    print(f"{'body':40} {'slowest feed':>13} {'all feeds':>10} {'parse':>8}  outcome")
    for name, make in bodies.items():
        body = make()
        runs = [run(body) for _ in range(args.repeat)]
        slowest, total, parse = (min(r[i] for r in runs) * 1e3 for i in range(3))
        print(f"{name:40} {slowest:13.2f} {total:10.2f} {parse:8.2f}  {runs[0][3]}")


if __name__ == "__main__":
    main()
