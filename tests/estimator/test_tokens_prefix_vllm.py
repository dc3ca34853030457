"""kvgate's block hashes predict the real vLLM's prefix-cache hits, request by request.

For a second request after a first, vLLM 0.32 reuses the leading full blocks whose hashes it
holds, but never the block of the prompt's last token: find_longest_cache_hit is bounded by
max_cache_hit_length = prompt_len - 1 (vllm/v1/core/kv_cache_manager.py), so the hit is
block_size x min(leading equal hashes, (prompt_len - 1) // block_size) tokens. vLLM counts it in
`vllm:prefix_cache_hits_total` (tokens) and the prompt in `vllm:prefix_cache_queries_total`.

The testbed is shared, so the counters are the engine's totals: a measurement counts only when
the queries added while it ran are exactly this test's prompts (nobody else's request was
scheduled); otherwise it is repeated with a fresh `cache_salt`, which also keeps every attempt
from hitting blocks of an earlier one or of another test.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from estimator.prefix import prefix_seed
from estimator.tokens import Route, TokenCounter

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
ATTEMPTS = 12
# Bounds on waiting for the engine to be idle and for its counters to show a request.
IDLE_WAIT_S = 120.0
COUNTER_WAIT_S = 30.0
POLL_S = 0.05

SHARED = " ".join(f"The gateway admits request {i} when its blocks fit the budget." for i in range(40))


@pytest.fixture(scope="module")
def counter(tiny_model_dir: Path) -> TokenCounter:
    return TokenCounter.from_pretrained(tiny_model_dir, max_model_len=1024)


@pytest.fixture(scope="module")
def client(vllm_url: str) -> httpx.Client:
    with httpx.Client(base_url=vllm_url, timeout=120) as client:
        yield client


def _metrics(client: httpx.Client) -> str:
    response = client.get("/metrics")
    response.raise_for_status()
    return response.text


def _total(text: str, name: str) -> float:
    """The sum of a metric's samples over its label sets (one engine, one model here)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def _block_size(text: str) -> int:
    match = re.search(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text, re.MULTILINE)
    assert match, "vLLM's /metrics has no cache_config_info with a block_size"
    return int(match.group(1))


def _wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)


def _idle(client: httpx.Client) -> bool:
    text = _metrics(client)
    return _total(text, "vllm:num_requests_running") + _total(text, "vllm:num_requests_waiting") == 0


def _counters(client: httpx.Client) -> tuple[float, float]:
    text = _metrics(client)
    return _total(text, "vllm:prefix_cache_queries_total"), _total(text, "vllm:prefix_cache_hits_total")


def _send(client: httpx.Client, route: Route, body: dict[str, Any]) -> int:
    path = "/v1/chat/completions" if route is Route.CHAT else "/v1/completions"
    response = client.post(path, json={**body, "model": MODEL, "max_tokens": 1})
    assert response.status_code == 200, response.text
    prompt_tokens: int = response.json()["usage"]["prompt_tokens"]
    return prompt_tokens


def _after(client: httpx.Client, queries_before: float, prompt_tokens: int) -> tuple[float, float]:
    """The counters once they show at least `prompt_tokens` more queries (stats reach /metrics
    just after the answer does)."""
    _wait_until(
        lambda: _counters(client)[0] >= queries_before + prompt_tokens,
        COUNTER_WAIT_S,
        "vLLM's prefix-cache stats",
    )
    return _counters(client)


def _leading_equal(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _chat(system: str, question: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


CASES: list[tuple[str, Route, dict[str, Any], dict[str, Any]]] = [
    (
        "chat, shared system prompt",
        Route.CHAT,
        _chat(SHARED, "What does it do with a request that does not fit? " * 8),
        _chat(SHARED, "And how many blocks does a request of 700 tokens take? " * 6),
    ),
    (
        "completions text, shared beginning",
        Route.COMPLETIONS,
        {"prompt": SHARED + " First ending, of a few words." * 10},
        {"prompt": SHARED + " Another ending, longer than the first one by far, it is." * 8},
    ),
    (
        "completions ids, the same 10 full blocks twice (the last block is recomputed)",
        Route.COMPLETIONS,
        {"prompt": [(7 * i) % 31_000 + 3 for i in range(320)]},
        {"prompt": [(7 * i) % 31_000 + 3 for i in range(320)]},
    ),
    (
        "completions ids, the same prompt ending mid-block",
        Route.COMPLETIONS,
        {"prompt": [(11 * i) % 31_000 + 3 for i in range(300)]},
        {"prompt": [(11 * i) % 31_000 + 3 for i in range(300)]},
    ),
    (
        "completions ids, first token differs",
        Route.COMPLETIONS,
        {"prompt": [5, *range(100, 400)]},
        {"prompt": [6, *range(100, 400)]},
    ),
]


@pytest.mark.parametrize(("name", "route", "first", "second"), CASES, ids=[case[0] for case in CASES])
def test_hit_tokens_are_the_leading_equal_hashes_at_vllms_block_size(
    counter: TokenCounter,
    client: httpx.Client,
    name: str,
    route: Route,
    first: dict[str, Any],
    second: dict[str, Any],
) -> None:
    block_size = _block_size(_metrics(client))
    for _ in range(ATTEMPTS):
        salt = uuid.uuid4().hex
        # vLLM's salt goes into the first block's keys; kvgate's into the seed.
        seed = prefix_seed(MODEL, salt)
        a = counter.count(route, first, block_size=block_size, seed=seed)
        b = counter.count(route, second, block_size=block_size, seed=seed)
        shared_blocks = _leading_equal(a.block_hashes, b.block_hashes)
        _wait_until(lambda: _idle(client), IDLE_WAIT_S, "the shared testbed to be idle")
        queries0, hits0 = _counters(client)
        len_a = _send(client, route, {**first, "cache_salt": salt})
        queries1, hits1 = _after(client, queries0, len_a)
        len_b = _send(client, route, {**second, "cache_salt": salt})
        queries2, hits2 = _after(client, queries1, len_b)
        if (queries1 - queries0, queries2 - queries1) != (len_a, len_b):
            continue  # another client's request was scheduled meanwhile: measure again
        assert (a.tokens, b.tokens) == (len_a, len_b)
        assert len(a.block_hashes) == len_a // block_size
        assert hits1 - hits0 == 0  # a fresh salt: nothing of this attempt was cached before
        expected = block_size * min(shared_blocks, (len_b - 1) // block_size)
        assert hits2 - hits1 == expected, (name, shared_blocks, len_a, len_b)
        return
    pytest.fail(f"the testbed was never quiet for two requests in {ATTEMPTS} attempts")


def test_the_cases_cover_a_partial_match_a_full_match_and_none(counter: TokenCounter) -> None:
    # What the test above proves depends on its cases: a match that stops inside the prompt, a
    # prompt whose every block matches (capped by vLLM), and a first block that differs.
    shared = []
    for _, route, first, second in CASES:
        a = counter.count(route, first, block_size=32).block_hashes
        b = counter.count(route, second, block_size=32).block_hashes
        shared.append((_leading_equal(a, b), len(a), len(b)))
    assert 0 < shared[0][0] < min(shared[0][1:])
    assert 0 < shared[1][0] < min(shared[1][1:])
    assert shared[2] == (10, 10, 10)
    assert shared[3] == (9, 9, 9)
    assert shared[4][0] == 0
