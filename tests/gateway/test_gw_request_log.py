"""Request ids and the request log: one line per request, JSON on demand, no secrets in it.

In process through httpx.ASGITransport in front of the emulator, plus `kvgate serve
--log-format json` as a real process, whose every output line must be a JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TEST_SETTINGS, bound_socket, gateway_over_sim, wait_until
from one_backend import OneBackend
from starlette.types import Message, Receive, Scope, Send

from estimator.kv import blocks_for_tokens
from estimator.tokens import TokenCounter
from gateway.app import create_app
from gateway.logs import (
    FIELDS_ATTRIBUTE,
    REQUEST_LOGGER,
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
)
from gateway.request_id import MAX_REQUEST_ID_CHARS, RequestIdMiddleware, choose_request_id, is_sane
from gateway.settings import Settings
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.server import create_sim_app
from sim.testing import running_sim

REPO = Path(__file__).resolve().parents[2]
SECRET_PROMPT = "the-violet-heron-sings-at-midnight"
CLIENT_KEY = "sk-client-0123456789abcdef"
BACKEND_KEY = "sk-backend-fedcba9876543210"
REQUEST_FIELDS = {
    "request_id",
    "backend",
    "route",
    "model",
    "priority",
    "stream",
    "outcome",
    "status",
    "code",
    "queue_ms",
    "predicted_queue_ms",
    "duration_ms",
    "estimated_blocks",
    "actual_blocks",
    "prompt_tokens",
    "completion_tokens",
}
BLOCK_SIZE = 32  # the emulator's default, as the testbed's


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": SECRET_PROMPT, "max_tokens": 8, "ignore_eos": True, **extra}


def request_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == REQUEST_LOGGER]


def as_json(record: logging.LogRecord) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(JsonFormatter().format(record))
    return parsed


@pytest.fixture
def caplog_info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    return caplog


# -- request ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offered", "kept"),
    [
        ("abc-123", True),
        ("trace:7f.2_x", True),
        ("a" * MAX_REQUEST_ID_CHARS, True),
        ("a" * (MAX_REQUEST_ID_CHARS + 1), False),
        ("", False),
        ("has space", False),
        ('quote"d', False),
        ("new\nline", False),
        ("émoji", False),
    ],
)
def test_a_sane_incoming_id_is_kept_and_anything_else_replaced(offered: str, kept: bool) -> None:
    assert is_sane(offered) is kept
    chosen = choose_request_id([(b"X-Request-Id", offered.encode("utf-8"))])
    if kept:
        assert chosen == offered
    else:
        assert chosen != offered
        assert is_sane(chosen)
        assert len(chosen) == 32


def test_a_missing_id_is_generated_fresh_each_time() -> None:
    ids = {choose_request_id([]) for _ in range(100)}
    assert len(ids) == 100
    assert all(is_sane(request_id) for request_id in ids)


async def test_every_response_carries_its_request_id() -> None:
    async with gateway_over_sim() as harness:
        client = harness.client
        ok = await client.post("/v1/completions", json=completion(), headers={"x-request-id": "mine-1"})
        assert ok.status_code == 200
        assert ok.headers["x-request-id"] == "mine-1"
        insane = await client.post("/v1/completions", json=completion(), headers={"x-request-id": "x" * 500})
        assert insane.headers["x-request-id"] != "x" * 500
        assert is_sane(insane.headers["x-request-id"])
        for response in [
            await client.get("/healthz"),
            await client.get("/v1/nope"),
            await client.post("/v1/completions", content=b"{not json"),
            await client.get("/dashboard"),
            await client.get("/metrics"),
        ]:
            assert is_sane(response.headers["x-request-id"]), response.url
            assert len(response.headers.get_list("x-request-id")) == 1


async def _asgi_with_its_own_id(scope: Scope, receive: Receive, send: Send) -> None:
    logging.getLogger("kvgate.test.inner").warning("inside the request")
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"x-request-id", b"from-upstream"), (b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_middleware_replaces_an_upstream_id_and_stamps_log_lines() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    inner = logging.getLogger("kvgate.test.inner")
    inner.addHandler(handler)
    try:
        transport = httpx.ASGITransport(RequestIdMiddleware(_asgi_with_its_own_id))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.get("/", headers={"x-request-id": "client-7"})
            generated = await client.get("/")
    finally:
        inner.removeHandler(handler)
    assert response.headers.get_list("x-request-id") == ["client-7"]
    assert generated.headers.get_list("x-request-id") != ["from-upstream"]
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == ["client-7", generated.headers["x-request-id"]]
    assert all(line["message"] == "inside the request" for line in lines)
    # Outside a request there is no id to stamp.
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "outside", None, None)
    RequestIdFilter().filter(record)
    assert "request_id" not in json.loads(JsonFormatter().format(record))


# -- the request line -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def recording_backend(sim_config: SimConfig | None = None) -> AsyncIterator[tuple[Any, list[Message]]]:
    """The emulator behind an ASGI layer that records the request headers it receives."""
    sim = create_sim_app(sim_config or SimConfig())
    seen: list[Message] = []

    async def recorder(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen.append({"path": scope["path"], "headers": dict(scope["headers"])})
        await sim(scope, receive, send)

    async with sim.run():
        yield recorder, seen


PRIORITY_TOKEN = "prio-7781-secret"


async def test_the_json_request_line_has_the_fields_and_no_secrets(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    async with (
        recording_backend() as (backend, seen),
        httpx.AsyncClient(transport=httpx.ASGITransport(backend)) as backend_client,
    ):
        settings = Settings(
            backend_url="http://sim",
            backend_api_key=BACKEND_KEY,
            admin_token="adm1n",
            priority_token=PRIORITY_TOKEN,
            **TEST_SETTINGS,
        )
        app = create_app(settings, http_client=backend_client, token_counter=TokenCounter.approximate())
        async with app.router.lifespan_context(app):
            gateway = OneBackend(app.state.kvgate)
            await wait_until(lambda: gateway.readiness()[0], 10, "ready")
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
                response = await client.post(
                    "/v1/completions",
                    json=completion(),
                    headers={
                        "authorization": f"Bearer {CLIENT_KEY}",
                        "x-kvgate-priority": "high",
                        "x-kvgate-priority-token": PRIORITY_TOKEN,
                    },
                )
                assert response.status_code == 200
                streamed = await client.post(
                    "/v1/completions", json=completion(stream=True), headers={"x-request-id": "s-1"}
                )
                assert streamed.status_code == 200
                await client.get("/admin/state", headers={"authorization": "Bearer adm1n"})

    request_id = response.headers["x-request-id"]
    # The same id went upstream, where vLLM logs under it.
    upstream = [entry for entry in seen if entry["path"] == "/v1/completions"]
    assert [entry["headers"][b"x-request-id"].decode() for entry in upstream] == [request_id, "s-1"]
    # The priority token stays at kvgate's edge, as every x-kvgate-* header does.
    assert all(b"x-kvgate-priority-token" not in entry["headers"] for entry in upstream)
    assert all(PRIORITY_TOKEN.encode() not in b"".join(entry["headers"].values()) for entry in upstream)

    records = request_lines(caplog_info)
    assert len(records) == 2  # one per generation request, none for /admin/state
    plain, stream = (as_json(record) for record in records)
    assert set(plain) >= REQUEST_FIELDS
    assert plain["request_id"] == request_id
    assert plain["logger"] == REQUEST_LOGGER
    assert plain["level"] == "info"
    assert plain["backend"] == "default"
    assert plain["route"] == "completions"
    assert plain["model"] == "tiny-llama"
    assert plain["priority"] == "high"
    assert plain["stream"] is False
    assert plain["outcome"] == "completed"
    assert plain["status"] == 200
    assert plain["queue_ms"] == int(response.headers["x-kvgate-queue-ms"])
    assert plain["predicted_queue_ms"] is None  # it did not have to queue
    assert plain["estimated_blocks"] == int(response.headers["x-kvgate-blocks"])
    assert plain["completion_tokens"] == response.json()["usage"]["completion_tokens"] == 8
    assert plain["prompt_tokens"] > 0
    assert plain["actual_blocks"] == blocks_for_tokens(plain["prompt_tokens"] + 8, BLOCK_SIZE)
    assert plain["duration_ms"] >= plain["queue_ms"]

    assert stream["request_id"] == "s-1"
    assert stream["stream"] is True
    assert stream["priority"] == "normal"
    assert stream["completion_tokens"] == 8  # counted on the stream (no usage asked for)
    assert stream["actual_blocks"] == plain["actual_blocks"]

    for record in records:
        for line in (JsonFormatter().format(record), TextFormatter().format(record)):
            for secret in (
                SECRET_PROMPT,
                "violet",
                CLIENT_KEY,
                BACKEND_KEY,
                "adm1n",
                "Bearer",
                PRIORITY_TOKEN,
            ):
                assert secret not in line


async def test_refused_and_shed_requests_are_logged_once_each(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    # A slow engine and no room to queue normal requests: with the pool full, more are shed.
    slow = SimConfig(engine=EngineConfig(step_cost=StepCost(base_s=0.002, per_token_s=0.0, per_seq_s=0.0)))
    async with gateway_over_sim(slow, priority_classes={"normal": {"queue_max": 0}}) as harness:
        client = harness.client
        invalid = await client.post("/v1/completions", json=completion(max_tokens=0))
        too_big = await client.post("/v1/completions", json=completion(max_tokens=900, n=8))
        long = completion(max_tokens=500)
        burst = await asyncio.gather(*(client.post("/v1/completions", json=long) for _ in range(6)))
        metrics = (await client.get("/metrics")).text

    statuses = sorted(r.status_code for r in burst)
    assert 429 in statuses
    assert 200 in statuses
    by_id = {as_json(record)["request_id"]: as_json(record) for record in request_lines(caplog_info)}
    assert len(by_id) == 2 + len(burst)

    # Each line says why, in the code the client's error carried.
    for refused in (invalid, too_big, *(r for r in burst if r.status_code != 200)):
        assert by_id[refused.headers["x-request-id"]]["code"] == refused.json()["error"]["code"]
    assert by_id[too_big.headers["x-request-id"]]["code"] == "kv_pool_exceeded"

    line = by_id[invalid.headers["x-request-id"]]
    assert (line["outcome"], line["status"], line["priority"]) == ("rejected_invalid", 400, None)
    assert line["prompt_tokens"] is None
    assert line["estimated_blocks"] is None

    line = by_id[too_big.headers["x-request-id"]]
    assert (line["outcome"], line["status"]) == ("rejected_invalid", too_big.status_code)
    assert line["estimated_blocks"] is not None
    assert line["actual_blocks"] is None

    for response in burst:
        line = by_id[response.headers["x-request-id"]]
        assert line["status"] == response.status_code
        expected = ("completed", None) if response.status_code == 200 else ("shed_queue_full", "queue_full")
        assert (line["outcome"], line["code"]) == expected
        assert line["estimated_blocks"] == int(response.headers["x-kvgate-blocks"])
        if response.status_code == 429:
            assert line["completion_tokens"] is None
            assert line["actual_blocks"] is None

    # The log, the recent list and the metric count each request once; the shed ones also by
    # the code of their error.
    outcomes = [line["outcome"] for line in by_id.values()]
    for outcome in ("completed", "shed_queue_full", "rejected_invalid"):
        count = outcomes.count(outcome)
        assert f'kvgate_requests_total{{backend="default",outcome="{outcome}"}} {float(count)}' in metrics
    shed = outcomes.count("shed_queue_full")
    assert f'kvgate_shed_total{{backend="default",code="queue_full"}} {float(shed)}' in metrics
    # Nothing else was shed, nor counted as shed: every other code is still at its 0.
    other_codes = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvgate_shed_total{") and "queue_full" not in line
    ]
    assert other_codes
    assert all(line.endswith(" 0.0") for line in other_codes), other_codes


def test_the_text_line_reads_as_key_values() -> None:
    record = logging.LogRecord(REQUEST_LOGGER, logging.INFO, __file__, 1, "request", None, None)
    record.request_id = "abc"
    setattr(record, FIELDS_ATTRIBUTE, {"outcome": "completed", "status": 200, "priority": None})
    line = TextFormatter().format(record)
    assert line.endswith(" INFO kvgate.requests [abc]: request outcome=completed status=200")


# -- kvgate serve --log-format json ------------------------------------------------------------


@contextlib.contextmanager
def kvgate_serve(backend: str, *args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVGATE_")}
    command = [sys.executable, "-m", "gateway.cli", "serve", "--backend", backend, "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--set", "metrics_poll_interval_s=0.05", *args],
        cwd=REPO,
        env={**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "kvgate serve exited early"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "kvgate serve did not become ready"
            time.sleep(0.05)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_kvgate_serve_writes_only_json_lines() -> None:
    with running_sim(SimConfig()) as backend, kvgate_serve(backend, "--log-format", "json") as (url, process):
        body = completion()
        response = httpx.post(
            f"{url}/v1/completions",
            json=body,
            headers={"x-request-id": "proc-42", "authorization": f"Bearer {CLIENT_KEY}"},
            timeout=10,
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "proc-42"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert process.stdout is not None
        output = process.stdout.read().decode()
        process.stdout.close()

    lines = [json.loads(line) for line in output.splitlines() if line.strip()]
    assert {"ts", "level", "logger", "message"} <= set(lines[0])
    loggers = {line["logger"] for line in lines}
    assert "uvicorn.error" in loggers  # uvicorn's own lines are JSON too
    requests = [line for line in lines if line["logger"] == REQUEST_LOGGER]
    assert len(requests) == 1
    assert requests[0]["request_id"] == "proc-42"
    assert requests[0]["status"] == 200
    assert requests[0]["outcome"] == "completed"
    assert SECRET_PROMPT not in output
    assert CLIENT_KEY not in output
