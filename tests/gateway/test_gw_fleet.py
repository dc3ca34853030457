"""One kvgate in front of several emulated backends: routing by model, one queue per model over
the fleet, prefix affinity, balance, and failover of a connection refused before any byte.

The emulators run in process (`gateway_over_sims`); tests/faults/test_fault_fleet.py kills real
emulator processes, and tests/benchmarks/fleet.py measures the fleet on real vLLM engines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import replace
from typing import Any

import httpx
import pytest
from conftest import FAST_ENGINE, TEST_SETTINGS, gateway_over_sims, wait_until

from estimator.tokens import TokenCounter
from gateway.app import create_app
from gateway.router import Router
from gateway.settings import Settings
from sim.config import SimConfig
from sim.engine import StepCost
from sim.lengths import OutputLengthModel
from sim.server import create_sim_app

pytestmark = pytest.mark.asyncio


def placed(router: Router) -> Counter[str]:
    """Requests completed, by the backend that served them."""
    return Counter(
        summary.backend for summary in router.recent.latest() if summary.outcome.value == "completed"
    )


def ledgers_empty(router: Router) -> bool:
    return all(backend.ledger.totals().entries == 0 for backend in router.backends) and not router.inflight


def completion(model: str, prompt: Any, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens}


async def test_requests_go_to_a_backend_of_their_model_and_unknown_models_are_404() -> None:
    sims = {
        "a": SimConfig(engine=FAST_ENGINE, model_name="alpha"),
        "b": SimConfig(engine=FAST_ENGINE, model_name="beta"),
    }
    async with gateway_over_sims(sims) as fleet:
        for model in ("alpha", "beta", "beta"):
            answer = await fleet.client.post("/v1/completions", json=completion(model, "hello there"))
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
        assert placed(fleet.router) == Counter({"a": 1, "b": 2})
        missing = await fleet.client.post("/v1/completions", json=completion("gamma", "hello"))
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "model_not_found"
        assert error["param"] == "model"
        assert "alpha" in error["message"]
        assert "beta" in error["message"]
        listed = (await fleet.client.get("/v1/models")).json()
        assert sorted(item["id"] for item in listed["data"]) == ["alpha", "beta"]
        assert ledgers_empty(fleet.router)


async def test_balanced_traffic_spreads_over_both_backends() -> None:
    engine = replace(FAST_ENGINE, step_cost=StepCost(base_s=0.01, per_token_s=0.0, per_seq_s=0.0))
    sims = {
        name: SimConfig(engine=engine, output_len=OutputLengthModel.parse("fixed:16")) for name in ("a", "b")
    }
    async with gateway_over_sims(sims) as fleet:
        # Different prompts (no shared prefix) arriving together: headroom decides.
        answers = await asyncio.gather(
            *(
                fleet.client.post("/v1/completions", json=completion("tiny-llama", [i + 1] * 40, 16))
                for i in range(40)
            )
        )
        assert [a.status_code for a in answers] == [200] * 40
        shares = placed(fleet.router)
        assert 0.3 <= shares["a"] / 40 <= 0.7, shares
        assert ledgers_empty(fleet.router)


async def test_prompts_sharing_a_prefix_go_where_it_is_cached() -> None:
    sims = {name: SimConfig(engine=FAST_ENGINE) for name in ("a", "b")}
    async with gateway_over_sims(sims) as fleet:
        router = fleet.router
        block = router.backends[0].block_size()
        assert block is not None
        shared = list(range(100, 100 + 8 * block))  # eight full blocks
        first = await fleet.client.post("/v1/completions", json=completion("tiny-llama", [*shared, 1]))
        assert first.status_code == 200
        [home] = placed(router)
        other = next(b.name for b in router.backends if b.name != home)
        # One request at a time keeps the loads equal: the cached prefix decides, every time,
        # and a prompt that shares nothing goes by headroom (the other backend: ties by name
        # could send it either way, so it is only checked to be served).
        for tail in range(2, 8):
            answer = await fleet.client.post(
                "/v1/completions", json=completion("tiny-llama", [*shared, tail])
            )
            assert answer.status_code == 200
        assert placed(router)[home] == 7
        assert placed(router)[other] == 0
        assert len(router.backend(home).prefixes) >= 8
        assert len(router.backend(other).prefixes) == 0


async def test_a_waiting_request_goes_to_whichever_backend_frees_first() -> None:
    # Each request needs most of a pool: one at a time per backend. "slow" takes seconds per
    # answer, "fast" milliseconds; bound to a backend at arrival, half would wait on "slow".
    fast = replace(FAST_ENGINE, num_blocks=24, max_model_len=512)
    slow = replace(fast, step_cost=StepCost(base_s=0.25, per_token_s=0.0, per_seq_s=0.0))
    sims = {
        "fast": SimConfig(engine=fast, output_len=OutputLengthModel.parse("fixed:8")),
        "slow": SimConfig(engine=slow, output_len=OutputLengthModel.parse("fixed:8")),
    }
    async with gateway_over_sims(sims, budget_overcommit=0) as fleet:
        router = fleet.router
        block = router.backends[0].block_size()
        total = router.backends[0].snapshot().total_blocks
        assert block is not None
        assert total > 0
        prompt_tokens = (total // 2 + 2) * block  # more than half a pool: one fits at a time
        answers = await asyncio.gather(
            *(
                fleet.client.post(
                    "/v1/completions", json=completion("tiny-llama", [7 + i] * prompt_tokens, 8)
                )
                for i in range(12)
            )
        )
        assert [a.status_code for a in answers] == [200] * 12, [
            a.text for a in answers if a.status_code != 200
        ]
        shares = placed(router)
        assert shares["fast"] >= 9, shares
        assert shares["slow"] <= 3, shares
        await wait_until(lambda: ledgers_empty(router), what="the ledgers to empty")


class RefusingGenerations(httpx.AsyncBaseTransport):
    """A backend whose /metrics and /v1/models answer (it looks up) but whose generation
    requests fail to connect, as when the process died a moment after its last scrape."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.refused = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.refused += 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


async def test_a_connection_refused_before_any_byte_is_retried_once_on_another_backend() -> None:
    # "gone" has the larger pool, so headroom sends requests there first.
    big = replace(FAST_ENGINE, num_blocks=FAST_ENGINE.num_blocks * 4)
    sims = {"gone": SimConfig(engine=big), "live": SimConfig(engine=FAST_ENGINE)}
    refusing: list[RefusingGenerations] = []

    def refuse(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        refusing.append(RefusingGenerations(inner))
        return refusing[0]

    async with gateway_over_sims(sims, transports={"gone": refuse}) as fleet:
        router = fleet.router
        answer = await fleet.client.post("/v1/completions", json=completion("tiny-llama", "hello", 4))
        assert answer.status_code == 200, answer.text
        assert refusing[0].refused == 1
        assert placed(router) == Counter({"live": 1})
        metrics = (await fleet.client.get("/metrics")).text
        assert 'kvgate_failovers_total{backend="gone"} 1.0' in metrics
        assert ledgers_empty(router)


async def test_connections_are_budgeted_like_blocks() -> None:
    # Room for every stream in blocks, but two connections: the rest wait their turn in the
    # queue (none fails for want of a connection) and no more than two are ever in flight.
    engine = replace(FAST_ENGINE, step_cost=StepCost(base_s=0.01, per_token_s=0.0, per_seq_s=0.0))
    sims = {"only": SimConfig(engine=engine, output_len=OutputLengthModel.parse("fixed:12"))}
    async with gateway_over_sims(sims, max_connections=2) as fleet:
        router = fleet.router
        most = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal most
            while not stop.is_set():
                most = max(most, router.backends[0].ledger.totals().entries)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 12, "stream": True}
        answers = await asyncio.gather(*(fleet.client.post("/v1/completions", json=body) for _ in range(6)))
        stop.set()
        await watcher
        assert [a.status_code for a in answers] == [200] * 6
        assert all(a.text.rstrip().endswith("data: [DONE]") for a in answers)
        assert most == 2
        assert max(int(a.headers["x-kvgate-queue-ms"]) for a in answers) > 0
        assert ledgers_empty(router)


async def test_a_dns_name_is_a_backend_per_address_and_follows_the_name() -> None:
    addresses = ["10.0.0.1", "10.0.0.2"]

    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("vllm-headless", 8000)
        return list(addresses)

    sims = {address: create_sim_app(SimConfig(engine=FAST_ENGINE)) for address in addresses}
    async with contextlib.AsyncExitStack() as stack:
        for sim_app in sims.values():
            await stack.enter_async_context(sim_app.run())
        mounts = {f"http://{a}:8000": httpx.ASGITransport(app) for a, app in sims.items()}
        backend_client = await stack.enter_async_context(httpx.AsyncClient(mounts=mounts))
        settings = Settings(backends=["dns+http://vllm-headless:8000"], **TEST_SETTINGS)
        app = create_app(
            settings, http_client=backend_client, token_counter=TokenCounter.approximate(), resolve=resolve
        )
        await stack.enter_async_context(app.router.lifespan_context(app))
        router: Router = app.state.kvgate
        assert [b.name for b in router.backends] == ["10.0.0.1:8000", "10.0.0.2:8000"]
        await wait_until(lambda: all(b.readiness()[0] for b in router.backends), 10, "both backends ready")
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost")
        )
        answer = await client.post("/v1/completions", json=completion("tiny-llama", "hello", 2))
        assert answer.status_code == 200
        # The name stops resolving to the first address: it is retired (idle, so stopped and
        # its series dropped), and everything goes to the second.
        addresses.remove("10.0.0.1")
        await router.resolve_once()
        assert [b.name for b in router.backends] == ["10.0.0.2:8000"]
        for _ in range(3):
            answer = await client.post("/v1/completions", json=completion("tiny-llama", "hello", 2))
            assert answer.status_code == 200
        assert placed(router)["10.0.0.2:8000"] >= 3
        assert 'backend="10.0.0.1:8000"' not in (await client.get("/metrics")).text
        # It comes back: a backend again.
        addresses.append("10.0.0.1")
        await router.resolve_once()
        await wait_until(
            lambda: len(router.backends) == 2 and all(b.readiness()[0] for b in router.backends), 10
        )
