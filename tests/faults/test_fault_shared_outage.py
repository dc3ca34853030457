"""Redis goes away for a few seconds under load, and comes back; two kvgate processes share a
budget in it. Both ways of going away: SIGSTOP (the server hangs, connections stay open) and
SIGKILL then a new server on the same port (everything it held is lost). Both modes:

- fail_closed: once a process notices, it answers every new request 503 with Retry-After and
  its /readyz says not ready, naming Redis;
- fail_open: it keeps admitting, each process within its local share of the budget.

Either way nothing answers 500 and no process dies; the streams already admitted finish; and
after Redis is back, within a few seconds, each process is ready and Redis's total equals the
sum of what the processes hold in flight (the outage outlasts the lease TTL, so a lease booked
before it has expired, or was lost with the server, and must be booked again).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from faultkit import KvgateProcess, SimProcess, poll_until
from redis_server import RedisServer, fresh_redis
from sharedkit import (
    LEASE_TTL_S,
    LoadLoop,
    SharedKeys,
    Stream,
    admissible_blocks,
    consistent,
    entries,
    own_reserved_blocks,
    redis_idle,
    shared_settings,
    start_kvgates,
    statuses,
    stream_once,
    token_stream,
)

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost

__all__ = ["fresh_redis"]  # the fixture, used by name

PROCESSES = 2
# Longer than the lease TTL: whatever was booked before the outage is gone by its end.
OUTAGE_S = 2 * LEASE_TTL_S
# Liveness bounds, not targets: the benchmark measures how long these take.
NOTICE_S = 10.0
RECOVERY_S = 10.0
# 127 blocks of 32 tokens, 20 ms a step. A hog (901 tokens: 29 blocks) streams for about
# 18 s, through the outage and the recovery; a small one (201 tokens: 7 blocks) for about 4 s.
ENGINE = EngineConfig(
    num_blocks=128,
    step_cost=StepCost(base_s=0.020, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
)
HOG_BLOCKS = 29
SMALL_BLOCKS = 7
# Sent to each process in fail_open mode once it noticed the outage.
BURST = 6


def hog(i: int) -> dict[str, object]:
    # One prompt token and 900 generated.
    return token_stream(3000 + i, 900)


def brief(i: int) -> dict[str, object]:
    # The steady load: short streams (41 tokens: 2 blocks), so that many start in the outage.
    return token_stream(5000 + i, 40)


def small(i: int) -> dict[str, object]:
    return token_stream(4000 + i, 200)


@pytest.fixture
def deployment(
    request: pytest.FixtureRequest, fresh_redis: RedisServer, tmp_path: Path
) -> Iterator[list[KvgateProcess]]:
    sim = SimProcess(SimConfig(engine=ENGINE))
    sim.start()
    settings = shared_settings(fresh_redis.url, redis_unavailable=request.param)
    with ExitStack() as stack:
        stack.callback(sim.stop)
        yield start_kvgates(stack, sim.url, tmp_path, PROCESSES, settings)


def shared_ledger_up(kvgate: KvgateProcess) -> float | None:
    text = httpx.get(f"{kvgate.url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("kvgate_shared_ledger_up"):
            return float(line.rsplit(" ", 1)[1])
    return None


def readyz(kvgate: KvgateProcess) -> tuple[int, str]:
    response = httpx.get(f"{kvgate.url}/readyz", timeout=5)
    return response.status_code, response.text


def go_away(server: RedisServer, how: str) -> None:
    if how == "paused":
        server.pause()
    else:
        server.kill()


def come_back(server: RedisServer, how: str) -> None:
    if how == "paused":
        server.resume()
    else:
        server.start()  # the same port, an empty Redis


@pytest.mark.parametrize("how", ["paused", "restarted"])
@pytest.mark.parametrize("deployment", ["fail_closed", "fail_open"], indirect=True)
def test_redis_away_under_load_then_back(
    deployment: list[KvgateProcess], fresh_redis: RedisServer, how: str
) -> None:
    kvgates = deployment
    mode = str(kvgates[0].settings["redis_unavailable"])
    keys = SharedKeys()
    store = fresh_redis.client()
    share = admissible_blocks(kvgates[0]) // PROCESSES
    # More than the share holds beside the hog: some of the burst must wait for Redis.
    assert HOG_BLOCKS + BURST * SMALL_BLOCKS > share >= HOG_BLOCKS + 2 * SMALL_BLOCKS

    with ThreadPoolExecutor(2 + PROCESSES * BURST) as pool:
        hogs = [pool.submit(stream_once, k.url, hog(i)) for i, k in enumerate(kvgates)]
        poll_until(lambda: all(entries(k) == 1 for k in kvgates), what="a hog admitted on each")
        poll_until(lambda: consistent(store, keys, kvgates), what="the hogs booked in Redis")
        assert keys.requests_booked(store) == PROCESSES * HOG_BLOCKS
        loads = [LoadLoop(k.url, brief(i), threads=1).start() for i, k in enumerate(kvgates)]
        # Streams admitted before the outage, besides the hogs: they must finish through it.
        poll_until(lambda: all(entries(k) >= 2 for k in kvgates), what="the load under way")

        go_away(fresh_redis, how)
        away_at = time.monotonic()
        probes: list[Stream] = []
        burst: list[Future[Stream]] = []
        peak_reserved = [0] * PROCESSES
        try:
            poll_until(
                lambda: all(shared_ledger_up(k) == 0 for k in kvgates),
                timeout_s=NOTICE_S,
                what="every process to notice Redis is away",
            )
            if mode == "fail_open":
                burst = [
                    pool.submit(stream_once, k.url, small(100 * i + j))
                    for i, k in enumerate(kvgates)
                    for j in range(BURST)
                ]
            while time.monotonic() < away_at + OUTAGE_S:
                for i, kvgate in enumerate(kvgates):
                    if mode == "fail_closed":
                        probes.append(stream_once(kvgate.url, small(10 + i)))
                        status, text = readyz(kvgate)
                        assert status == 503, text
                        assert "redis" in text.lower(), text
                    else:
                        peak_reserved[i] = max(peak_reserved[i], own_reserved_blocks(kvgate))
                time.sleep(0.05)  # a probing pace through the outage, whose length is the point
            for load in loads:
                load.halt()
        finally:
            come_back(fresh_redis, how)
        back_at = time.monotonic()

        if mode == "fail_closed":
            assert probes
            for probe in probes:
                assert probe.status == 503, (probe.status, probe.body[-300:])
                assert probe.retry_after is not None
                assert int(probe.retry_after) >= 1
                assert "error" in httpx.Response(503, content=probe.body).json()
        else:
            # Each process admitted past its hog during the outage, and never past its share.
            assert all(HOG_BLOCKS + SMALL_BLOCKS <= peak <= share for peak in peak_reserved), (
                peak_reserved,
                share,
            )

        poll_until(
            lambda: all(k.ready() for k in kvgates) and consistent(store, keys, kvgates, views=True),
            timeout_s=RECOVERY_S,
            what="readiness back and Redis's total = the processes' reservations",
        )
        # The hogs were still streaming: the totals compared held them, on both sides.
        assert not any(h.done() for h in hogs), "the hogs outlived the recovery"
        assert keys.booked_total(store) >= PROCESSES * HOG_BLOCKS

        for done in [*hogs, *burst]:
            stream = done.result(timeout=120)
            assert stream.completed, (stream.status, stream.body[-300:])
        answered = [s for load in loads for s in load.stop()]

    allowed = {200, 503} if mode == "fail_closed" else {200}
    seen = statuses(answered)
    assert set(seen) <= allowed, seen
    assert seen[200] > 0, seen
    assert [s for s in answered if away_at < s.sent_at < back_at], "requests arrived during the outage"
    assert all(k.process.poll() is None for k in kvgates), [k.output()[-2000:] for k in kvgates]
    poll_until(lambda: redis_idle(store, keys) and all(entries(k) == 0 for k in kvgates), what="all released")
