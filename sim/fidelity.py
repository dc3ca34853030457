"""Calibrate the emulator's step cost on a real vLLM, and compare the two on a trace slice.

    python -m sim.fidelity calibrate --url http://127.0.0.1:8011
    python -m sim.fidelity compare --real http://127.0.0.1:8011 [--base-ms A --token-ms B --seq-ms C]

`calibrate` times decode steps at several batch sizes (gaps between streamed tokens) and
prefills of several lengths (one-token requests), fits
`step = base + per_token * tokens + per_seq * seqs + per_request * new requests` and prints
the `kvgate sim` flags. Decode gaps give `base` (intercept) and `per_token + per_seq`
(slope); prefill times give `per_token` (slope); bursts of K one-token requests sent at once
give, per request, its prefill, its sequence and the frontend's work for it (slope), which
on the testbed shares the engine's core. Each probe keeps the median of a few repeats.

`compare` replays the same slice of the Azure LLM inference trace (code) at three loads
against the real server and against a freshly started emulator with the given step cost,
and prints throughput, preemptions and KV usage side by side. The trace is scaled to the
testbed (max_model_len 1024, 2,048 KV tokens): context lengths are divided by 8 (Azure's
p50 1,469 becomes 184, p99 7,436 becomes 930), output lengths are kept (p50 13, p99 251)
but capped at 256, and a context is cut so that context + output stays under
max_model_len. Arrival times keep the trace's pattern, rescaled to each load's mean rate.

Requests carry random token ids (so no two prompts share a prefix-cache block) and
`ignore_eos` with `max_tokens` equal to the trace's output length, so both servers generate
exactly the same tokens. Keep runs small: the real testbed is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import functools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import running_sim_process

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"
CTX_SCALE = 1 / 8
MAX_OUTPUT_TOKENS = 256
# Token ids drawn for prompts: clear of the special tokens at the bottom of a 32k vocabulary.
TOKEN_ID_RANGE = (1000, 31000)
SAMPLE_INTERVAL_S = 0.1
IDLE_TIMEOUT_S = 300.0
# Fidelity targets (issue 3).
THROUGHPUT_TOLERANCE = 0.25
PREEMPTION_FACTOR = 2.0


# -- trace ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def load_trace_slice(path: Path, *, offset: int, count: int, max_model_len: int = 1024) -> list[TraceRequest]:
    """`count` rows from `offset`, scaled to the testbed; arrivals relative to the first."""
    rows: list[tuple[datetime, int, int]] = []
    with path.open(newline="") as handle:
        for index, row in enumerate(csv.DictReader(handle)):
            if index < offset:
                continue
            if len(rows) == count:
                break
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"no rows in {path} from offset {offset}")
    start = rows[0][0]
    requests = []
    for stamp, context, generated in rows:
        output = max(1, min(generated, MAX_OUTPUT_TOKENS))
        prompt = max(1, min(round(context * CTX_SCALE), max_model_len - output - 1))
        requests.append(TraceRequest((stamp - start).total_seconds(), prompt, output))
    return requests


def at_rate(requests: Sequence[TraceRequest], rate_per_s: float) -> list[TraceRequest]:
    """Rescale arrival times so that the slice's mean arrival rate is `rate_per_s`."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    target = (len(requests) - 1) / rate_per_s
    factor = target / span if span > 0 else 0.0
    return [replace(r, arrival_s=r.arrival_s * factor) for r in requests]


# -- metrics -------------------------------------------------------------------------------


def scrape_values(text: str) -> dict[str, float]:
    """Unlabelled-sum values of the vllm: samples we compare (summed over engines)."""
    wanted = {
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    }
    values: dict[str, float] = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] += sample.value
    return values


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    response = await client.get(f"{url}/metrics", timeout=10)
    response.raise_for_status()
    return scrape_values(response.text)


async def wait_idle(client: httpx.AsyncClient, url: str) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        values = await scrape(client, url)
        if values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not go idle")
        await asyncio.sleep(0.5)


async def model_name(client: httpx.AsyncClient, url: str) -> str:
    models = (await client.get(f"{url}/v1/models", timeout=10)).json()
    name: str = models["data"][0]["id"]
    return name


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randint(*TOKEN_ID_RANGE) for _ in range(tokens)]


@dataclass(slots=True)
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    token_times: list[float] = field(default_factory=list)


async def _sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    # Split on "\n" only: generated text may hold characters (U+2028, \x1c, ...) that
    # str.splitlines, and so httpx's aiter_lines, would treat as line breaks inside the JSON.
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    started = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return result
            async for line in _sse_lines(response):
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    result.token_times.append(time.perf_counter() - started)
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError:
        return result
    result.ok = True
    result.e2e_s = time.perf_counter() - started
    if result.token_times:
        result.ttft_s = result.token_times[0]
    return result


# -- calibration ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Calibration:
    decode_gap_ms: dict[int, float]
    prefill_ms: dict[int, float]
    burst_ms: dict[int, float]
    cost: StepCost


BURST_PROMPT_TOKENS = 64


def _linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mean_x = statistics.fmean(xs)
    mean_y = statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - slope * mean_x, slope


async def _typical_ms(repeats: int, probe: Callable[[], Awaitable[float]]) -> float:
    # The median of the repeats, not the fastest: the testbed's speed drifts by a fifth or more
    # from run to run even on a quiet machine, and an emulator tuned to its best runs is faster
    # than most real ones.
    return statistics.median([await probe() for _ in range(repeats)]) * 1e3


async def calibrate(
    url: str,
    *,
    batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
    prefills: Sequence[int] = (16, 128, 256, 512, 768, 1000),
    bursts: Sequence[int] = (4, 8, 16, 32),
    decode_tokens: int = 64,
    repeats: int = 5,
    seed: int = 0,
) -> Calibration:
    """Time the three probes on `url` and fit the step cost (see the module docstring)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        model = await model_name(client, url)
        await wait_idle(client, url)

        async def decode_gap(batch: int) -> float:
            results = await asyncio.gather(
                *(
                    stream_completion(client, url, model, random_prompt(rng, 16), decode_tokens)
                    for _ in range(batch)
                )
            )
            # Steady-state decode: skip the prefill and the last tokens.
            return statistics.median(
                later - earlier
                for r in results
                for earlier, later in zip(r.token_times[4:-4], r.token_times[5:-4], strict=False)
            )

        async def prefill_time(tokens: int) -> float:
            return (await stream_completion(client, url, model, random_prompt(rng, tokens), 1)).ttft_s

        async def burst_time(count: int) -> float:
            results = await asyncio.gather(
                *(
                    stream_completion(client, url, model, random_prompt(rng, BURST_PROMPT_TOKENS), 1)
                    for _ in range(count)
                )
            )
            return max(r.e2e_s for r in results)

        decode = {b: await _typical_ms(repeats, functools.partial(decode_gap, b)) for b in batches}
        prefill = {p: await _typical_ms(repeats + 2, functools.partial(prefill_time, p)) for p in prefills}
        burst = {k: await _typical_ms(repeats, functools.partial(burst_time, k)) for k in bursts}
    # Decode: gap(B) = base + (per_token + per_seq) * B.
    base_ms, per_decode_seq_ms = _linear_fit(list(decode.items()))
    # Prefill of one request: ttft(P) = constant + per_token * P.
    _, per_token_ms = _linear_fit(list(prefill.items()))
    per_seq_ms = max(per_decode_seq_ms - per_token_ms, 0.0)
    # K one-token requests at once: each adds its prefill, its sequence and its frontend work.
    _, per_burst_request_ms = _linear_fit(list(burst.items()))
    per_request_ms = per_burst_request_ms - per_token_ms * BURST_PROMPT_TOKENS - per_seq_ms
    cost = StepCost(
        base_s=max(base_ms, 0.0) / 1e3,
        per_token_s=max(per_token_ms, 0.0) / 1e3,
        per_seq_s=per_seq_ms / 1e3,
        per_request_s=max(per_request_ms, 0.0) / 1e3,
    )
    return Calibration(decode, prefill, burst, cost)


# -- comparison ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSummary:
    requests: int
    completed: int
    duration_s: float
    output_tokens: int
    tokens_per_s: float
    requests_per_s: float
    preemptions: float
    backend_generation_tokens: float
    kv_usage_mean: float
    kv_usage_max: float
    running_mean: float
    waiting_max: float
    ttft_p50_s: float
    e2e_p50_s: float
    # Cores used by unrelated work on this machine during the run (real runs only).
    other_load_cores: float = 0.0


async def replay(url: str, requests: Sequence[TraceRequest], *, seed: int) -> RunSummary:
    """Send `requests` open-loop at their arrival times; sample /metrics while they run."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, r.prompt_tokens) for r in requests]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        model = await model_name(client, url)
        await wait_idle(client, url)
        before = await scrape(client, url)
        samples: list[dict[str, float]] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                samples.append(await scrape(client, url))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)

        async def send(index: int, start: float) -> RequestResult:
            delay = start + requests[index].arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await stream_completion(client, url, model, prompts[index], requests[index].output_tokens)

        sampling = asyncio.create_task(sampler())
        start = time.perf_counter()
        results = await asyncio.gather(*(send(i, start) for i in range(len(requests))))
        duration = time.perf_counter() - start
        stop.set()
        await sampling
        after = await scrape(client, url)
    completed = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in completed)
    kv = [s["vllm:kv_cache_usage_perc"] for s in samples] or [0.0]
    running = [s["vllm:num_requests_running"] for s in samples] or [0.0]
    waiting = [s["vllm:num_requests_waiting"] for s in samples] or [0.0]
    return RunSummary(
        requests=len(requests),
        completed=len(completed),
        duration_s=duration,
        output_tokens=tokens,
        tokens_per_s=tokens / duration,
        requests_per_s=len(completed) / duration,
        preemptions=after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"],
        backend_generation_tokens=after["vllm:generation_tokens_total"]
        - before["vllm:generation_tokens_total"],
        kv_usage_mean=statistics.fmean(kv),
        kv_usage_max=max(kv),
        running_mean=statistics.fmean(running),
        waiting_max=max(waiting),
        ttft_p50_s=statistics.median(r.ttft_s for r in completed) if completed else math.nan,
        e2e_p50_s=statistics.median(r.e2e_s for r in completed) if completed else math.nan,
    )


def within_targets(real: RunSummary, sim: RunSummary) -> tuple[bool, bool]:
    """(throughput within 25%, preemptions both zero or within a factor of 2)."""
    throughput_ok = abs(sim.tokens_per_s - real.tokens_per_s) <= THROUGHPUT_TOLERANCE * real.tokens_per_s
    if real.preemptions == 0 and sim.preemptions == 0:
        preemptions_ok = True
    elif real.preemptions == 0 or sim.preemptions == 0:
        preemptions_ok = False
    else:
        ratio = sim.preemptions / real.preemptions
        preemptions_ok = 1 / PREEMPTION_FACTOR <= ratio <= PREEMPTION_FACTOR
    return throughput_ok, preemptions_ok


def sim_config_for_testbed(cost: StepCost, *, seed: int = 0) -> SimConfig:
    """The testbed's engine shape (64 blocks of 32, max_model_len 1024) with `cost`."""
    return SimConfig(engine=EngineConfig(step_cost=cost), seed=seed)


def format_table(rows: Sequence[tuple[str, RunSummary, RunSummary]]) -> str:
    lines = [
        f"{'load':>10} {'':>5} {'tok/s':>8} {'req/s':>7} {'preempt':>8} {'kv mean':>8} "
        f"{'kv max':>7} {'run avg':>8} {'wait max':>8} {'ttft p50':>9} {'e2e p50':>8} {'done':>7} {'other':>5}"
    ]
    for label, real, sim in rows:
        for name, run in (("real", real), ("sim", sim)):
            lines.append(
                f"{label:>10} {name:>5} {run.tokens_per_s:8.1f} {run.requests_per_s:7.2f} "
                f"{run.preemptions:8.0f} {run.kv_usage_mean:8.2f} {run.kv_usage_max:7.2f} "
                f"{run.running_mean:8.1f} {run.waiting_max:8.0f} {run.ttft_p50_s:9.3f} "
                f"{run.e2e_p50_s:8.3f} {run.completed:>3}/{run.requests:<3} {run.other_load_cores:5.2f}"
            )
        throughput_ok, preemptions_ok = within_targets(real, sim)
        ratio = sim.tokens_per_s / real.tokens_per_s if real.tokens_per_s else math.nan
        lines.append(
            f"{label:>10} {'':>5} throughput sim/real {ratio:.2f} "
            f"({'ok' if throughput_ok else 'OUT'}), preemptions "
            f"{'ok' if preemptions_ok else 'OUT'}"
        )
    return "\n".join(lines)


async def compare(
    real_url: str,
    cost: StepCost,
    *,
    trace: Path,
    offset: int,
    count: int,
    rates: Sequence[float],
    seed: int,
    sim_cpu: int | None,
) -> list[tuple[str, RunSummary, RunSummary]]:
    base = load_trace_slice(trace, offset=offset, count=count)
    rows = []
    with running_sim_process(sim_config_for_testbed(cost, seed=seed), cpu=sim_cpu) as sim_url:
        for rate in rates:
            requests = at_rate(base, rate)
            real = await replay_alone(real_url, requests, seed=seed)
            sim = await replay_alone(sim_url, requests, seed=seed)
            rows.append((f"{rate:g}/s", real, sim))
    return rows


def shared_with_others(run: RunSummary) -> bool:
    """The backend generated clearly more than we asked for: someone else used it meanwhile."""
    return run.backend_generation_tokens > 1.02 * run.output_tokens + 16


# Other work on the machine above this (in cores, averaged over a run) disturbs a testbed
# that has one core to itself on a two-core machine.
OTHER_LOAD_LIMIT_CORES = 0.3


class OtherLoad:
    """CPU used during a run by processes other than vLLM's, the emulator's and this one
    (Linux /proc only)."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as handle:
                fields = [float(v) for v in handle.readline().split()[1:]]
            ticks = os.sysconf("SC_CLK_TCK")
            busy = (sum(fields) - fields[3] - fields[4]) / ticks
            excluded = 0.0
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as handle:
                        cmdline = handle.read().lower()
                    ours = int(entry) == os.getpid() or b"sim.cli" in cmdline
                    if not ours and b"vllm" not in cmdline:
                        continue
                    with open(f"/proc/{entry}/stat") as handle:
                        stat = handle.read().rsplit(")", 1)[1].split()
                    excluded += (float(stat[11]) + float(stat[12])) / ticks
                except OSError:
                    continue
            return time.monotonic(), busy, excluded
        except OSError:
            return None

    def cores(self) -> float:
        """Average cores used by other work since construction (0 when unknown)."""
        end = self._sample()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return 0.0
        other = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(other, 0.0) / (end[0] - self._start[0])


async def replay_alone(
    url: str, requests: Sequence[TraceRequest], *, seed: int, attempts: int = 3
) -> RunSummary:
    """`replay`, repeated (up to `attempts`) while other clients' traffic shows in the backend's
    counters or other work loads this machine."""
    for attempt in range(attempts):
        load = OtherLoad()
        run = await replay(url, requests, seed=seed)
        other_cores = load.cores()
        disturbed = shared_with_others(run) or other_cores > OTHER_LOAD_LIMIT_CORES
        if not disturbed or attempt == attempts - 1:
            return replace(run, other_load_cores=other_cores)
        print(
            f"{url}: other work during the run ({other_cores:.2f} cores, backend generated "
            f"{run.backend_generation_tokens:.0f} for our {run.output_tokens}); repeating",
            file=sys.stderr,
        )
    raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim.fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="fit the step cost against a real vLLM")
    cal.add_argument("--url", required=True)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--repeats", type=int, default=5, help="runs of each probe; the median counts")
    cmp = sub.add_parser("compare", help="same trace slice on the real vLLM and the emulator")
    cmp.add_argument("--real", required=True)
    cmp.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    cmp.add_argument("--offset", type=int, default=0)
    cmp.add_argument("-n", "--count", type=int, default=120)
    cmp.add_argument("--rates", default="4,12,40", help="mean arrival rates (requests/s)")
    cmp.add_argument("--base-ms", type=float, default=StepCost().base_s * 1e3)
    cmp.add_argument("--token-ms", type=float, default=StepCost().per_token_s * 1e3)
    cmp.add_argument("--seq-ms", type=float, default=StepCost().per_seq_s * 1e3)
    cmp.add_argument("--request-ms", type=float, default=StepCost().per_request_s * 1e3)
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--sim-cpu", type=int, default=None, help="pin the emulator to this CPU")
    args = parser.parse_args(argv)

    if args.command == "calibrate":
        result = asyncio.run(calibrate(args.url, seed=args.seed, repeats=args.repeats))
        print("decode step (median gap between streamed tokens), by batch size:")
        for batch, gap in result.decode_gap_ms.items():
            print(f"  batch {batch:3d}: {gap:7.2f} ms")
        print("time to first token of a one-token request, by prompt tokens:")
        for tokens, ms in result.prefill_ms.items():
            print(f"  prompt {tokens:4d}: {ms:7.2f} ms")
        print(f"{BURST_PROMPT_TOKENS}-token one-token requests sent at once, time until all are done:")
        for count, ms in result.burst_ms.items():
            print(f"  {count:3d} requests: {ms:7.2f} ms")
        cost = result.cost
        print(
            f"fit: base {cost.base_s * 1e3:.3f} ms, per token {cost.per_token_s * 1e3:.4f} ms, "
            f"per sequence {cost.per_seq_s * 1e3:.3f} ms, "
            f"per new request {cost.per_request_s * 1e3:.3f} ms"
        )
        print(
            f"kvgate sim --step-base-ms {cost.base_s * 1e3:.3f} "
            f"--step-per-token-ms {cost.per_token_s * 1e3:.4f} "
            f"--step-per-seq-ms {cost.per_seq_s * 1e3:.3f} "
            f"--step-per-request-ms {cost.per_request_s * 1e3:.3f}"
        )
        return 0

    cost = StepCost(args.base_ms / 1e3, args.token_ms / 1e3, args.seq_ms / 1e3, args.request_ms / 1e3)
    rates = [float(r) for r in args.rates.split(",")]
    rows = asyncio.run(
        compare(
            args.real,
            cost,
            trace=args.trace,
            offset=args.offset,
            count=args.count,
            rates=rates,
            seed=args.seed,
            sim_cpu=args.sim_cpu,
        )
    )
    print(format_table(rows))
    return 0 if all(all(within_targets(real, sim)) for _, real, sim in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
