"""Benchmark: how long exact prompt counting takes (not a test; prints figures).

    .venv/bin/python tests/benchmarks/token_count.py [MODEL_DIR] [--repeat N]

Reports the median and p99 time of `TokenCounter.count` for a short chat request and for a
completions prompt of about 4,000 tokens, with the testbed's tokenizer by default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from estimator.tokens import Route, TokenCounter

DEFAULT_MODEL = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate")) / "tiny-llama"


def measure(
    counter: TokenCounter, route: Route, body: dict[str, object], repeat: int
) -> tuple[float, float, int]:
    tokens = counter.count(route, body).tokens  # warm caches once
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        counter.count(route, body)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))], tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    parser.add_argument("--repeat", type=int, default=500)
    args = parser.parse_args()
    counter = TokenCounter.from_pretrained(args.model)

    short_chat = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."},
        ]
    }
    paragraph = (
        "The KV cache grows with every generated token and with every concurrent request; "
        "PagedAttention stores it in fixed-size blocks allocated on demand. "
    )
    long_text = paragraph * 1
    while counter.count(Route.COMPLETIONS, {"prompt": long_text}).tokens < 4000:
        long_text += paragraph
    cases = [
        ("short chat", Route.CHAT, short_chat),
        ("long completion", Route.COMPLETIONS, {"prompt": long_text}),
        ("long chat", Route.CHAT, {"messages": [{"role": "user", "content": long_text}]}),
    ]
    print(f"tokenizer: {args.model}, {args.repeat} runs each")
    for name, route, body in cases:
        p50, p99, tokens = measure(counter, route, body, args.repeat)
        print(f"{name:16} {tokens:6d} tokens  p50 {p50 * 1e3:7.3f} ms  p99 {p99 * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
