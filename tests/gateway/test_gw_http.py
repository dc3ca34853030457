"""kvgate's HTTP surface in process (httpx.ASGITransport), in front of the emulator."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from conftest import InProcess, gateway_over_sim, ledger_is_empty, wait_until

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.faults import Faults, MetricsMode
from sim.lengths import OutputLengthModel as SimOutputLength

# Slow enough that a few hundred tokens keep requests in flight while others arrive.
SLOW_ENGINE = EngineConfig(step_cost=StepCost(base_s=0.002, per_token_s=0.0, per_seq_s=0.0))

COMPLETION: dict[str, Any] = {
    "model": "tiny-llama",
    "prompt": "hello there",
    "max_tokens": 8,
    "ignore_eos": True,
}
# The same, left to run to its cap by the emulator (it emits no EOS unless told to) without
# telling kvgate so: ignore_eos is a floor kvgate reserves, which a learning test must avoid.
UNFORCED = {key: value for key, value in COMPLETION.items() if key != "ignore_eos"}
CHAT: dict[str, Any] = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 6,
}


async def test_completion_is_relayed_with_kvgate_headers(inproc: InProcess) -> None:
    response = await inproc.client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 8
    assert int(response.headers["x-kvgate-queue-ms"]) >= 0
    assert int(response.headers["x-kvgate-blocks"]) >= 1
    assert ledger_is_empty(inproc.gateway)


async def test_streaming_chat_is_relayed_and_counted(inproc: InProcess) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    response = await inproc.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] <= 6
    assert ledger_is_empty(inproc.gateway)
    described = inproc.gateway.output_model.describe()
    assert described["tiny-llama/chat"]["samples"] == 1


async def test_output_model_learns_and_shrinks_reservations() -> None:
    async with gateway_over_sim(output_min_samples=3, output_quantile=0.5) as harness:
        request = {**UNFORCED, "prompt": "x", "max_tokens": 100}
        cold = await harness.client.post("/v1/completions", json=request)
        assert cold.headers["x-kvgate-blocks"] == "4"  # no samples yet: the whole cap, 100 + prompt
        for _ in range(3):
            done = await harness.client.post("/v1/completions", json={**request, "max_tokens": 5})
            assert done.status_code == 200
        # Learned lengths 100, 5, 5, 5: the median is 5, so a 100-token cap reserves one block.
        learned = await harness.client.post("/v1/completions", json=request)
        assert learned.status_code == 200
        assert learned.headers["x-kvgate-blocks"] == "1"
        errors = (await harness.client.get("/metrics")).text
        assert 'kvgate_output_prediction_error_tokens_count{backend="default"} 5.0' in errors
        # The learned request outgrew its reservation: counted, and the ledger still balanced.
        assert 'kvgate_output_reservation_exceeded_total{backend="default"} 1.0' in errors
        assert ledger_is_empty(harness.gateway)


async def test_a_gateway_started_before_a_busy_backend_reserves_what_its_answers_ran_to() -> None:
    async with gateway_over_sim(output_min_samples=3, output_quantile=0.9) as harness:
        request = {**UNFORCED, "prompt": "x", "max_tokens": 100}
        # Traffic that reached vLLM before this gateway did: three answers of 5 tokens.
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(harness.sim), base_url="http://sim"
        ) as direct:
            for _ in range(3):
                assert (await direct.post("/v1/completions", json={**request, "max_tokens": 5})).is_success
        await wait_until(lambda: harness.gateway.output_model.backend_prior is not None, what="a scrape")
        # Its first request reserves the backend's p90 (5 tokens: one block), not the cap (4).
        first = await harness.client.post("/v1/completions", json=request)
        assert first.status_code == 200
        assert first.headers["x-kvgate-blocks"] == "1"
        state = (await harness.client.get("/admin/state")).json()
        [backend] = state["backends"]
        assert backend["output_model"]["backend_prior"] == {"tokens": 5, "samples": 3}
        assert ledger_is_empty(harness.gateway)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/completions", b"{not json", 400, None, "invalid_json"),
        ("/v1/completions", b"", 400, None, "invalid_json"),
        ("/v1/completions", b"[1, 2]", 400, None, None),
        ("/v1/completions", {**COMPLETION, "stream": "yes"}, 400, "stream", None),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", None),
        ("/v1/completions", {**COMPLETION, "max_tokens": "eight"}, 400, "max_tokens", None),
        ("/v1/completions", {**COMPLETION, "n": "two"}, 400, "n", None),
        ("/v1/completions", {**COMPLETION, "min_tokens": 9}, 400, "min_tokens", None),
        ("/v1/completions", {**COMPLETION, "ignore_eos": None}, 400, "ignore_eos", None),
        ("/v1/completions", {**COMPLETION, "max_tokens": 1025}, 400, "max_tokens", "context_length_exceeded"),
        ("/v1/completions", {**COMPLETION, "prompt": None}, 400, "prompt", None),
        ("/v1/completions", {**COMPLETION, "model": 7}, 400, "model", None),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages", None),
        # n = 3 sequences of up to 1,000 tokens each: more than the whole 63-block pool.
        (
            "/v1/completions",
            {**COMPLETION, "n": 3, "max_tokens": 1000},
            400,
            "max_tokens",
            "kv_pool_exceeded",
        ),
        ("/v1/completions", {**COMPLETION, "model": "gpt-5"}, 404, "model", "model_not_found"),
    ],
)
async def test_invalid_requests(
    inproc: InProcess,
    path: str,
    body: dict[str, Any] | bytes,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    if isinstance(body, bytes):
        response = await inproc.client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = await inproc.client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert response.headers["x-should-retry"] == "false"
    assert ledger_is_empty(inproc.gateway)


async def test_bad_hint_headers_and_oversized_bodies() -> None:
    async with gateway_over_sim(max_body_bytes=2048) as harness:
        bad = await harness.client.post(
            "/v1/completions", json=COMPLETION, headers={"x-kvgate-priority": "now"}
        )
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "x-kvgate-priority")
        told_nothing = await harness.client.post(
            "/v1/completions", json=COMPLETION, headers={"x-kvgate-expected-output-tokens": "0"}
        )
        assert told_nothing.status_code == 400
        assert told_nothing.json()["error"]["param"] == "x-kvgate-expected-output-tokens"
        huge = await harness.client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 5000})
        assert huge.status_code == 413
        assert huge.json()["error"]["code"] == "request_too_large"


async def test_a_told_output_length_replaces_the_learned_one() -> None:
    async with gateway_over_sim(SimConfig(engine=SLOW_ENGINE), output_min_samples=3) as harness:
        request = {**UNFORCED, "prompt": "x", "max_tokens": 100}
        for _ in range(3):  # answers run to their 100-token caps: learned
            assert (await harness.client.post("/v1/completions", json=request)).is_success
        learned = await harness.client.post("/v1/completions", json=request)
        assert learned.headers["x-kvgate-blocks"] == "4"  # 100 + prompt tokens
        # Told 5 tokens, it reserves one block; its answer outgrows that, completes and is
        # learned like any other.
        pending = asyncio.create_task(
            harness.client.post(
                "/v1/completions", json=request, headers={"x-kvgate-expected-output-tokens": "5"}
            )
        )
        await wait_until(lambda: harness.gateway.ledger.totals().entries == 1)
        [entry] = harness.gateway.ledger.entries()
        assert entry.demand.expected_output_tokens == 5
        [shown] = harness.gateway.describe()["backends"][0]["ledger"]["requests"]  # what /admin/state shows
        assert (shown["expected_output_tokens"], shown["expected_output_source"]) == (5, "client")
        told = await pending
        assert told.status_code == 200
        assert told.headers["x-kvgate-blocks"] == "1"
        assert told.json()["usage"]["completion_tokens"] == 100
        assert ledger_is_empty(harness.gateway)
        assert harness.gateway.output_model.describe()["tiny-llama/completions"]["samples"] == 5


async def test_the_openapi_document_lists_the_kvgate_headers(inproc: InProcess) -> None:
    document = (await inproc.client.get("/openapi.json")).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        parameters = {p["name"]: p for p in document["paths"][path]["post"]["parameters"]}
        assert {"x-kvgate-priority", "x-kvgate-deadline-ms", "x-kvgate-ttft-ms"} < set(parameters)
        told = parameters["x-kvgate-expected-output-tokens"]
        assert (told["in"], told["required"]) == ("header", False)
        assert told["schema"] == {"type": "integer", "minimum": 1, "maximum": 10_000_000}
        assert "max_tokens" in told["description"]


async def test_models_health_readiness_and_unserved_paths(inproc: InProcess) -> None:
    models = await inproc.client.get("/v1/models")
    assert models.status_code == 200
    assert models.json()["data"][0]["id"] == "tiny-llama"
    assert (await inproc.client.get("/healthz")).json() == {"status": "ok"}
    ready = await inproc.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["ready"] is True
    for method, path in (("POST", "/v1/embeddings"), ("GET", "/v1/files"), ("POST", "/v1/responses")):
        response = await inproc.client.request(method, path, json={})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "unsupported_endpoint"
        assert "/v1/chat/completions" in response.json()["error"]["message"]
    missing = await inproc.client.get("/nowhere")
    assert missing.status_code == 404
    assert "error" in missing.json()
    wrong_method = await inproc.client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert "error" in wrong_method.json()


async def test_metrics_and_admin_state(inproc: InProcess) -> None:
    await inproc.client.post("/v1/completions", json=COMPLETION)
    await inproc.client.post("/v1/completions", json={**COMPLETION, "max_tokens": 0})
    text = (await inproc.client.get("/metrics")).text
    assert 'kvgate_requests_total{backend="default",outcome="completed"} 1.0' in text
    assert 'kvgate_requests_total{backend="default",outcome="rejected_invalid"} 1.0' in text
    assert 'kvgate_admitted_total{backend="default",priority="normal"} 1.0' in text
    assert 'kvgate_kv_blocks_total{backend="default"} 63.0' in text
    assert 'kvgate_backend_up{backend="default"} 1.0' in text
    assert "vllm:" not in text
    state = (await inproc.client.get("/admin/state")).json()
    backend = state["backends"][0]
    assert backend["budget"]["total_blocks"] == 63
    assert backend["ledger"]["entries"] == 0
    assert backend["queue"]["depth"] == {"high": 0, "normal": 0, "low": 0}
    assert "tiny-llama/completions" in backend["output_model"]["keys"]


async def test_admin_token_is_required_when_set() -> None:
    async with gateway_over_sim(admin_token="hunter2") as harness:
        assert (await harness.client.get("/admin/state")).status_code == 401
        wrong = await harness.client.get("/admin/state", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await harness.client.get("/admin/state", headers={"authorization": "Bearer hunter2"})
        assert ok.status_code == 200
        assert ok.json()["settings"]["admin_token"] == "***"
        also_ok = await harness.client.get("/admin/state", headers={"x-kvgate-admin-token": "hunter2"})
        assert also_ok.status_code == 200


async def test_requests_wait_for_blocks_and_leave_the_ledger_balanced() -> None:
    # Each request needs 16 blocks at its cap (512 tokens): 3 fit in the 63-block pool at once
    # (no overcommit: that the budget may grow past the pool is the next test's subject).
    slow = SimConfig(engine=SLOW_ENGINE)
    async with gateway_over_sim(slow, budget_overcommit=0.0) as harness:
        body = {**COMPLETION, "prompt": "y", "max_tokens": 500}
        responses = await asyncio.gather(
            *(harness.client.post("/v1/completions", json=body) for _ in range(6))
        )
        assert [r.status_code for r in responses] == [200] * 6
        waits = sorted(int(r.headers["x-kvgate-queue-ms"]) for r in responses)
        assert waits[:3] == [0, 0, 0]
        assert waits[-1] > 0  # somebody waited in the gateway, not in vLLM
        state = harness.sim.runtime.state()
        assert state["num_preemptions_total"] == 0
        assert ledger_is_empty(harness.gateway)


@pytest.mark.parametrize("overcommit", [0.0, 0.5])
async def test_an_underused_pool_lets_more_in_than_the_reservations_say(overcommit: float) -> None:
    # Each request reserves 19 blocks (its cap, 600 tokens) but answers in 40 tokens and holds
    # 2: three fill the 63-block pool by reservation while vLLM uses a tenth of it. Once 20
    # have shown that, the share grows past the pool while requests wait (fast here: no quiet
    # time), with overcommit.
    engine = EngineConfig(step_cost=StepCost(base_s=0.005, per_token_s=0.0, per_seq_s=0.0))
    sim = SimConfig(engine=engine, output_len=SimOutputLength.parse("fixed:40"))
    async with gateway_over_sim(
        sim,
        budget_overcommit=overcommit,
        output_min_samples=1000,
        output_backend_prior=False,
    ) as harness:
        gateway = harness.gateway
        body = {**COMPLETION, "prompt": "y", "max_tokens": 600, "ignore_eos": False, "stream": True}
        shown = await asyncio.gather(*(harness.client.post("/v1/completions", json=body) for _ in range(20)))
        assert [r.status_code for r in shown] == [200] * 20
        assert gateway.budget.overstatement == pytest.approx(19 / 2 - 1)
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, gateway.ledger.totals().entries)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        responses = await asyncio.gather(
            *(harness.client.post("/v1/completions", json=body) for _ in range(8))
        )
        watcher.cancel()
        assert [r.status_code for r in responses] == [200] * 8
        snapshot = gateway.snapshot()
        if overcommit:
            # 4 x 19 = 76 blocks: 1.2 times the pool; never past what the overcommit allows.
            assert most >= 4
            assert 63 < snapshot.admissible_blocks <= int(63 * (1 + overcommit))
        else:
            assert most == 3
            assert snapshot.admissible_blocks == 63
        assert snapshot.pool_limit_blocks == 63
        assert harness.sim.runtime.state()["num_preemptions_total"] == 0
        assert ledger_is_empty(gateway)


async def test_a_queued_request_keeps_its_predicted_wait_for_the_metric_and_the_log() -> None:
    slow = SimConfig(engine=SLOW_ENGINE)
    # A reading must not go stale during the round: a waiter that arrives while the budget is
    # unknown is rightly given no prediction (a long collector pause in CI once did exactly that).
    async with gateway_over_sim(slow, metrics_stale_after_s=5.0) as harness:
        gateway = harness.gateway
        body = {**COMPLETION, "prompt": "y", "max_tokens": 500}  # 16 blocks: 3 at once
        # Until blocks have been seen to free up, nobody's wait can be predicted.
        rounds = 0
        while gateway.pace.capacity_rate(gateway.clock()) is None:
            rounds += 1
            assert rounds <= 5, "no drain rate after five rounds"
            await asyncio.gather(*(harness.client.post("/v1/completions", json=body) for _ in range(6)))
        responses = await asyncio.gather(
            *(harness.client.post("/v1/completions", json=body) for _ in range(6))
        )
        assert [r.status_code for r in responses] == [200] * 6
        queued = {r.headers["x-request-id"] for r in responses if int(r.headers["x-kvgate-queue-ms"]) > 0}
        assert queued
        summaries = {s.request_id: s for s in gateway.recent.latest()}
        for request_id in queued:
            predicted = summaries[request_id].fields()["predicted_queue_ms"]
            assert isinstance(predicted, int)
            assert predicted > 0
        text = (await harness.client.get("/metrics")).text
        count = f'kvgate_queue_wait_prediction_error_seconds_count{{backend="default"}} {float(len(queued))}'
        assert count in text
        assert ledger_is_empty(gateway)


async def test_queue_full_and_deadlines_shed_with_retry_hints() -> None:
    slow = SimConfig(engine=SLOW_ENGINE)
    async with gateway_over_sim(slow, priority_classes={"normal": {"queue_max": 1}}) as harness:
        hog = {**COMPLETION, "prompt": "z", "max_tokens": 900}  # 29 blocks each: two leave 5 free
        medium = {**COMPLETION, "max_tokens": 200}  # 7 blocks: has to wait
        hogs = [asyncio.create_task(harness.client.post("/v1/completions", json=hog)) for _ in range(2)]
        await wait_until(lambda: harness.gateway.ledger.totals().entries == 2, what="two admissions")
        # Sent while the queue has room, so that its deadline, not the queue's bound, sheds it.
        late = await harness.client.post(
            "/v1/completions",
            json=medium,
            headers={"x-kvgate-priority": "high", "x-kvgate-deadline-ms": "50"},
        )
        assert late.status_code == 429
        assert late.json()["error"]["code"] in {"deadline_expired", "deadline_unreachable"}
        queued = asyncio.create_task(harness.client.post("/v1/completions", json=medium))
        await wait_until(lambda: len(harness.gateway.queue) == 1, what="one queued")
        full = await harness.client.post("/v1/completions", json=medium)
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "queue_full"
        assert full.headers["x-should-retry"] == "true"
        assert int(full.headers["retry-after"]) >= 1
        assert float(full.headers["retry-after-ms"]) > 0
        small = await harness.client.post("/v1/completions", json=COMPLETION)
        assert small.status_code == 200  # fits in the 5 free blocks: a full queue does not stop it
        for task in [*hogs, queued]:
            assert (await task).status_code == 200
        text = (await harness.client.get("/metrics")).text
        assert 'outcome="shed_queue_full"} 1.0' in text
        assert ledger_is_empty(harness.gateway)
        assert harness.sim.runtime.state()["num_preemptions_total"] == 0


async def test_unknown_budget_answers_503_and_readyz_says_why() -> None:
    async with gateway_over_sim() as harness:
        harness.sim.runtime.set_faults(Faults(metrics_mode=MetricsMode.MISSING, metrics_status=500))
        await wait_until(lambda: not harness.gateway.snapshot().known, what="the budget to go stale")
        response = await harness.client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 503
        assert response.headers["x-should-retry"] == "true"
        assert "retry-after" in response.headers
        ready = await harness.client.get("/readyz")
        assert ready.status_code == 503
        assert "stale" in ready.json()["reason"]
        harness.sim.runtime.set_faults(Faults())
        await wait_until(lambda: harness.gateway.snapshot().known, what="the budget to come back")
        assert (await harness.client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_backend_errors_pass_through_and_release() -> None:
    async with gateway_over_sim() as harness:
        harness.sim.runtime.set_faults(Faults(error_rate=1.0, error_status=500))
        response = await harness.client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 500
        assert ledger_is_empty(harness.gateway)
        text = (await harness.client.get("/metrics")).text
        assert 'outcome="upstream_error"} 1.0' in text


async def test_hung_backend_times_out_with_504() -> None:
    async with gateway_over_sim(first_byte_timeout_s=0.2) as harness:
        harness.sim.runtime.set_faults(Faults(hang=True))
        response = await harness.client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert ledger_is_empty(harness.gateway)
