"""kvgate on a real socket in front of the emulator on a real socket: streaming, disconnects,
backend crashes, and the official OpenAI client with its retries."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import Served, bound_socket, ledger_is_empty, served_gateway, serving

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.faults import Faults
from sim.server import create_sim_app
from sim.testing import SimServer, running_sim_server

# 5 ms per engine step: a 300-token answer streams for about 1.5 s.
SLOW_ENGINE = EngineConfig(step_cost=StepCost(base_s=0.005, per_token_s=0.0, per_seq_s=0.0))
LONG = {"model": "tiny-llama", "prompt": "tell me", "max_tokens": 300, "ignore_eos": True}


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with running_sim_server(SimConfig(engine=SLOW_ENGINE)) as server:
        yield server


@pytest.fixture
def kvgate(sim: SimServer) -> Iterator[Served]:
    with served_gateway(sim.url) as served:
        yield served


def sim_state(sim: SimServer) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{sim.url}/sim/state", timeout=5).json()
    return state


def outcome_count(served: Served, outcome: str) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=5).text
    prefix = f'kvgate_requests_total{{backend="default",outcome="{outcome}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def test_stream_is_relayed_as_it_is_produced(kvgate: Served) -> None:
    with (
        httpx.Client(base_url=kvgate.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
    ):
        assert response.status_code == 200
        arrivals = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    # Tokens arrived spread over the generation, not in one burst at the end.
    assert len(arrivals) > 100
    assert arrivals[-1] - arrivals[0] > 0.5
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_client_leaving_mid_stream_aborts_upstream_and_releases(kvgate: Served, sim: SimServer) -> None:
    with (
        httpx.Client(base_url=kvgate.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
    ):
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert kvgate.call(lambda: kvgate.gateway.ledger.totals().entries) == 1
    # Leaving the `with` closed the connection mid-stream.
    kvgate.wait_until(ledger_is_empty, timeout_s=5, what="the reservation to be released")
    deadline = time.monotonic() + 5
    while sim_state(sim)["num_running"] != 0:
        assert time.monotonic() < deadline, "the emulator kept generating for a client that left"
        time.sleep(0.01)
    assert outcome_count(kvgate, "client_gone") == 1


def test_client_leaving_while_queued_leaves_the_queue(sim: SimServer) -> None:
    with served_gateway(sim.url) as kvgate, ThreadPoolExecutor(4) as pool:
        hog = {**LONG, "prompt": "a", "max_tokens": 950}  # 30 blocks: two fill the pool
        hogs = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=hog, timeout=60) for _ in range(2)
        ]
        kvgate.wait_until(lambda gw: gw.ledger.totals().entries == 2, what="two admissions")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{kvgate.url}/v1/completions", json={**LONG, "max_tokens": 200}, timeout=0.3)
        kvgate.wait_until(lambda gw: len(gw.queue) == 0, timeout_s=2, what="the queue to empty")
        assert outcome_count(kvgate, "client_gone") == 1
        assert [f.result().status_code for f in hogs] == [200, 200]
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_backend_crash_mid_stream_ends_with_an_error_event(sim: SimServer) -> None:
    httpx.post(f"{sim.url}/sim/faults", json={"crash_after_tokens": 20}, timeout=5).raise_for_status()
    with served_gateway(sim.url) as kvgate:
        response = httpx.post(f"{kvgate.url}/v1/completions", json={**LONG, "stream": True}, timeout=30)
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        error = json.loads(events[-1])["error"]
        assert error["type"] == "upstream_error"
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")
        assert outcome_count(kvgate, "upstream_error") == 1
        # A non-streaming request loses its connection instead: a clean 502.
        plain = httpx.post(f"{kvgate.url}/v1/completions", json=LONG, timeout=30)
        assert plain.status_code == 502
        assert plain.json()["error"]["code"] == "upstream_failed"
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_backend_down_is_reported_and_served_again_when_back() -> None:
    # The backend's port is bound but not listening yet: connections are refused.
    backend_socket = bound_socket()
    backend_url = f"http://127.0.0.1:{backend_socket.getsockname()[1]}"
    try:
        with served_gateway(backend_url, wait_ready=False) as kvgate:
            kvgate.wait_until(
                lambda gw: gw.snapshot().state.value == "down", what="the backend to be marked down"
            )
            response = httpx.post(f"{kvgate.url}/v1/completions", json=LONG, timeout=10)
            assert response.status_code == 503
            assert response.headers["x-should-retry"] == "true"
            assert "retry-after" in response.headers
            ready = httpx.get(f"{kvgate.url}/readyz", timeout=5)
            assert ready.status_code == 503
            assert ready.json()["ready"] is False
            with serving(create_sim_app(SimConfig(engine=SLOW_ENGINE)), backend_socket):
                kvgate.wait_until(lambda gw: gw.readiness()[0], what="the gateway to find the backend")
                back = httpx.post(f"{kvgate.url}/v1/completions", json={**LONG, "max_tokens": 3}, timeout=10)
                assert back.status_code == 200
    finally:
        backend_socket.close()


def test_openai_client_streams_and_retries_after_429(sim: SimServer) -> None:
    with (
        served_gateway(sim.url, priority_classes={"normal": {"queue_max": 0}}) as kvgate,
        ThreadPoolExecutor(3) as pool,
        openai.OpenAI(base_url=f"{kvgate.url}/v1", api_key="unused", max_retries=10, timeout=30) as client,
    ):
        # Streaming through the SDK.
        stream = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=12, stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text
        chat = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert chat.usage is not None
        assert chat.usage.completion_tokens <= 5
        # Fill most of the pool (3 x 13 blocks); with no queue the next request (32 blocks) is
        # shed with 429 + retry hints, and the SDK retries by itself until blocks free up.
        hog = {**LONG, "prompt": "a", "max_tokens": 400}
        hogs = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=hog, timeout=60) for _ in range(3)
        ]
        kvgate.wait_until(lambda gw: gw.ledger.totals().entries == 3, what="the hogs to be admitted")
        retried = client.completions.with_raw_response.create(model="tiny-llama", prompt="b", max_tokens=1000)
        assert retried.http_response.status_code == 200
        assert retried.retries_taken >= 1
        assert outcome_count(kvgate, "shed_queue_full") == retried.retries_taken
        assert [h.result().status_code for h in hogs] == [200] * 3
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_faults_on_the_sim_leave_no_reservation_behind(sim: SimServer) -> None:
    httpx.post(f"{sim.url}/sim/faults", json=Faults(error_rate=0.5, error_status=503).to_json(), timeout=5)
    with served_gateway(sim.url) as kvgate, ThreadPoolExecutor(8) as pool:
        body = {**LONG, "max_tokens": 20}
        results = list(
            pool.map(lambda _: httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=30), range(16))
        )
        statuses = {r.status_code for r in results}
        assert statuses <= {200, 503}
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_every_counting_thread_has_its_tokenizer_copy_before_the_first_large_body(
    sim: SimServer, tiny_model_dir: Path
) -> None:
    # A copy made on first use holds the interpreter for a third of a second: the first large
    # body after start stalled every request for that long.
    with served_gateway(
        sim.url, wait_ready=False, discover_tokenizer=True, tokenizer=str(tiny_model_dir), tokenizer_threads=3
    ) as kvgate:
        # Loading transformers and the tokenizer takes seconds on a loaded machine.
        kvgate.wait_until(lambda gateway: gateway.readiness()[0], 120, "the gateway to be ready")
        counter = kvgate.call(lambda: kvgate.app.state.kvgate.catalog.default().counter)
        assert counter.exact
        assert counter.tokenizer_copies == 1 + 3  # the loop's and every counting thread's
        large = {"model": "tiny-llama", "prompt": "word " * 600, "max_tokens": 1}  # counted in a thread
        answers = [httpx.post(f"{kvgate.url}/v1/completions", json=large, timeout=30) for _ in range(4)]
        assert [answer.status_code for answer in answers] == [200] * 4, answers[0].text
        assert counter.tokenizer_copies == 1 + 3
