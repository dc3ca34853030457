"""The fault tier against the real vLLM testbed (tiny-llama, 63 usable blocks of 32 tokens).

The testbed is shared and slow (a few hundred tokens/s), so only what the emulator cannot
show is run here: vLLM's own answers to bad input relayed as 4xx (never a 5xx), fields passed
through to vLLM and honoured, a first-byte timeout and a disconnect storm that make vLLM
abort its requests, and a SIGTERM drain of a real `kvgate serve` in front of it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import Served, gateway_idle, kvgate_process, poll_until, served_gateway, sse_events
from transformers import AutoTokenizer

from estimator.tokens import TokenCounter

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def kvgate(vllm_url: str, tiny_model_dir: Path) -> Iterator[Served]:
    counter = TokenCounter.from_pretrained(str(tiny_model_dir), max_model_len=1024)
    # What vLLM answers is under test, not staleness: a reading is trusted for 2 s, so that a
    # scrape slowed by a loaded machine does not turn a 400 into 503 budget_unknown.
    with served_gateway(
        vllm_url, counter=counter, metrics_poll_interval_s=0.1, metrics_stale_after_s=2.0
    ) as served:
        yield served


def vllm_requests(vllm_url: str) -> float:
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    names = ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"prompt": "hi", "max_tokens": 2, "temperature": "hot"}, 400),  # vLLM's own check, relayed
        ({"prompt": "hi", "max_tokens": 2, "logprobs": 1000}, 400),
        ({"prompt": "hi", "max_tokens": 2, "top_p": -1}, 400),
        ({"prompt": "hi", "max_tokens": 0}, 400),  # kvgate's check
        ({"prompt": "hi " * 2000, "max_tokens": 2}, 400),  # context too long, counted exactly
        ({"prompt": "hi", "max_tokens": 2, "model": "gpt-4"}, 404),
        ({"prompt": "hi", "max_tokens": 2, "n": 10**6}, 400),
    ],
)
def test_bad_input_against_vllm_is_a_4xx(kvgate: Served, body: dict[str, Any], status: int) -> None:
    response = httpx.post(f"{kvgate.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["message"]


def test_token_ids_are_held_to_the_vocabulary_vllm_holds_them_to(
    kvgate: Served, vllm_url: str, tiny_model_dir: Path
) -> None:
    # kvgate refuses what vLLM would refuse, before queueing it, and lets through what vLLM takes.
    largest = max(AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab().values())
    for ids, status in (([1, largest], 200), ([1, largest + 1], 400)):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 2}
        direct = httpx.post(f"{vllm_url}/v1/completions", json=body, timeout=60)
        relayed = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=60)
        assert (direct.status_code, relayed.status_code) == (status, status), (direct.text, relayed.text)
    negative = httpx.post(
        f"{kvgate.url}/v1/completions", json={"model": MODEL, "prompt": [1, -3]}, timeout=60
    )
    assert negative.status_code == 400
    assert negative.json()["error"]["param"] == "prompt"
    kvgate.wait_until(gateway_idle, what="the ledger to balance")


def test_fields_pass_through_to_vllm(kvgate: Served) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of",
        "max_tokens": 3,
        "logprobs": 2,
        "temperature": 0,
        "seed": 7,
    }
    answer = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    logprobs = answer.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 3
    assert all(len(top) >= 2 for top in logprobs["top_logprobs"])  # vLLM adds the sampled one
    # vLLM refuses n > 1 with greedy sampling: sample for the pair.
    two = httpx.post(f"{kvgate.url}/v1/completions", json={**body, "n": 2, "temperature": 1.0}, timeout=60)
    assert two.status_code == 200
    assert len(two.json()["choices"]) == 2
    assert int(two.headers["x-kvgate-blocks"]) > int(answer.headers["x-kvgate-blocks"])
    kvgate.wait_until(gateway_idle, what="the ledger to balance")


def test_a_first_byte_timeout_makes_vllm_abort(vllm_url: str, tiny_model_dir: Path) -> None:
    counter = TokenCounter.from_pretrained(str(tiny_model_dir), max_model_len=1024)
    with served_gateway(
        vllm_url, counter=counter, first_byte_timeout_s=0.3, metrics_stale_after_s=2.0
    ) as kvgate:
        body = {"model": MODEL, "prompt": "tell me", "max_tokens": 900, "ignore_eos": True}
        response = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        kvgate.wait_until(gateway_idle, what="the reservation released")
    # 900 tokens would take seconds: vLLM dropping to idle at once shows it aborted.
    poll_until(lambda: vllm_requests(vllm_url) == 0, 10, "vLLM to abort the request")


def test_a_disconnect_storm_makes_vllm_abort_everything(kvgate: Served, vllm_url: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True}
    payload = json.dumps(body).encode()
    host, port = kvgate.url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload

    async def storm() -> float:
        """Open the streams, then abort them all at once; returns when they were aborted."""
        writers = []
        for _ in range(24):  # two blocks each: every one is admitted
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            writers.append((reader, writer))
        for reader, _ in writers:  # each stream has begun
            await reader.readuntil(b"data: ")
        for _, writer in writers:
            writer.transport.abort()
        return time.monotonic()

    aborted = asyncio.run(storm())
    kvgate.wait_until(gateway_idle, timeout_s=5, what="every reservation released")
    took = time.monotonic() - aborted
    assert took < 1.0, f"{took:.2f} s to release every reservation"
    poll_until(lambda: vllm_requests(vllm_url) == 0, 10, "vLLM to abort every request")


def test_sigterm_in_front_of_vllm(vllm_url: str, tmp_path: Path) -> None:
    with kvgate_process(vllm_url, tmp_path / "kvgate.log", settings={"shutdown_grace_s": 20}) as kvgate:
        body = {"model": MODEL, "prompt": "count", "max_tokens": 40, "ignore_eos": True, "stream": True}

        def stream() -> list[str]:
            with (
                httpx.Client(timeout=60) as client,
                client.stream("POST", f"{kvgate.url}/v1/completions", json=body) as r,
            ):
                return sse_events("".join(r.iter_text()))

        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream) for _ in range(2)]
            poll_until(
                lambda: kvgate.state()["backends"][0]["ledger"]["entries"] == 2, 30, "two streams admitted"
            )
            kvgate.process.send_signal(signal.SIGTERM)
            for events in (s.result(timeout=60) for s in streams):
                assert events[-1] == "[DONE]"
        assert kvgate.process.wait(timeout=30) == 0
