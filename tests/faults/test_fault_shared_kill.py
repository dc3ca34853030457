"""Two kvgate processes share one budget in Redis; one of them is killed (SIGKILL) under load.

A dead process cannot release what it booked: its leases must expire on their own, within the
lease TTL (2 s here) and a margin, so that its blocks come back to the deployment. Meanwhile
the survivor keeps serving its own streams, none of which may fail, and afterwards Redis's
total is exactly what the survivor holds.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from pathlib import Path

import httpx
import pytest
from faultkit import SLOW_STEPS, KvgateProcess, SimProcess, poll_until
from redis_server import RedisServer, fresh_redis
from sharedkit import (
    LEASE_TTL_S,
    LoadLoop,
    SharedKeys,
    consistent,
    entries,
    redis_idle,
    shared_settings,
    start_kvgates,
    stream_once,
)

from sim.config import SimConfig

__all__ = ["fresh_redis"]  # the fixture, used by name

# Liveness bound on top of the TTL: expiry is swept by whoever touches the ledger next, and
# the machine is shared with other engines.
MARGIN_S = 5.0
# On the testbed-shaped pool (63 blocks of 32 tokens): the victim's two streams book 2 x 19
# blocks, the survivor's two at a time 2 x 7, and the survivor's big one 30, which fits only
# once the victim's blocks are back (30 + 14 + 38 > 63 >= 30 + 14).
VICTIM_STREAM = {"model": "tiny-llama", "prompt": "a", "max_tokens": 600, "ignore_eos": True, "stream": True}
SURVIVOR_STREAM = {
    "model": "tiny-llama",
    "prompt": "b",
    "max_tokens": 200,
    "ignore_eos": True,
    "stream": True,
}
BIG = {"model": "tiny-llama", "prompt": "c", "max_tokens": 950, "ignore_eos": True, "stream": True}


@pytest.fixture
def pair(fresh_redis: RedisServer, tmp_path: Path) -> Iterator[tuple[KvgateProcess, KvgateProcess]]:
    sim = SimProcess(SimConfig(engine=SLOW_STEPS))
    sim.start()
    with ExitStack() as stack:
        stack.callback(sim.stop)
        victim, survivor = start_kvgates(stack, sim.url, tmp_path, 2, shared_settings(fresh_redis.url))
        yield victim, survivor


def test_a_killed_process_leases_expire_and_the_survivor_serves_throughout(
    pair: tuple[KvgateProcess, KvgateProcess], fresh_redis: RedisServer
) -> None:
    victim, survivor = pair
    keys = SharedKeys()
    store = fresh_redis.client()

    with ThreadPoolExecutor(4) as pool:
        doomed = [pool.submit(stream_once, victim.url, VICTIM_STREAM) for _ in range(2)]
        poll_until(lambda: entries(victim) == 2, what="the victim's two streams admitted")
        poll_until(lambda: len(keys.holders(store)) == 1, what="the victim's leases in Redis")
        (victim_owner,) = keys.holders(store)
        assert len(keys.leases_of(store, victim_owner)) == 2
        assert sum(keys.leases_of(store, victim_owner).values()) == 2 * 19

        load = LoadLoop(survivor.url, SURVIVOR_STREAM, threads=2).start()
        poll_until(lambda: len(keys.holders(store)) == 2, what="the survivor's leases in Redis")
        assert victim_owner in keys.owners_alive(store)

        victim.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        for stream in doomed:
            # Cut with the process: an error to its own clients, nothing else.
            with suppress(httpx.HTTPError):
                assert not stream.result(timeout=60).completed

        poll_until(
            lambda: (
                not keys.leases_of(store, victim_owner)
                and keys.booked_by(store, victim_owner) == 0
                and victim_owner not in keys.owners_alive(store)
            ),
            timeout_s=LEASE_TTL_S + MARGIN_S,
            what="the killed process's leases to expire",
        )
        poll_until(lambda: consistent(store, keys, [survivor]), what="Redis's total = the survivor's")
        # The room is back: the big one fits only without the victim's blocks.
        big = pool.submit(stream_once, survivor.url, BIG)
        assert big.result(timeout=120).completed

        answered = load.stop()

    after_kill = [s for s in answered if s.sent_at > killed_at]
    assert after_kill, "the survivor was given streams after the kill"
    failed = [(s.status, s.body[-300:]) for s in answered if not s.completed]
    assert not failed, failed
    assert survivor.ready()
    poll_until(lambda: redis_idle(store, keys) and entries(survivor) == 0, what="every lease released")
