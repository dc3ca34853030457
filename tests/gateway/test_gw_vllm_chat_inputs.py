"""Chat inputs kvgate used to count as nothing, through kvgate and straight to the real testbed.

Media parts on the text-only tiny model are refused by kvgate itself (its own message, before the
queue) with the status vLLM gives them; template kwargs that change the prompt are reserved for.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Served, ledger_is_empty, served_gateway

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
BLOCK_SIZE = 32
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
MEDIA_PARTS = [
    {"type": "image_url", "image_url": {"url": PNG}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"type": "image_pil", "image_pil": "AAAA"},
    {"type": "prompt_embeds", "data": "AAAA"},
    {"type": "file", "file": {"file_data": "AAAA"}},
    {"type": "banana"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def kvgate(vllm_url: str) -> Iterator[Served]:
    with served_gateway(vllm_url, discover_tokenizer=True, metrics_poll_interval_s=0.1) as served:
        yield served


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **body}, timeout=60
    )


@pytest.mark.parametrize("part", MEDIA_PARTS, ids=[part["type"] for part in MEDIA_PARTS])
def test_media_parts_get_vllms_status_from_kvgate_itself(kvgate: Served, vllm_url: str, part: Any) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]}
    direct = _post(vllm_url, body)
    relayed = _post(kvgate.url, body)
    assert relayed.status_code == direct.status_code == 400, (direct.text, relayed.text)
    error = relayed.json()["error"]
    # kvgate's own answer, not vLLM's relayed: the request never reached the queue or vLLM.
    assert error["message"] != direct.json()["error"]["message"]
    assert error["param"].startswith("messages[0].content[1]")
    assert error["type"] == "invalid_request_error"
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": [WEATHER_TOOL]}},
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"documents": [{"title": "T", "text": "a long document " * 20}]},
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "thinking", "thinking": "hm " * 40}],
                }
            ]
        },
    ],
    ids=["tools in kwargs", "documents in kwargs", "thinking part"],
)
def test_prompts_grown_by_kwargs_or_parts_are_reserved_for(kvgate: Served, body: dict[str, Any]) -> None:
    response = _post(kvgate.url, body)
    assert response.status_code == 200, response.text
    prompt = response.json()["usage"]["prompt_tokens"]
    assert prompt > 40  # each of these bodies grows a 15-token prompt well past one block
    # max_tokens 1: the reservation is the prompt's blocks, with or without its one output token.
    blocks = int(response.headers["x-kvgate-blocks"])
    assert blocks in (math.ceil(prompt / BLOCK_SIZE), math.ceil((prompt + 1) / BLOCK_SIZE))
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")
