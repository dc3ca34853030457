"""X-Kvgate-Expected-Output-Tokens in front of the real vLLM testbed (blocks of 32 tokens).

A client that tells the output length it expects reserves that instead of kvgate's learned
length, within its body's floor and cap; an answer that outgrows it grows its reservation as it
streams and completes as vLLM sends it; a malformed value is refused before anything reaches
vLLM. The bench's private field (`vllm_xargs`, see tests/testbed/bench_lengths.py) forces the
answers' lengths so that they are known to the test, not to kvgate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Served, ledger_is_empty, served_gateway
from one_backend import OneBackend

from bench.payload import OUTPUT_TOKENS_FIELD
from gateway.output_model import OutputKey
from gateway.sse import StreamTally

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
BLOCK_SIZE = 32
HEADER = "x-kvgate-expected-output-tokens"
PROMPT = "Once upon a time, in a land far away, there lived a"
COMPLETIONS = OutputKey(MODEL, "completions")


@pytest.fixture(scope="module")
def kvgate(vllm_url: str) -> Iterator[Served]:
    # Learn from the second answer on; no prior from vLLM's histogram (other users' answers).
    # The queue waits long: a wait predicted from a cold pace on a loaded machine must not shed.
    with served_gateway(
        vllm_url,
        discover_tokenizer=True,
        metrics_poll_interval_s=0.1,
        output_backend_prior=False,
        output_min_samples=2,
        priority_classes={"normal": {"queue_timeout_s": 300.0}},
    ) as served:
        yield served


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_SIZE)


def learned_samples(gateway: OneBackend) -> int:
    """Answers the completions key has learned (call on the gateway's loop)."""
    count: int = gateway.output_model.describe().get(f"{MODEL}/completions", {}).get("samples", 0)
    return count


def samples(kvgate: Served) -> int:
    return int(kvgate.call(lambda: learned_samples(kvgate.gateway)))


def complete(
    kvgate: Served, body: dict[str, Any], told: str | None, path: str = "completions"
) -> httpx.Response:
    headers = {HEADER: told} if told is not None else {}
    response = httpx.post(
        f"{kvgate.url}/v1/{path}", json={"model": MODEL, **body}, headers=headers, timeout=120
    )
    assert response.status_code == 200, response.text
    return response


def reserved(response: httpx.Response) -> tuple[int, int]:
    """(blocks kvgate reserved at admission, prompt tokens by vLLM's count) of an answer."""
    return int(response.headers["x-kvgate-blocks"]), response.json()["usage"]["prompt_tokens"]


def test_a_told_length_is_reserved_instead_of_the_learned_one(kvgate: Served) -> None:
    # Teach the model answers of 96 tokens (more than two blocks).
    before = samples(kvgate)
    for _ in range(2):
        complete(kvgate, {"prompt": PROMPT, "max_tokens": 96, "ignore_eos": True}, None)
    kvgate.wait_until(lambda gw: learned_samples(gw) >= before + 2, what="the answers to be learned")
    learned = kvgate.call(lambda: kvgate.gateway.output_model.predict(COMPLETIONS, 300))
    assert learned.source == "learned"
    assert learned.tokens >= 96
    short = {"prompt": PROMPT, "max_tokens": 300, "vllm_xargs": {OUTPUT_TOKENS_FIELD: 1}}

    # Not told: the learned length.
    got, prompt = reserved(complete(kvgate, short, None))
    assert got == blocks(prompt + learned.tokens)
    # Told 8: 8, far below what was learned.
    told, prompt = reserved(complete(kvgate, short, "8"))
    assert told == blocks(prompt + 8) < got
    # Told more than max_tokens allows: max_tokens.
    capped, prompt = reserved(complete(kvgate, {**short, "max_tokens": 100}, "500"))
    assert capped == blocks(prompt + 100)
    # Told less than vLLM is bound to produce: what it is bound to (min_tokens; with ignore_eos
    # the cap).
    floored, prompt = reserved(complete(kvgate, {"prompt": PROMPT, "max_tokens": 64, "min_tokens": 48}, "8"))
    assert floored == blocks(prompt + 48)
    floored, prompt = reserved(
        complete(kvgate, {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}, "8")
    )
    assert floored == blocks(prompt + 64)
    # Chat reads it the same way.
    chat = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 300,
        "vllm_xargs": short["vllm_xargs"],
    }
    told, prompt = reserved(complete(kvgate, chat, "8", path="chat/completions"))
    assert told == blocks(prompt + 8)
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def admin_entries(kvgate: Served) -> list[dict[str, Any]]:
    state = httpx.get(f"{kvgate.url}/admin/state", timeout=10).json()
    entries: list[dict[str, Any]] = state["backends"][0]["ledger"]["requests"]
    return entries


def exceeded_total(kvgate: Served) -> float:
    text = httpx.get(f"{kvgate.url}/metrics", timeout=10).text
    prefix = "kvgate_output_reservation_exceeded_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_a_streamed_answer_longer_than_told_grows_its_reservation_and_completes(kvgate: Served) -> None:
    # Told 8 tokens, the answer runs to 200: its reservation follows its tokens as they
    # stream, it completes as vLLM sends it, and its length is learned.
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 300,
        "stream": True,
        "stream_options": {"include_usage": True},
        "vllm_xargs": {OUTPUT_TOKENS_FIELD: 200},
    }
    learned_before, exceeded_before = samples(kvgate), exceeded_total(kvgate)
    tally = StreamTally()
    relayed = bytearray()
    grown: dict[str, Any] | None = None
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{kvgate.url}/v1/completions", json=body, headers={HEADER: "8"}) as response,
    ):
        assert response.status_code == 200
        admitted_blocks = int(response.headers["x-kvgate-blocks"])
        for chunk in response.iter_raw():
            tally.feed(chunk)
            relayed += chunk
            received = tally.tokens_by_choice.get(0, 0)
            if grown is None and received >= 100:
                # kvgate counts a chunk before relaying it: the ledger has seen at least this.
                [entry] = admin_entries(kvgate)
                assert (entry["expected_output_tokens"], entry["expected_output_source"]) == (8, "client")
                assert admitted_blocks == blocks(entry["prompt_tokens"][0] + 8)
                assert entry["output_tokens"][0] >= received
                grown = entry
    assert grown is not None, "the answer never streamed 100 tokens"
    assert grown["reserved_blocks"] >= blocks(grown["prompt_tokens"][0] + grown["output_tokens"][0])
    assert grown["reserved_blocks"] > admitted_blocks
    assert tally.usage is not None
    assert tally.usage.completion_tokens == 200
    assert tally.done
    events = [json.loads(line[6:]) for line in relayed.decode().splitlines() if line.startswith("data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"]
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")
    kvgate.wait_until(lambda gw: learned_samples(gw) == learned_before + 1, what="the answer to be learned")
    assert exceeded_total(kvgate) == exceeded_before + 1


def test_a_plain_answer_longer_than_told_completes(kvgate: Served) -> None:
    # A plain answer's tokens are not seen until it ends: what it holds beyond its reservation
    # shows in vLLM's usage at the scrapes meanwhile (external blocks), and it completes.
    body = {"prompt": PROMPT, "max_tokens": 300, "vllm_xargs": {OUTPUT_TOKENS_FIELD: 120}}
    response = complete(kvgate, body, "8")
    admitted, prompt = reserved(response)
    assert admitted == blocks(prompt + 8)
    assert response.json()["usage"]["completion_tokens"] == 120
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


@pytest.mark.parametrize("value", ["0", "-8", "2.5", "eight", "8 tokens", "10000001", ""])
def test_a_malformed_told_length_is_refused_with_an_openai_error(kvgate: Served, value: str) -> None:
    response = httpx.post(
        f"{kvgate.url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8},
        headers={HEADER: value},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", HEADER)
    assert HEADER in error["message"]
    assert kvgate.call(lambda: ledger_is_empty(kvgate.gateway))
