"""kvgate in front of the real vLLM CPU testbed (tiny-llama, 63 usable blocks of 32 tokens).

Pass-through is compared with the same request sent straight to vLLM (greedy sampling on a
random model is deterministic); ids and timestamps differ by nature and are masked.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from conftest import Served, ledger_is_empty, served_gateway

from bench.payload import OUTPUT_TOKENS_FIELD
from gateway.sse import StreamTally

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
BLOCK_SIZE = 32
VARYING_FIELDS = ("id", "created")


@pytest.fixture(scope="module")
def kvgate(vllm_url: str) -> Iterator[Served]:
    # The real tokenizer, found the way `kvgate serve` finds it: from the backend's /v1/models.
    # Reservations start at the cap, as the tests here expect, whatever earlier tests sent vLLM.
    # The queue waits long: these tests are about what vLLM does with what kvgate sends, not
    # about deadlines, and a wait predicted from a cold pace on a loaded machine must not shed.
    with served_gateway(
        vllm_url,
        discover_tokenizer=True,
        metrics_poll_interval_s=0.1,
        output_backend_prior=False,
        priority_classes={"normal": {"queue_timeout_s": 3600.0}},
    ) as served:
        yield served


def vllm_gauge(vllm_url: str, name: str) -> float:
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def wait_vllm_idle(vllm_url: str, timeout_s: float = 120.0) -> None:
    """Other tests (or other users of the testbed) may still be generating."""
    deadline = time.monotonic() + timeout_s
    while (
        vllm_gauge(vllm_url, "vllm:num_requests_running") + vllm_gauge(vllm_url, "vllm:num_requests_waiting")
        > 0
    ):
        assert time.monotonic() < deadline, "the testbed did not go idle"
        time.sleep(0.1)


def masked(payload: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in payload.items() if key not in VARYING_FIELDS}


def sse_payloads(text: str) -> list[Any]:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [event if event == "[DONE]" else masked(json.loads(event)) for event in events]


def merged_stream(events: list[Any]) -> dict[str, Any]:
    """What a stream says when its deltas are joined: per choice the text (or message content)
    and finish reason, and the usage."""
    texts: dict[int, str] = {}
    finish: dict[int, Any] = {}
    usage = None
    for event in events:
        if event == "[DONE]":
            continue
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            index = choice["index"]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            texts[index] = texts.get(index, "") + piece
            if choice.get("finish_reason") is not None:
                finish[index] = choice["finish_reason"]
    return {"texts": texts, "finish": finish, "usage": usage, "done": events[-1:] == ["[DONE]"]}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/completions",
            {"prompt": "The KV cache", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 10,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            },
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_pass_through_matches_vllm_direct(
    kvgate: Served, vllm_url: str, path: str, body: dict[str, Any], stream: bool
) -> None:
    request = {"model": MODEL, **body, "stream": stream}
    if not stream:
        request.pop("stream_options", None)
    direct = httpx.post(f"{vllm_url}{path}", json=request, timeout=60)
    relayed = httpx.post(f"{kvgate.url}{path}", json=request, timeout=60)
    assert relayed.status_code == direct.status_code == 200
    assert relayed.headers["content-type"] == direct.headers["content-type"]
    if stream:
        relayed_events, direct_events = sse_payloads(relayed.text), sse_payloads(direct.text)
        if relayed_events != direct_events:
            # vLLM merges the deltas of a request whose stream it could not send in time (a
            # busy CPU testbed): then the same answer comes in fewer, larger events.
            assert merged_stream(relayed_events) == merged_stream(direct_events)
    else:
        assert masked(relayed.json()) == masked(direct.json())
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_usage_and_reserved_blocks_use_vllm_token_counts(kvgate: Served) -> None:
    prompt = " ".join(f"token{i}" for i in range(60))
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=60)
    usage = sse_payloads(response.text)[-2]["usage"]
    assert usage["completion_tokens"] == 40
    # Until the output model has samples the gateway reserves the cap: prompt + 40 tokens.
    samples = kvgate.call(
        lambda: kvgate.gateway.output_model.describe().get(f"{MODEL}/completions", {}).get("samples", 0)
    )
    if samples <= 1:
        assert int(response.headers["x-kvgate-blocks"]) == math.ceil(
            (usage["prompt_tokens"] + 40) / BLOCK_SIZE
        )
    # The tokens kvgate counted on the stream are what vLLM reports.
    assert kvgate.call(lambda: kvgate.gateway.output_model.describe()[f"{MODEL}/completions"]["samples"]) >= 1


def vllm_output_lengths(vllm_url: str) -> dict[float, float]:
    """vLLM's histogram of output lengths, read off its text: upper bound -> cumulative count."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_generation_tokens_bucket{"):
            bound = float(line.split('le="', 1)[1].split('"', 1)[0])
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return buckets


def test_a_fresh_gateway_reserves_what_vllms_answers_ran_to(vllm_url: str) -> None:
    # A gateway (re)started in front of a vLLM that has been serving: its first requests
    # reserve the median of the answers vLLM has produced, read off vLLM's histogram, not the
    # cap. Short answers are sent straight to vLLM first until the median is at most 500
    # tokens, whatever earlier tests sent: then a 900-token cap cannot be what is reserved.
    wait_vllm_idle(vllm_url)
    short = {"model": MODEL, "prompt": "Once upon a", "max_tokens": 2, "ignore_eos": True}
    buckets = vllm_output_lengths(vllm_url)
    missing = max(10, 2 * math.ceil(buckets.get(math.inf, 0.0) / 2 - buckets.get(500.0, 0.0)) + 10)
    with ThreadPoolExecutor(8) as pool:
        sent = list(
            pool.map(
                lambda _: httpx.post(f"{vllm_url}/v1/completions", json=short, timeout=60), range(missing)
            )
        )
    assert all(response.status_code == 200 for response in sent)
    wait_vllm_idle(vllm_url)
    buckets = vllm_output_lengths(vllm_url)
    total = buckets[math.inf]
    median = min(bound for bound, count in buckets.items() if count >= math.ceil(0.5 * total))
    assert median <= 500
    with served_gateway(
        vllm_url,
        discover_tokenizer=True,
        metrics_poll_interval_s=0.1,
        output_quantile=0.5,
        output_min_samples=10,  # at least the short answers above
    ) as kvgate:
        kvgate.wait_until(lambda gw: gw.output_model.backend_prior is not None, what="a scrape")
        assert kvgate.call(lambda: kvgate.gateway.output_model.backend_prior) == (int(median), int(total))
        body = {
            "model": MODEL,
            "prompt": "Once upon a",
            "max_tokens": 900,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200
        prompt_tokens = sse_payloads(response.text)[-2]["usage"]["prompt_tokens"]
        assert int(response.headers["x-kvgate-blocks"]) == math.ceil((prompt_tokens + median) / BLOCK_SIZE)
        assert math.ceil((prompt_tokens + median) / BLOCK_SIZE) < math.ceil(
            (prompt_tokens + 900) / BLOCK_SIZE
        )
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_a_burst_through_kvgate_causes_no_preemption(kvgate: Served, vllm_url: str) -> None:
    # Sent straight to vLLM, 8 requests of ~225 prompt + 300 output tokens (17 blocks each, 136
    # in all for a 63-block pool) preempt; kvgate queues what does not fit instead.
    wait_vllm_idle(vllm_url)
    before = vllm_gauge(vllm_url, "vllm:num_preemptions_total")
    prompt = " ".join(f"w{i}" for i in range(75))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "ignore_eos": True}
    foreign: list[float] = []
    done = threading.Event()

    def watch_for_foreign_traffic() -> None:
        # The testbed may be shared: requests kvgate did not send make the result meaningless.
        while not done.is_set():
            ours = kvgate.call(lambda: kvgate.gateway.ledger.totals().entries)
            theirs = vllm_gauge(vllm_url, "vllm:num_requests_running") + vllm_gauge(
                vllm_url, "vllm:num_requests_waiting"
            )
            if theirs > ours:
                foreign.append(theirs - ours)
            time.sleep(0.05)

    with ThreadPoolExecutor(9) as pool:
        watcher = pool.submit(watch_for_foreign_traffic)
        responses = list(
            pool.map(lambda _: httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=120), range(8))
        )
        done.set()
        watcher.result()
    preemptions = vllm_gauge(vllm_url, "vllm:num_preemptions_total") - before
    if preemptions and len(foreign) > 2:
        pytest.skip(f"another client used the testbed during the burst ({len(foreign)} samples)")
    assert [r.status_code for r in responses] == [200] * 8, [
        r.text for r in responses if r.status_code != 200
    ]
    assert max(int(r.headers["x-kvgate-queue-ms"]) for r in responses) > 0
    assert preemptions == 0
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


# What the budget tests sample: ledger entries, reserved, committed and admissible blocks.
BudgetSample = tuple[int, int, int, int]


@contextlib.contextmanager
def sampling_budget(kvgate: Served, pool: ThreadPoolExecutor) -> Iterator[list[BudgetSample]]:
    """Sample the gateway's ledger and budget on its own loop every 20 ms while the block runs."""
    samples: list[BudgetSample] = []
    done = threading.Event()

    def sample(gw: Any) -> BudgetSample:
        totals, snapshot = gw.ledger.totals(), gw.budget.snapshot(gw.clock())
        return (totals.entries, totals.reserved_blocks, snapshot.committed_blocks, snapshot.admissible_blocks)

    def watch() -> None:
        while not done.is_set():
            samples.append(kvgate.call(lambda: sample(kvgate.gateway)))
            time.sleep(0.02)

    watcher = pool.submit(watch)
    try:
        yield samples
    finally:
        done.set()
        watcher.result()


def test_client_leaving_mid_stream_frees_vllm_blocks(kvgate: Served, vllm_url: str) -> None:
    wait_vllm_idle(vllm_url)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{kvgate.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        assert vllm_gauge(vllm_url, "vllm:num_requests_running") == 1
    kvgate.wait_until(ledger_is_empty, timeout_s=10, what="the reservation to be released")
    deadline = time.monotonic() + 10
    while (
        vllm_gauge(vllm_url, "vllm:num_requests_running") > 0
        or vllm_gauge(vllm_url, "vllm:kv_cache_usage_perc") > 0
    ):
        assert time.monotonic() < deadline, "vLLM kept the request after the client left"
        time.sleep(0.05)


PRIORITY_TOKEN = "vllm-tier-priority-token"


def test_openai_client_end_to_end_with_retry(vllm_url: str) -> None:
    wait_vllm_idle(vllm_url)
    with (
        served_gateway(
            vllm_url,
            discover_tokenizer=True,
            priority_classes={"normal": {"queue_max": 0}},
            output_backend_prior=False,  # the caps below are the reservations: see there
            priority_token=PRIORITY_TOKEN,
        ) as kvgate,
        openai.OpenAI(base_url=f"{kvgate.url}/v1", api_key="unused", max_retries=60, timeout=60) as client,
        ThreadPoolExecutor(2) as pool,
    ):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 8
        # Two requests of 32 blocks each (2 prompt + 1,000 output tokens) cannot both fit in 63
        # blocks: the second is shed with 429 until the first completes, and the SDK retries it.
        # The first goes in as high priority, whose queue is open: it waits for room should the
        # testbed be busy; the normal-priority queue is closed (0), so the second is shed.
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True}
        first = pool.submit(
            httpx.post,
            f"{kvgate.url}/v1/completions",
            json=body,
            headers={"x-kvgate-priority": "high", "x-kvgate-priority-token": PRIORITY_TOKEN},
            timeout=120,
        )
        kvgate.wait_until(
            lambda gw: gw.ledger.totals().entries == 1, timeout_s=60, what="the first to be admitted"
        )
        second = client.completions.with_raw_response.create(
            model=MODEL, prompt="y", max_tokens=1000, extra_body={"ignore_eos": True}
        )
        assert second.http_response.status_code == 200
        assert second.retries_taken >= 1
        assert first.result().status_code == 200
        kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("length", [1, 5, 40])
def test_streamed_tokens_are_counted_as_vllm_counts_them(vllm_url: str, route: str, length: int) -> None:
    """Without usage in the stream, kvgate learns an answer's length from its events: the
    end-of-sequence token (an empty text with finish_reason "stop") counts, as vLLM's usage
    counts it, and no token counts twice. A one-token answer is that token alone; a longer one
    may reach the client in fewer events than tokens when vLLM's output falls behind and joins
    several tokens into one event (under load), so its count is at most vLLM's."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 100, "stream": True, "n": 2}
    body["vllm_xargs"] = {OUTPUT_TOKENS_FIELD: length}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me a story"}]
    else:
        body["prompt"] = "Once upon a time"
    url = f"{vllm_url}/v1/{'chat/' if route == 'chat' else ''}completions"
    plain = httpx.post(url, json=body, timeout=60)
    counted = httpx.post(url, json={**body, "stream_options": {"include_usage": True}}, timeout=60)
    assert plain.status_code == counted.status_code == 200
    tally = StreamTally()
    tally.feed(plain.content)
    reported = StreamTally()
    reported.feed(counted.content)
    assert reported.usage is not None
    assert reported.usage.completion_tokens == 2 * length  # the forced lengths, by vLLM's count
    assert tally.usage is None
    if length == 1:
        assert tally.tokens_by_choice == {0: 1, 1: 1}
    else:
        assert set(tally.tokens_by_choice) == {0, 1}
        assert all(1 <= tokens <= length for tokens in tally.tokens_by_choice.values())
