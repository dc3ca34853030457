"""A request's body is freed when its answer is sent, by reference counting alone: no
reference cycle (an error kept in a frame of its own traceback, say) holds the body until the
cyclic garbage collector runs. That collector is paused while large bodies are parsed
(gateway.json_body), so under a stream of large bodies, bodies held by cycles pile up."""

from __future__ import annotations

import gc
import json
import types
from typing import Any

import pytest
from conftest import gateway_over_sim

COMPLETION = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}
MARKER = "kvgate-cycle-marker"
LONG_PROMPT = MARKER + " a" * 200_000  # past the inline parse size, and past any context


def holds_marker(value: Any) -> bool:
    if isinstance(value, (bytes, bytearray)):
        return MARKER.encode() in value
    if isinstance(value, str):
        return MARKER in value
    if isinstance(value, dict):
        return any(isinstance(v, str) and MARKER in v for v in value.values())
    return False


def garbage_holding_the_body() -> list[str]:
    """What the collector finds unreachable that holds a body with the marker: frames (by
    name) and containers."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = []
        for item in gc.garbage:
            if isinstance(item, types.FrameType):
                if any(holds_marker(v) for v in item.f_locals.values()):
                    found.append(f"frame {item.f_code.co_name}")
            elif isinstance(item, (dict, list, tuple)) and any(
                holds_marker(v) for v in (item.values() if isinstance(item, dict) else item)
            ):
                found.append(type(item).__name__)
        return found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize(
    ("body", "statuses"),
    [
        pytest.param(
            {"model": "tiny-llama", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 4},
            {400},
            id="chat-beyond-the-context",
        ),
        pytest.param({**COMPLETION, "prompt": LONG_PROMPT}, {400}, id="prompt-beyond-the-context"),
        pytest.param(
            {**COMPLETION, "prompt": MARKER, "max_tokens": 10**6}, {400}, id="output-beyond-the-pool"
        ),
        pytest.param({**COMPLETION, "prompt": MARKER, "max_tokens": "many"}, {400}, id="invalid-field"),
        pytest.param({**COMPLETION, "prompt": MARKER, "model": "no-such-model"}, {404}, id="unknown-model"),
        pytest.param({**COMPLETION, "prompt": MARKER, "user": "u" * 100_000}, {200}, id="served"),
    ],
)
async def test_no_answer_leaves_a_cycle_holding_the_request_body(
    body: dict[str, Any], statuses: set[int]
) -> None:
    async with gateway_over_sim() as harness:
        gc.collect()
        gc.disable()
        try:
            answer = await harness.client.post(
                "/v1/chat/completions" if "messages" in body else "/v1/completions",
                content=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            assert answer.status_code in statuses, answer.text
            del answer
            assert garbage_holding_the_body() == []
        finally:
            gc.enable()
