"""One workload spread over several targets that serve the same thing, round-robin.

A client in front of several replicas of one service (several kvgate processes in front of
one engine, each on its own port) sends request i to replica i mod n. `deal` makes that split
of a plan (pure); `run_spread` replays it: one `bench.runner.run_target` per replica, each
with its share, all on the same schedule, so that every request leaves at the very moment
it would have left in a run against one target, and the records merge into one `RunResult`
that `bench.report.summarize` judges like any other run.

Why one schedule needs care: each `run_target` fixes its run's start when it begins, and
beginning costs it a while (it builds an HTTP client, some 0.1-0.5 s here, certificate
loading), so replicas started one after the other would each run that much later than the
one before. Every replica is therefore given a clock that stands still at a common start
instant until real time reaches it (`held_clock`): each fixes its start at that instant,
whenever it began, and from the instant on the clock is the monotonic clock itself. A share
that could not begin before the instant would run late; `run_spread` checks that none did
(run_target fixes its start in its first step, before it first waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx

from bench.payload import PlannedRequest
from bench.records import RunResult
from bench.runner import (
    DISPATCH_SWITCH_INTERVAL_S,
    SCHEDULE_LEAD_S,
    Clock,
    RunOptions,
    Sampler,
    metrics_url,
    run_target,
    wait_idle,
)

# How far ahead of now the common start is put: room for every share to begin.
START_MARGIN_PER_TARGET_S = 1.0
METRICS_TIMEOUT_S = 2.0


def deal(plan: Sequence[PlannedRequest], ways: int) -> tuple[tuple[PlannedRequest, ...], ...]:
    """Request i of `plan` (in its order, by arrival) goes to share i mod `ways`."""
    if ways < 1:
        raise ValueError(f"cannot deal a plan {ways} ways")
    return tuple(tuple(plan[i::ways]) for i in range(ways))


def held_clock(start_at: float, clock: Clock = time.monotonic) -> Clock:
    """`clock`, except that it reads `start_at` while `clock` is still before it."""

    def read() -> float:
        return max(clock(), start_at)

    return read


@dataclass(frozen=True, slots=True)
class SpreadResult:
    """The merged run (records of every share, by request index), which target served each
    request, the run's start on the caller's clock (the instant of arrival 0) and the least
    time any share had to spare before it."""

    result: RunResult
    target_of: dict[int, str]
    started_at: float
    start_slack_s: float


@contextlib.contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    # Held around every share at once: each run_target sets and restores it for itself, and
    # the first to end would otherwise restore Python's default while others still run.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


async def run_spread(
    targets: Sequence[str],
    plan: Sequence[PlannedRequest],
    *,
    deadline_s: float | None,
    metrics_urls: Sequence[str] = (),
    sample_period_s: float = 0.5,
    idle_timeout_s: float = 120.0,
    request_timeout_s: float = 600.0,
    label: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SpreadResult:
    """Replay `plan` over `targets` round-robin (see the module docstring).

    `metrics_urls` (the backends', the targets') are scraped once idle before the run, every
    `sample_period_s` during it, and once idle after it, for the merged result's baseline,
    samples and final readings. RuntimeError when a share could not begin before the common
    start (it would have run late)."""
    if not targets:
        raise ValueError("no target to spread over")
    shares = deal(plan, len(targets))
    urls = list(dict.fromkeys(metrics_url(u) for u in metrics_urls))
    options = RunOptions(
        deadline_s=deadline_s,
        # The shares scrape nothing: the spread scrapes once for all of them.
        metrics_urls=(),
        idle_timeout_s=idle_timeout_s,
        request_timeout_s=request_timeout_s,
    )
    async with httpx.AsyncClient(timeout=METRICS_TIMEOUT_S) as metrics_http:
        baseline = await wait_idle(metrics_http, urls, timeout_s=idle_timeout_s, clock=clock)
        vllm_sources = tuple(url for url, r in baseline.items() if r.is_vllm)
        start_at = clock() + START_MARGIN_PER_TARGET_S * len(targets)
        shared_clock = held_clock(start_at, clock)
        run_start = start_at + SCHEDULE_LEAD_S
        sampler = Sampler(metrics_http, urls, sample_period_s, run_start, shared_clock)
        sampler_task: asyncio.Task[None] | None = None
        tasks: list[asyncio.Task[RunResult]] = []
        slack_s = float("inf")
        try:
            with _switch_interval(DISPATCH_SWITCH_INTERVAL_S):
                for target, share in zip(targets, shares, strict=True):
                    tasks.append(
                        asyncio.create_task(
                            run_target(target, share, options, clock=shared_clock, label=target)
                        )
                    )
                    # Let the share take its first step: run_target fixes its start before it
                    # first waits. Still before the common start, it keeps the schedule.
                    await asyncio.sleep(0)
                    slack_s = min(slack_s, start_at - clock())
                if slack_s <= 0:
                    raise RuntimeError(
                        f"a share began {-slack_s:.3f} s after the common start: "
                        "raise START_MARGIN_PER_TARGET_S"
                    )
                if urls:
                    sampler_task = asyncio.create_task(sampler.run())
                results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if sampler_task is not None:
                sampler_task.cancel()
                await asyncio.gather(sampler_task, return_exceptions=True)
        duration_s = clock() - run_start
        final = await wait_idle(metrics_http, urls, timeout_s=idle_timeout_s, clock=clock)
    target_of = {
        record.index: target
        for target, result in zip(targets, results, strict=True)
        for record in result.records
    }
    merged = RunResult(
        target=label or " + ".join(targets),
        records=tuple(sorted((r for result in results for r in result.records), key=lambda r: r.index)),
        samples=tuple(sampler.points),
        baseline=baseline,
        final=final,
        vllm_sources=vllm_sources,
        duration_s=duration_s,
        # Each share's most at once, summed: an upper bound of the client's most at once.
        max_in_flight=sum(result.max_in_flight for result in results),
    )
    return SpreadResult(merged, target_of, run_start, slack_s)
