"""Several kvgate processes, one budget in Redis: a request reaches every process at the same
moment, and the pool holds one request fewer than there are processes.

Each process alone would see room for its own request; only the shared ledger can tell them
that together they do not fit. What must happen, in every round: the booked total in Redis
never goes past the admissible budget, the emulator never runs more than the requests that fit
(and never has to preempt one), and exactly that many are admitted at once; the last one waits
until a block is free and is then served in full.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import KvgateProcess, SimProcess, poll_until, sim_state
from redis_server import RedisServer, fresh_redis
from sharedkit import (
    CLIENT_TIMEOUT_S,
    SharedKeys,
    Stream,
    admissible_blocks,
    backend_state,
    redis_idle,
    shared_settings,
    start_kvgates,
    stream_once,
)

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost

__all__ = ["fresh_redis"]  # the fixture, used by name

PROCESSES = 4
ROUNDS = 3
# The emulator's loop also steps the engine: sampling it gently keeps its pace.
SAMPLE_S = 0.03
BLOCK_SIZE = 16
# Two prompt tokens and 126 generated ones: 128 / 16 = 8 blocks each, reserved whole
# (`ignore_eos`: every request runs to max_tokens, as its reservation assumes).
REQUEST_BLOCKS = 8
MAX_TOKENS = 126
# One block short of PROCESSES requests (the emulator keeps one null block besides).
USABLE_BLOCKS = PROCESSES * REQUEST_BLOCKS - 1
FITTING = USABLE_BLOCKS // REQUEST_BLOCKS
# 5 ms a step: a stream lasts about 0.7 s (more on a busy machine), and they all overlap.
ENGINE = EngineConfig(
    num_blocks=USABLE_BLOCKS + 1,
    block_size=BLOCK_SIZE,
    max_model_len=256,
    step_cost=StepCost(base_s=0.005, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
)


def request(process: int, round_: int) -> dict[str, Any]:
    # Token ids: the emulator and kvgate count the same two tokens; different ids per request
    # keep the prefix cache from sharing blocks between them.
    return {
        "model": "tiny-llama",
        "prompt": [1000 + process, 2000 + round_],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }


@pytest.fixture
def fleet(fresh_redis: RedisServer, tmp_path: Path) -> Iterator[tuple[SimProcess, list[KvgateProcess]]]:
    sim = SimProcess(SimConfig(engine=ENGINE))
    sim.start()
    with ExitStack() as stack:
        stack.callback(sim.stop)
        kvgates = start_kvgates(stack, sim.url, tmp_path, PROCESSES, shared_settings(fresh_redis.url))
        yield sim, kvgates


def test_requests_arriving_together_at_every_process_are_admitted_only_as_far_as_the_pool_holds(
    fleet: tuple[SimProcess, list[KvgateProcess]], fresh_redis: RedisServer
) -> None:
    sim, kvgates = fleet
    keys = SharedKeys()
    store = fresh_redis.client()
    # The premise: each process on its own would admit its request.
    poll_until(lambda: all(admissible_blocks(k) == USABLE_BLOCKS for k in kvgates), what="every budget known")
    assert FITTING == PROCESSES - 1
    preemptions_before = sim_state(sim.url)["num_preemptions_total"]

    peak_booked = peak_total = 0
    peak_running = 0
    for round_ in range(ROUNDS):
        poll_until(
            lambda: (
                redis_idle(store, keys) and all(backend_state(k)["ledger"]["entries"] == 0 for k in kvgates)
            ),
            what="the ledgers empty between rounds",
        )
        barrier = threading.Barrier(PROCESSES)

        def send(i: int, round_: int = round_, barrier: threading.Barrier = barrier) -> Stream:
            with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
                client.get(f"{kvgates[i].url}/healthz").raise_for_status()  # the connection, opened
                barrier.wait(timeout=30)
                return stream_once(kvgates[i].url, request(i, round_), client=client)

        with ThreadPoolExecutor(PROCESSES) as pool:
            futures = [pool.submit(send, i) for i in range(PROCESSES)]
            while not all(f.done() for f in futures):
                peak_booked = max(peak_booked, keys.requests_booked(store))
                peak_total = max(peak_total, keys.booked_total(store))
                peak_running = max(peak_running, sim_state(sim.url)["num_running"])
                time.sleep(SAMPLE_S)  # a sampling pace, not a wait: the loop ends when they do
            streams = [f.result() for f in futures]

        for stream in streams:
            assert stream.completed, (stream.status, stream.body[-500:])
        # Admitted at once: streaming before any of the round's streams had ended.
        first_end = min(s.ended_at for s in streams)
        at_once = [s for s in streams if s.first_event_at is not None and s.first_event_at < first_end]
        assert len(at_once) == FITTING, f"round {round_}: {len(at_once)} admitted at once"

    # Sampled while the fitting requests streamed: all of them booked, never one more, and
    # with the processes' standing reserves never past the pool.
    assert peak_booked == FITTING * REQUEST_BLOCKS <= peak_total <= USABLE_BLOCKS, (peak_booked, peak_total)
    assert peak_running == FITTING, peak_running
    assert sim_state(sim.url)["num_preemptions_total"] == preemptions_before
    poll_until(lambda: redis_idle(store, keys), what="every lease released")
    for kvgate in kvgates:
        assert kvgate.process.poll() is None, kvgate.output()
