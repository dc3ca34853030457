"""The runner against an in-process fake server: streams, refusals, deadlines, metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from bench.instant import InstantBackend, serving
from bench.payload import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    TENANT_HEADER,
    TTFT_HEADER,
    PayloadOptions,
    plan_requests,
)
from bench.report import Outcome, classify, summarize
from bench.runner import (
    ChunkInfo,
    RunOptions,
    read_chunk,
    retry_after_seconds,
    run_target,
    wait_idle,
)
from bench.workload import RequestSpec


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (
            {"choices": [{"index": 0, "text": " a", "token_ids": [5, 6], "finish_reason": None}]},
            ChunkInfo(tokens=2),
        ),
        ({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}, ChunkInfo(tokens=1)),
        # vLLM's EOS chunk: empty text, the finish reason, and (when asked) the EOS id
        (
            {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
            ChunkInfo(tokens=1, finish_reason="stop"),
        ),
        (
            {"choices": [{"index": 0, "text": "", "token_ids": [2], "finish_reason": "stop"}]},
            ChunkInfo(tokens=1, finish_reason="stop"),
        ),
        # chat opens with a role-only delta that carries no token
        ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, ChunkInfo(tokens=0)),
        ({"choices": [{"index": 0, "delta": {"content": "hi"}}]}, ChunkInfo(tokens=1)),
        (
            {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}},
            ChunkInfo(usage_completion_tokens=9, usage_prompt_tokens=7),
        ),
        ({"error": {"message": "engine died"}}, ChunkInfo(error="engine died")),
    ],
)
def test_read_chunk(payload: dict[str, Any], expected: ChunkInfo) -> None:
    assert read_chunk(payload) == expected


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after": "2", "retry-after-ms": "1500"}, 1.5),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
    ],
)
def test_retry_after_seconds(headers: dict[str, str], expected: float | None) -> None:
    assert retry_after_seconds(headers) == expected


@pytest.fixture
async def fake() -> AsyncIterator[tuple[InstantBackend, str]]:
    app = InstantBackend(token_interval_s=0.002)
    async with serving(app) as url:
        yield app, url


def _plan(specs: list[RequestSpec], **options: Any) -> Any:
    opts = PayloadOptions(model="instant", eos_token_id=2, max_tokens_cap=64, **options)
    return plan_requests(specs, ["one two three"] * len(specs), opts)


async def test_streams_are_counted_and_headers_sent(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    specs = [
        RequestSpec(0.00, 3, 5, tenant="a", priority="high"),
        RequestSpec(0.01, 3, 1, tenant="b"),
        RequestSpec(0.02, 3, 12),
    ]
    plan = _plan(specs, deadline_s=30.0, ttft_slo_s=2.0, headers=(("X-Extra", "yes"),))
    result = await run_target(url, plan, RunOptions(deadline_s=30.0, metrics_urls=(f"{url}/metrics",)))
    assert [r.output_tokens for r in result.records] == [5, 1, 12]
    assert [r.streamed_tokens for r in result.records] == [5, 1, 12]
    assert [r.usage_completion_tokens for r in result.records] == [5, 1, 12]
    assert all(classify(r, 30.0) is Outcome.OK for r in result.records)
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s for r in result.records)  # type: ignore[operator]
    assert len(result.records[2].gaps_s) == 11
    assert [r.tenant for r in result.records] == ["a", "b", None]
    first, second, third = app.headers_seen
    assert (first[TENANT_HEADER.lower()], first[PRIORITY_HEADER.lower()]) == ("a", "high")
    assert PRIORITY_HEADER.lower() not in second
    assert TENANT_HEADER.lower() not in third
    assert all(h[DEADLINE_HEADER.lower()] == "30000" for h in app.headers_seen)
    assert all(h[TTFT_HEADER.lower()] == "2000" for h in app.headers_seen)
    assert all(h["x-extra"] == "yes" for h in app.headers_seen)
    # the fake's generated-token counter moved by exactly what the client counted
    summary = summarize(result, offered_s=1.0, deadline_s=30.0)
    assert result.vllm_sources == (f"{url}/metrics",)
    assert summary.backend_generation_tokens == 18 == summary.client_output_tokens
    assert summary.backend_tokens_wasted == 0


async def test_refusals_are_shed_with_their_retry_after(fake: tuple[InstantBackend, str]) -> None:
    _, url = fake
    for status, outcome in ((429, Outcome.SHED), (503, Outcome.SHED), (500, Outcome.ERROR)):
        plan = _plan([RequestSpec(0.0, 3, 4)], headers=(("X-Fake-Status", str(status)),))
        (record,) = (await run_target(url, plan, RunOptions())).records
        assert record.status == status
        assert classify(record, None) is outcome
        assert record.retry_after_s == (1.0 if status in (429, 503) else None)
        assert record.retry_after_header == ("1" if status in (429, 503) else None)
        assert record.retry_after_ms_header == ("1000" if status in (429, 503) else None)
        assert record.error is not None
        assert "fake refusal" in record.error


async def test_the_client_gives_up_at_its_deadline(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    plan = _plan([RequestSpec(0.0, 3, 50)], headers=(("X-Fake-Token-Interval-Ms", "50"),))
    (record,) = (await run_target(url, plan, RunOptions(deadline_s=0.3))).records
    assert record.gave_up
    assert not record.finished
    assert classify(record, 0.3) is Outcome.LATE
    assert record.e2e_s == pytest.approx(0.3, abs=0.1)
    assert 0 < record.streamed_tokens < 50
    # the connection was closed, so the server stopped generating (as vLLM aborts)
    async with httpx.AsyncClient() as client:
        readings = await wait_idle(client, [f"{url}/metrics"], timeout_s=5.0)
    assert readings[f"{url}/metrics"].running == 0
    assert app.generated_tokens < 50


async def test_requests_start_on_schedule(fake: tuple[InstantBackend, str]) -> None:
    _, url = fake
    specs = [RequestSpec(0.02 * i, 3, 2) for i in range(20)]
    result = await run_target(url, _plan(specs), RunOptions())
    assert [r.scheduled_s for r in result.records] == pytest.approx([s.arrival_s for s in specs])
    # generous: the machine is shared; the self-check measures the real figure
    assert max(r.start_lag_s for r in result.records) < 0.05
    assert result.duration_s >= specs[-1].arrival_s


async def test_wait_idle_polls_until_the_engine_is_idle(fake: tuple[InstantBackend, str]) -> None:
    app, url = fake
    app.running = 2
    ticks = iter(range(100))

    async with httpx.AsyncClient() as client:
        readings = await wait_idle(
            client, [f"{url}/metrics"], timeout_s=0.0, clock=lambda: float(next(ticks))
        )
        assert readings[f"{url}/metrics"].running == 2  # gave up at once: timeout 0
        app.running = 0
        readings = await wait_idle(client, [f"{url}/metrics"], timeout_s=1e9)
        assert readings[f"{url}/metrics"].busy == 0


async def test_in_process_transport_and_bad_streams() -> None:
    """The same code path over httpx.ASGITransport, and what broken streams become."""

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        kind = scope["path"].rsplit("/", 1)[-1]
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        body = {
            "completions": b'data: {"choices":[{"text":"x","finish_reason":null}]}\n\n',
            "garbage": b"data: {not json\n\n",
        }.get(kind, b"")
        await send({"type": "http.response.body", "body": body})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=broken)) as client:
        plan = _plan([RequestSpec(0.0, 3, 4)])
        (record,) = (await run_target("http://fake", plan, RunOptions(), clients=[client])).records
        assert record.status == 200
        assert not record.finished
        assert record.error == "stream ended without [DONE]"
        assert record.streamed_tokens == 1
        garbage = [replace_path(p, "/v1/garbage") for p in plan]
        (record,) = (await run_target("http://fake", garbage, RunOptions(), clients=[client])).records
        assert record.error is not None
        assert record.error.startswith("bad chunk")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=InstantBackend())) as client:
        plan = _plan([RequestSpec(0.0, 3, 6)])
        (record,) = (await run_target("http://fake", plan, RunOptions(), clients=[client])).records
        assert record.finished
        assert record.output_tokens == 6
        assert record.error is None


def replace_path(planned: Any, path: str) -> Any:
    from dataclasses import replace

    return replace(planned, path=path)


async def test_unreachable_target_is_an_error_not_a_crash() -> None:
    plan = _plan([RequestSpec(0.0, 3, 2)])
    (record,) = (await run_target("http://127.0.0.1:9", plan, RunOptions())).records
    assert record.status is None
    assert record.error is not None
    assert classify(record, None) is Outcome.ERROR
