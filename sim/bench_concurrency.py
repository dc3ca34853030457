"""How many concurrent streams the emulator serves on this machine, and how well.

    python -m sim.bench_concurrency [-n 1000] [--tokens 50] [--sim-cpu 0] [--client-cpu 1]

Starts an emulator in a child process with a pool big enough that nothing queues or is
preempted (the point is the server, not the model), opens N streaming completions at once,
and reports: time until every stream had its first token, total time, tokens delivered per
second, the client-side gap between tokens (p50, p99), errors, and whether the emulator's
loop kept its model timeline (max lag, overruns: see `GET /sim/state`).

The default client speaks just enough HTTP/1.1 over asyncio streams (one request per
connection, `Connection: close`, counting `data: {` frames) to cost a few microseconds per
token; httpx (`--client httpx`) costs about 150 us per token and, on this 2-core machine,
would measure itself rather than the emulator.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import running_sim_process


@dataclass(frozen=True, slots=True)
class BenchResult:
    streams: int
    ok: int
    errors: int
    tokens: int
    all_first_token_s: float
    total_s: float
    gap_p50_ms: float
    gap_p99_ms: float
    sim_state: dict[str, object]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def bench_config(streams: int, prompt_tokens: int, output_tokens: int, step_ms: float) -> SimConfig:
    block_size = 32
    blocks_per_stream = -(-(prompt_tokens + output_tokens) // block_size)
    return SimConfig(
        engine=EngineConfig(
            num_blocks=streams * blocks_per_stream + 64,
            block_size=block_size,
            max_num_seqs=streams,
            max_num_batched_tokens=max(2048, streams * prompt_tokens),
            step_cost=StepCost(base_s=step_ms / 1e3, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
        )
    )


class _Tally:
    def __init__(self) -> None:
        self.first_token: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0
        self.errors = 0

    def result(self, streams: int, total: float, state: dict[str, object]) -> BenchResult:
        gaps = sorted(self.gaps)
        return BenchResult(
            streams=streams,
            ok=streams - self.errors,
            errors=self.errors,
            tokens=self.tokens,
            all_first_token_s=max(self.first_token) if self.first_token else float("nan"),
            total_s=total,
            gap_p50_ms=statistics.median(gaps) * 1e3 if gaps else float("nan"),
            gap_p99_ms=gaps[int(0.99 * (len(gaps) - 1))] * 1e3 if gaps else float("nan"),
            sim_state=state,
        )


def _body(index: int, prompt_tokens: int, output_tokens: int) -> bytes:
    prompt = ",".join([str(1000 + index % 20000)] * prompt_tokens)
    return (f'{{"prompt":[{prompt}],"max_tokens":{output_tokens},"ignore_eos":true,"stream":true}}').encode()


async def run_streams_raw(url: str, streams: int, prompt_tokens: int, output_tokens: int) -> BenchResult:
    host, port = url.removeprefix("http://").split(":")
    tally = _Tally()
    start = time.perf_counter()

    async def one(index: int) -> None:
        body = _body(index, prompt_tokens, output_tokens)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        last: float | None = None
        seen = 0
        done = False
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + body)
            while data := await reader.read(65536):
                now = time.perf_counter()
                done = done or b"data: [DONE]" in data
                count = data.count(b'data: {"')
                if not count:
                    continue
                if last is None:
                    tally.first_token.append(now - start)
                else:
                    tally.gaps.append(now - last)
                last = now
                seen += count
            writer.close()
        except OSError:
            done = False
        if not done:
            tally.errors += 1
            return
        tally.tokens += seen

    await asyncio.gather(*(one(i) for i in range(streams)))
    total = time.perf_counter() - start
    async with httpx.AsyncClient(base_url=url) as client:
        state = (await client.get("/sim/state")).json()
    return tally.result(streams, total, state)


async def run_streams(url: str, streams: int, prompt_tokens: int, output_tokens: int) -> BenchResult:
    """The same load through httpx, as the bench and the gateway would send it."""
    limits = httpx.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    tally = _Tally()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        start = time.perf_counter()

        async def one(index: int) -> None:
            last: float | None = None
            seen = 0
            body = _body(index, prompt_tokens, output_tokens)
            headers = {"content-type": "application/json"}
            try:
                async with client.stream(
                    "POST", "/v1/completions", content=body, headers=headers
                ) as response:
                    async for data in response.aiter_bytes():
                        now = time.perf_counter()
                        count = data.count(b'data: {"')
                        if not count:
                            continue
                        if last is None:
                            tally.first_token.append(now - start)
                        else:
                            tally.gaps.append(now - last)
                        last = now
                        seen += count
            except httpx.HTTPError:
                tally.errors += 1
                return
            tally.tokens += seen

        await asyncio.gather(*(one(i) for i in range(streams)))
        total = time.perf_counter() - start
        state = (await client.get("/sim/state")).json()
    return tally.result(streams, total, state)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.bench_concurrency", description=__doc__)
    parser.add_argument("-n", "--streams", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=50, help="output tokens per stream")
    parser.add_argument("--step-ms", type=float, default=20.0, help="emulated step time")
    parser.add_argument("--sim-cpu", type=int, default=None)
    parser.add_argument("--client-cpu", type=int, default=None)
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw")
    args = parser.parse_args(argv)
    if args.client_cpu is not None:
        os.sched_setaffinity(0, {args.client_cpu})
    config = bench_config(args.streams, args.prompt_tokens, args.tokens, args.step_ms)
    with running_sim_process(config, cpu=args.sim_cpu) as url:
        run = run_streams_raw if args.client == "raw" else run_streams
        result = asyncio.run(run(url, args.streams, args.prompt_tokens, args.tokens))
    expected = args.streams * args.tokens
    loop = result.sim_state.get("loop")
    print(f"streams            {result.streams} ({result.ok} ok, {result.errors} errors)")
    print(f"tokens delivered   {result.tokens} of {expected}")
    print(f"all first tokens   {result.all_first_token_s:.2f} s after the start")
    print(f"total              {result.total_s:.2f} s ({args.tokens} steps of {args.step_ms:g} ms "
          f"= {args.tokens * args.step_ms / 1e3:.2f} s modelled)")  # fmt: skip
    print(f"throughput         {result.tokens_per_s:.0f} tokens/s to the client")
    print(f"client token gap   p50 {result.gap_p50_ms:.1f} ms, p99 {result.gap_p99_ms:.1f} ms")
    print(f"emulator loop      {loop}")
    return 0 if result.errors == 0 and result.tokens == expected else 1


if __name__ == "__main__":
    sys.exit(main())
