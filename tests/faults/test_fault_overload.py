"""Overload through a real kvgate in front of a small, slow emulator: each client is served
for what its headers ask (docs/admission.md, "What a client asks for").

The emulator holds two requests at a time (4 usable blocks, 2 blocks a request) and takes
about half a second for each: it serves about 4 requests per second. Each kvgate is first
warmed with a burst that saturates the backend, so that it knows the rate at which blocks free
up then (with no rate it judges nobody, and the tests below would pass for that reason alone).

- A burst the backend absorbs within the clients' deadline: every request is served, most of
  them after their first-token time (with a deadline too, that time is not where they give up).
- Five times the capacity, for several seconds, clients with a deadline (with or without a
  first-token time): arrivals predicted to miss their deadline are shed with 429
  `deadline_unreachable` (retryable, with Retry-After), most at arrival and the rest as soon as
  the drain shows they will miss, within a second of arrival; the rest are served late for any
  first-token time but within the deadline.
- The same overload, clients with a first-token time only: that time is their deadline, so
  arrivals are shed at once unless they can have their first token in time, and the requests
  served get it about then.

Client timings are asserted against generous bounds only (the machine is shared): what is
checked is the outcome of each request and which side of the deadline a 429 comes.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import KvgateProcess, SimProcess, kvgate_process, ledger_balanced, poll_until, sim_process

from gateway.admission import REFUSE_WITHIN_S
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost

# 4 usable blocks (vLLM keeps a null block); a request of a few prompt tokens and 20 output
# tokens takes 2 of them, so two run at once, for 20 decode steps of 25 ms each. The context
# must fit the pool for the emulator to start.
POOL = EngineConfig(
    num_blocks=5,
    block_size=16,
    max_model_len=64,
    step_cost=StepCost(base_s=0.025, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
)
BODY = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
# About 4 requests per second (two at a time, ~0.5 s each).
CAPACITY_PER_S = 4.0
WARM_UP_REQUESTS = 10
OVERLOAD_FACTOR = 5.0
OVERLOAD_S = 4.0
# The deadline leaves the plain queue room to run past it: its backlog is capped at 1.25 times
# an arrival's queue budget (the deadline minus the ~0.5 s of service).
OVERLOAD_DEADLINE_S = 4.0
OVERLOAD_OBJECTIVE_S = 1.0
# A 429 decided at arrival comes well before the deadline; the bound leaves room for a loaded
# machine.
PROMPT_SHED_S = 2.0
CLIENT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it; times from sending, in seconds."""

    status: int
    headers: Mapping[str, str]
    error: dict[str, Any] | None
    first_token_s: float | None
    answered_s: float

    @property
    def code(self) -> str | None:
        return None if self.error is None else self.error.get("code")


def deadline_headers(deadline_s: float | None, objective_s: float | None = None) -> dict[str, str]:
    headers = {}
    if deadline_s is not None:
        headers["x-kvgate-deadline-ms"] = str(round(deadline_s * 1000))
    if objective_s is not None:
        headers["x-kvgate-ttft-ms"] = str(round(objective_s * 1000))
    return headers


async def send(client: httpx.AsyncClient, url: str, headers: Mapping[str, str]) -> Outcome:
    sent = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=BODY, headers=headers) as response:
        if response.status_code != 200:
            body = json.loads(await response.aread())
            return Outcome(
                response.status_code, response.headers, body["error"], None, time.monotonic() - sent
            )
        first_token_s = None
        async for line in response.aiter_lines():
            if first_token_s is None and line.startswith("data: ") and line != "data: [DONE]":
                first_token_s = time.monotonic() - sent
        return Outcome(200, response.headers, None, first_token_s, time.monotonic() - sent)


async def offer(url: str, count: int, per_s: float, headers: Mapping[str, str]) -> list[Outcome]:
    """Send `count` requests at a fixed rate (math.inf: all at once), open loop: a request
    goes out on schedule whatever happened to the earlier ones."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def scheduled(index: int) -> Outcome:
            # Pacing the arrival schedule, not waiting for a condition.
            await asyncio.sleep(max(0.0, start + index / per_s - loop.time()))
            return await send(client, url, headers)

        return list(await asyncio.gather(*(scheduled(i) for i in range(count))))


def assert_balances(kvgate: KvgateProcess) -> None:
    poll_until(lambda: ledger_balanced(kvgate.state()), 10, "the ledger to balance")


def ttfts(outcomes: list[Outcome]) -> list[float]:
    return [o.first_token_s for o in outcomes if o.status == 200 and o.first_token_s is not None]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with sim_process(SimConfig(engine=POOL)) as process:
        yield process


@contextmanager
def warmed_kvgate(
    sim: SimProcess, log: Path, settings: dict[str, Any] | None = None
) -> Iterator[KvgateProcess]:
    """A fresh kvgate, warmed by a burst that keeps its queue busy for about two seconds: by
    then it has seen enough blocks free up while saturated to know the backend's capacity."""
    with kvgate_process(sim.url, log, settings=settings) as process:
        warm = asyncio.run(offer(process.url, WARM_UP_REQUESTS, math.inf, {}))
        assert [o.status for o in warm] == [200] * WARM_UP_REQUESTS
        poll_until(
            lambda: process.state()["backends"][0]["queue"]["saturated_drain_rate_blocks_per_s"] is not None,
            5,
            "a saturated drain rate",
        )
        assert_balances(process)
        yield process


@pytest.fixture
def kvgate(sim: SimProcess, tmp_path: Path) -> Iterator[KvgateProcess]:
    with warmed_kvgate(sim, tmp_path / "kvgate.log") as process:
        yield process


def test_a_burst_the_backend_absorbs_is_served_late_not_shed(kvgate: KvgateProcess) -> None:
    # 12 requests at once: about 3 s of work, well within the 20 s deadline; all but the first
    # two wait in the queue far past their 0.5 s objective.
    count, objective_s = 12, 0.5
    outcomes = asyncio.run(offer(kvgate.url, count, math.inf, deadline_headers(20.0, objective_s)))
    assert [o.status for o in outcomes] == [200] * count, [o.error for o in outcomes if o.error]
    late = [t for t in ttfts(outcomes) if t > objective_s]
    assert len(late) >= count // 2, f"first tokens {sorted(ttfts(outcomes))}"
    print(f"burst of {count}: all served, {len(late)} after the {objective_s} s objective")
    assert_balances(kvgate)


def assert_prompt_retryable_429(outcome: Outcome, within_s: float = PROMPT_SHED_S) -> None:
    assert outcome.status == 429
    assert outcome.headers["x-should-retry"] == "true"
    assert float(outcome.headers["retry-after"]) >= 1
    assert int(outcome.headers["retry-after-ms"]) > 0
    assert outcome.error is not None
    assert set(outcome.error) == {"message", "type", "param", "code"}
    assert outcome.error["type"] == "rate_limit_error"
    assert outcome.answered_s < within_s


def test_first_token_clients_beyond_capacity_are_shed_at_once_or_served_in_time(
    kvgate: KvgateProcess,
) -> None:
    per_s = OVERLOAD_FACTOR * CAPACITY_PER_S
    count = round(per_s * OVERLOAD_S)
    outcomes = asyncio.run(offer(kvgate.url, count, per_s, deadline_headers(None, OVERLOAD_OBJECTIVE_S)))
    served = [o for o in outcomes if o.status == 200]
    shed = [o for o in outcomes if o.code == "deadline_unreachable"]
    others = [o for o in outcomes if o.status != 200 and o.code != "deadline_unreachable"]
    on_time = [t for t in ttfts(served) if t <= OVERLOAD_OBJECTIVE_S + 0.5]
    print(
        f"{count} offered at {per_s:.0f}/s, first-token time only: {len(served)} served "
        f"({len(on_time)} near it), {len(shed)} shed at arrival, others {sorted({str(o.code) for o in others})}; "
        f"slowest 429 after {max((o.answered_s for o in shed), default=0):.2f} s"
    )
    assert len(shed) >= count // 2
    for outcome in shed:
        assert_prompt_retryable_429(outcome)
    # The backend keeps serving at its capacity; the queue is kept short enough that the
    # requests served get their first token near the time they asked for.
    assert len(served) >= CAPACITY_PER_S * OVERLOAD_S / 2
    assert len(on_time) >= 0.7 * len(served), f"first tokens {sorted(ttfts(served))}"
    assert all(o.status == 429 and o.code == "deadline_expired" for o in others), [
        (o.status, o.code) for o in others
    ]
    assert_balances(kvgate)


@pytest.mark.parametrize("objective_s", [None, OVERLOAD_OBJECTIVE_S])
def test_deadline_clients_beyond_capacity_are_shed_for_their_deadline_only(
    kvgate: KvgateProcess, objective_s: float | None
) -> None:
    per_s = OVERLOAD_FACTOR * CAPACITY_PER_S
    count = round(per_s * OVERLOAD_S)
    outcomes = asyncio.run(
        offer(kvgate.url, count, per_s, deadline_headers(OVERLOAD_DEADLINE_S, objective_s))
    )
    codes = [o.code for o in outcomes if o.status != 200]
    served = ttfts(outcomes)
    print(
        f"{count} offered at {per_s:.0f}/s, deadline (first-token time {objective_s}): {len(served)} "
        f"served, sheds { {code: codes.count(code) for code in set(codes)} }, first tokens up to "
        f"{max(served, default=0):.2f} s"
    )
    assert codes.count("deadline_unreachable") >= count // 2
    assert set(codes) <= {"deadline_unreachable", "deadline_expired"}
    unreachable = [o for o in outcomes if o.code == "deadline_unreachable"]
    # Most are refused at arrival; a waiter that the drain then shows will miss is refused as
    # soon as that is predicted, but only within the refusal horizon (docs/admission.md):
    # none of these refusals comes much later than a second after its request was sent (the
    # margin is for a shared machine's loop lag).
    prompt = [o for o in unreachable if o.answered_s < PROMPT_SHED_S]
    assert len(prompt) >= 0.8 * len(unreachable), sorted(round(o.answered_s, 2) for o in unreachable)
    for outcome in unreachable:
        assert_prompt_retryable_429(outcome, within_s=REFUSE_WITHIN_S + 0.6)
    assert len(served) >= CAPACITY_PER_S * OVERLOAD_S / 2
    # A client with a deadline waits for its answer: the queue stays as long as the deadline
    # allows, and most first tokens come well after the first-token time (which a client of
    # the test above would not wait for).
    assert statistics.median(served) > 2 * OVERLOAD_OBJECTIVE_S, f"first tokens {sorted(served)}"
    assert_balances(kvgate)
