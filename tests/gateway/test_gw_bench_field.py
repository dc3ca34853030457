"""kvgate's demand does not depend on the bench's private length field, and the field reaches
the backend unchanged.

The bench forces output lengths with `vllm_xargs.kvgate_bench_output_tokens` (the testbed's
logits processor and the emulator honour it). If kvgate read it, the bench would tell it each
answer. Two gateways run in lockstep, each in front of its own emulator: the first gets bodies
carrying the field; the second gets the same bodies without it, and an ASGI layer between it and
its emulator adds the very same field, so both emulators give the same answers and both
gateways learn the same output lengths. Every request then gets the same reservation
(`X-Kvgate-Blocks`), status and request-log decision through both, over a sequence of different
field values, routes and a refusal; the answers' lengths on the first show the field arrived.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import FAST_ENGINE, READY_TIMEOUT_S, TEST_SETTINGS, wait_until
from one_backend import OneBackend

from bench.payload import OUTPUT_TOKENS_FIELD
from estimator.tokens import TokenCounter
from gateway.app import create_app
from gateway.logs import REQUEST_LOGGER, JsonFormatter
from gateway.settings import Settings
from sim.config import SimConfig
from sim.server import create_sim_app

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Learn from the third answer on, so that the sequence runs with a learned output model.
SETTINGS: dict[str, Any] = {**TEST_SETTINGS, "output_min_samples": 3}


@dataclass
class FieldLayer:
    """ASGI layer before an emulator: records each generation body it receives and, when given
    a value for that request, adds the private field to the body first."""

    app: Any
    inject: list[int | None] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = json.loads(b"".join(chunks))
        value = self.inject.pop(0) if self.inject else None
        if value is not None:
            body["vllm_xargs"] = {**body.get("vllm_xargs", {}), OUTPUT_TOKENS_FIELD: value}
        self.received.append(body)
        raw = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": headers}, replay, send)


@contextlib.asynccontextmanager
async def gateway_over(layer: FieldLayer) -> AsyncIterator[tuple[httpx.AsyncClient, OneBackend]]:
    sim = layer.app
    async with sim.run(), httpx.AsyncClient(transport=httpx.ASGITransport(layer)) as backend:
        app = create_app(
            Settings(backend_url="http://sim", **SETTINGS),
            http_client=backend,
            token_counter=TokenCounter.approximate(),
        )
        async with app.router.lifespan_context(app):
            gateway = OneBackend(app.state.kvgate)
            await wait_until(lambda: gateway.readiness()[0], READY_TIMEOUT_S, "the gateway to be ready")
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvgate") as client:
                yield client, gateway


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": "tell me about the KV cache", "max_tokens": 300, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300,
        **extra,
    }


# (path, body without the field, forced length or None). The lengths vary from far below the
# learned quantile to far above it; the last request cannot fit the pool (8 x 300 tokens), and a
# gateway that believed its field (8 x 2 tokens) would admit it.
SEQUENCE: list[tuple[str, dict[str, Any], int | None]] = [
    ("/v1/completions", completion(), 20),
    ("/v1/completions", completion(), 20),
    ("/v1/completions", completion(), 20),
    ("/v1/completions", completion(), 1),
    ("/v1/completions", completion(stream=True), 250),
    ("/v1/completions", completion(), None),
    ("/v1/completions", completion(max_tokens=40), 7),
    ("/v1/chat/completions", chat(), 5),
    ("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True}), 5),
    ("/v1/chat/completions", chat(), 120),
    ("/v1/chat/completions", chat(), 3),
    ("/v1/completions", completion(), 2),
    ("/v1/completions", completion(n=8, max_tokens=300, prompt="x " * 600), 2),
]


def completion_tokens(response: httpx.Response) -> int | None:
    if not response.is_success:
        return None
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        usage = [json.loads(e)["usage"] for e in events if e != "[DONE]" and json.loads(e).get("usage")]
        if usage:
            return int(usage[-1]["completion_tokens"])
        return sum(1 for e in events if e != "[DONE]" and json.loads(e)["choices"])
    return int(response.json()["usage"]["completion_tokens"])


def decisions(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    keys = ("status", "code", "outcome", "estimated_blocks", "predicted_queue_ms", "completion_tokens")
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == REQUEST_LOGGER]
    return [{key: line.get(key) for key in keys} for line in lines]


async def test_the_private_length_field_changes_no_reservation_and_reaches_the_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    told = FieldLayer(create_sim_app(SimConfig(engine=FAST_ENGINE)))
    hidden = FieldLayer(create_sim_app(SimConfig(engine=FAST_ENGINE)), inject=[v for _, _, v in SEQUENCE])
    seen: dict[str, list[tuple[int, str | None, int | None]]] = {"told": [], "hidden": []}
    logs: dict[str, list[dict[str, Any]]] = {}
    for name, layer in (("told", told), ("hidden", hidden)):
        caplog.clear()
        async with gateway_over(layer) as (client, gateway):
            for path, body, value in SEQUENCE:
                sent = (
                    body
                    if name == "hidden" or value is None
                    else {**body, "vllm_xargs": {OUTPUT_TOKENS_FIELD: value}}
                )
                response = await client.post(path, json=sent, timeout=60)
                seen[name].append(
                    (
                        response.status_code,
                        response.headers.get("x-kvgate-blocks"),
                        completion_tokens(response),
                    )
                )
            assert gateway.ledger.totals().entries == 0
        logs[name] = decisions(caplog)

    # Same reservation, status and answer length for every request, with the field or without.
    assert seen["told"] == seen["hidden"]
    assert logs["told"] == logs["hidden"]
    assert len(logs["told"]) == len(SEQUENCE)
    # The learned model did shape the reservations (they are not all the cold cap) ...
    reserved = {blocks for status, blocks, _ in seen["told"] if status == 200}
    assert len(reserved) > 1
    # ... and the request the field would have let in was refused by both.
    assert seen["told"][-1][0] >= 400
    # The field reached the emulator unchanged, and its answers have the forced lengths.
    for (path, body, value), (status, _, tokens) in zip(SEQUENCE, seen["told"], strict=True):
        if status == 200 and value is not None:
            assert tokens == min(value, body["max_tokens"]) * body.get("n", 1), (path, value)
    assert len(told.received) == len(SEQUENCE) - 1  # all but the refused one
    assert [b.get("vllm_xargs") for b in told.received] == [
        None if v is None else {OUTPUT_TOKENS_FIELD: v} for _, _, v in SEQUENCE[:-1]
    ]
