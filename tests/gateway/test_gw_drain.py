"""The drain-rate projection the queue reads on every pump: from the ledger's running sums,
equal to the sum over the requests in flight, whatever they streamed or left."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client import CollectorRegistry

from estimator.demand import BlockCost, Demand
from gateway.metrics import GatewayMetrics
from gateway.service import BackendGateway
from gateway.settings import Settings
from gateway.upstream import HttpxUpstream

SECONDS_PER_TOKEN = 0.02


@pytest.fixture
def gateway() -> Iterator[BackendGateway]:
    client = httpx.AsyncClient()  # never used: nothing here reaches a backend
    with ThreadPoolExecutor(1) as executor:
        yield BackendGateway(
            Settings(backend_url="http://unused"),
            client=client,
            upstream=HttpxUpstream(client, "http://unused"),
            clock=lambda: 0.0,
            metrics=GatewayMetrics(CollectorRegistry()),
            executor=executor,
        )


def projected(gateway: BackendGateway) -> float:
    """The projection computed the long way, over every entry."""
    entries = list(gateway.ledger.entries())
    blocks = sum(entry.reserved_blocks for entry in entries)
    seconds = sum(
        max(1, entry.demand.expected_output_tokens - entry.longest_output) * SECONDS_PER_TOKEN
        for entry in entries
    )
    return blocks / (seconds / len(entries))


def test_projection_follows_the_requests_in_flight(gateway: BackendGateway) -> None:
    assert gateway.drain_rate(0.0) is None  # nothing observed, no service time known
    gateway.seconds_per_output_token.add(SECONDS_PER_TOKEN)
    assert gateway.drain_rate(0.0) is None  # nothing in flight
    for key, (prompt, expected, samples) in enumerate([(40, 100, 1), (300, 20, 2), (5, 500, 1)]):
        demand = Demand(
            prompt_tokens=(prompt,),
            max_output_tokens=600,
            expected_output_tokens=expected,
            samples_per_prompt=samples,
            cost=BlockCost(block_size=16),
        )
        gateway.ledger.open(key, demand, now=0.0)
    assert gateway.drain_rate(0.0) == pytest.approx(projected(gateway))
    gateway.ledger.grow(0, 0, 60)
    gateway.ledger.grow(1, 1, 45)  # past its expected output: one token to go, at least
    assert gateway.drain_rate(0.0) == pytest.approx(projected(gateway))
    gateway.ledger.close(2)
    assert gateway.drain_rate(0.0) == pytest.approx(projected(gateway))


def test_the_observed_rate_wins_once_known(gateway: BackendGateway) -> None:
    gateway.seconds_per_output_token.add(SECONDS_PER_TOKEN)
    demand = Demand(
        prompt_tokens=(40,),
        max_output_tokens=600,
        expected_output_tokens=10,
        samples_per_prompt=1,
        cost=BlockCost(block_size=16),
    )
    gateway.ledger.open(0, demand, now=0.0)
    fast = gateway.drain_rate(0.0)
    assert fast == pytest.approx(projected(gateway))
    # Five blocks freed per busy second for 10 s (the entry above kept the backend busy):
    # slower than the projection, which sees decode time only, and what the queue's
    # predictions use from now on.
    for second in range(1, 11):
        gateway.drain.add(5.0, float(second))
    observed = gateway.drain.rate(10.0)
    assert observed is not None
    assert fast is not None
    assert observed < fast / 2
    assert gateway.drain_rate(10.0) == pytest.approx(observed)
