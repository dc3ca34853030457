"""Benchmark: what the tokenizer copies and the template render workers cost (not a test).

    .venv/bin/python tests/benchmarks/template_bounds.py [MODEL_DIR] [--repeat N]

Reports, with the testbed's tokenizer by default: the time and resident memory of one
per-thread tokenizer copy; a render worker's start-up time and resident memory; the round trip
of a small trusted template through the pool against rendering it in process; and how each
template bomb ended (its code and the time it took).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path
from typing import Any

from estimator.tokens import ChatTemplateError, Route, TokenCounter
from gateway.render_pool import RenderPool

DEFAULT_MODEL = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate")) / "tiny-llama"
HELLO = [{"role": "user", "content": "hello"}]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
BOMBS = {
    "1/0": "{{ 1/0 }}",
    "'a' * 10**10": "{{ 'a' * 10**10 }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "center(10**9)": "{{ 'x' | center(10**9) }}",
}


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def median_s(fn: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()

    counter = TokenCounter.from_pretrained(args.model, request_templates="render")
    prototype = counter._tokenizer
    before, copies, times = rss_bytes(), [], []
    for _ in range(4):
        start = time.perf_counter()
        copies.append(copy.deepcopy(prototype))
        times.append(time.perf_counter() - start)
    per_copy = (rss_bytes() - before) / len(copies)
    print(
        f"tokenizer copy: median {statistics.median(times) * 1000:.0f} ms, {per_copy / 2**20:.1f} MiB resident each"
    )

    body = {"messages": HELLO, "chat_template": TEMPLATE}
    in_process = median_s(lambda: counter.count(Route.CHAT, body), args.repeat)
    pool = RenderPool(args.model, max_model_len=None, max_prompt_chars=16 * 2**20, workers=1)
    try:
        start = time.perf_counter()
        pool.render_chat(body)
        startup = time.perf_counter() - start
        (pid,) = pool.worker_pids()
        print(
            f"render worker: first render (start-up) {startup:.1f} s, {rss_bytes(pid) / 2**20:.0f} MiB resident"
        )
        through = median_s(lambda: pool.render_chat(body), args.repeat)
        print(
            f"small template: in process {in_process * 1000:.2f} ms, through the pool {through * 1000:.2f} ms"
        )
        for name, template in BOMBS.items():
            pool.render_chat(body)  # a loaded worker, so that the time is the bomb's own
            start = time.perf_counter()
            try:
                pool.render_chat({"messages": HELLO, "chat_template": template})
                outcome = "rendered?!"
            except ChatTemplateError as exc:
                outcome = f"{exc.code}: {exc.message[:70]}"
            print(f"bomb {name:15s} {time.perf_counter() - start:6.2f} s  {outcome}")
        print(f"workers started in all: {pool.started}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
