"""The testbed's length-forcing logits processor, on the real vLLM (tests/testbed/bench_lengths.py).

A request carrying `vllm_xargs.kvgate_bench_output_tokens` = N gets exactly N completion
tokens, the last one EOS, whatever the route, streaming or not, for every choice of `n` > 1;
requests without the field, served in the same batches, run as before (the random model never
samples EOS, so they end at `max_tokens`). Needs an engine started by tests/testbed/testbed.py
from this checkout: one started without the processor fails the first test with a clear message.
"""

from __future__ import annotations

import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import counting
from bench.payload import OUTPUT_TOKENS_FIELD

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
TIMEOUT_S = 180.0


@dataclass(frozen=True, slots=True)
class Answer:
    """Per choice: the generated token ids and the finish reason; the usage's total."""

    token_ids: dict[int, list[int]]
    finish: dict[int, str | None]
    completion_tokens: int


def post(url: str, route: str, body: dict[str, Any]) -> Answer:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    payload: dict[str, Any] = {"model": MODEL, "return_token_ids": True, **body}
    if route == "chat":
        payload["messages"] = [{"role": "user", "content": "Tell me about the KV cache"}]
    else:
        payload["prompt"] = "Tell me about the KV cache"
    ids: dict[int, list[int]] = defaultdict(list)
    finish: dict[int, str | None] = {}
    if not payload.get("stream"):
        response = httpx.post(f"{url}{path}", json=payload, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        data = response.json()
        for choice in data["choices"]:
            ids[choice["index"]] = list(choice["token_ids"])
            finish[choice["index"]] = choice["finish_reason"]
        return Answer(dict(ids), finish, data["usage"]["completion_tokens"])
    payload["stream_options"] = {"include_usage": True}
    usage = -1
    with httpx.stream("POST", f"{url}{path}", json=payload, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                ids[choice["index"]].extend(choice.get("token_ids") or [])
                if choice.get("finish_reason") is not None:
                    finish[choice["index"]] = choice["finish_reason"]
    return Answer(dict(ids), finish, usage)


@pytest.fixture(scope="module")
def forcing_url(vllm_url: str) -> str:
    """The testbed, checked to load the processor: only the processor refuses a bad length."""
    probe = {"model": MODEL, "prompt": "x", "max_tokens": 2, "vllm_xargs": {OUTPUT_TOKENS_FIELD: 0}}
    response = httpx.post(f"{vllm_url}/v1/completions", json=probe, timeout=TIMEOUT_S)
    if response.status_code != 400:
        pytest.fail(
            f"the vLLM at {vllm_url} does not load the bench's logits processor (answered "
            f"{response.status_code} to a forced length of 0): restart it with tests/testbed/testbed.py"
        )
    assert OUTPUT_TOKENS_FIELD in response.json()["error"]["message"]
    return vllm_url


@pytest.fixture(scope="module")
def eos(tiny_model_dir: Path) -> int:
    value = counting.eos_token_id(tiny_model_dir)
    assert value is not None
    return value


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_request_gets_exactly_its_length(
    forcing_url: str, eos: int, route: str, stream: bool
) -> None:
    lengths = (1, 2, 17, 90)
    bodies = [
        {"max_tokens": 300, "n": 2, "stream": stream, "vllm_xargs": {OUTPUT_TOKENS_FIELD: n}} for n in lengths
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:  # in one batch: rows must not mix
        answers = list(pool.map(lambda body: post(forcing_url, route, body), bodies))
    for n, answer in zip(lengths, answers, strict=True):
        assert sorted(answer.token_ids) == [0, 1]
        for index, ids in answer.token_ids.items():
            assert len(ids) == n, (n, index)
            assert ids[-1] == eos
            assert eos not in ids[:-1]
            assert answer.finish[index] == "stop"
        assert answer.completion_tokens == 2 * n


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_requests_without_the_field_are_untouched(forcing_url: str, eos: int, route: str) -> None:
    # Served in the same batches as forced requests; the random model then never samples EOS
    # within 40 tokens, so they end at max_tokens, as on an engine without the processor.
    plain = [
        {"max_tokens": 40, "stream": True},
        {"max_tokens": 40},
        {"max_tokens": 40, "n": 2, "vllm_xargs": {"some_other_key": 3}},
    ]
    forced = [{"max_tokens": 300, "stream": True, "vllm_xargs": {OUTPUT_TOKENS_FIELD: 3}}] * 3
    with ThreadPoolExecutor(len(plain) + len(forced)) as pool:
        answers = list(pool.map(lambda body: post(forcing_url, route, body), plain + forced))
    for answer in answers[: len(plain)]:
        for index, ids in answer.token_ids.items():
            assert len(ids) == 40, index
            assert answer.finish[index] == "length"
    for answer in answers[len(plain) :]:
        assert [len(ids) for ids in answer.token_ids.values()] == [3]
        assert answer.token_ids[0][-1] == eos


def test_max_tokens_still_ends_a_forced_request_first(forcing_url: str) -> None:
    answer = post(forcing_url, "completions", {"max_tokens": 5, "vllm_xargs": {OUTPUT_TOKENS_FIELD: 50}})
    assert [len(ids) for ids in answer.token_ids.values()] == [5]
    assert answer.finish == {0: "length"}


# (vLLM's request model reads JSON true as the integer 1 before the processor sees it.)
@pytest.mark.parametrize("value", [0, -3, "12", 2.5, False])
def test_a_bad_length_is_a_400(forcing_url: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "vllm_xargs": {OUTPUT_TOKENS_FIELD: value}}
    response = httpx.post(f"{forcing_url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 400
    assert OUTPUT_TOKENS_FIELD in response.json()["error"]["message"]
