"""kvgate refuses what vLLM refuses, and reserves at least what vLLM allocates (real testbed).

The testbed is vLLM 0.32 with a 1,024-token context and 32-token blocks. Every body goes to
vLLM straight and through kvgate (in process, in front of the same vLLM); the status codes
must be equal. Prompts are token ids (completions) or runs of "a" (one token each in chat) of
exactly the length a case names. Answers are kept short by a logit bias towards EOS, a field
kvgate does not read; min_tokens and ignore_eos still decide their length.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import testbed
from conftest import Served, ledger_is_empty, served_gateway
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import counting
from gateway.output_model import OUTPUT_WINDOW_SAMPLES

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
CONTEXT = 1024
BLOCK_SIZE = 32
# A token id of the tiny model's vocabulary that is neither BOS nor EOS.
FILLER_ID = 5
GENEROUS_QUEUE_S = 300.0
POOL_BLOCKS = 63


@pytest.fixture(scope="module")
def eos() -> int:
    value = counting.eos_token_id(testbed.model_dir())
    assert value is not None
    return value


@pytest.fixture(scope="module")
def cold(vllm_url: str) -> Iterator[Served]:
    """A gateway that reserves every cap: no learned lengths, no backend prior."""
    with served_gateway(
        vllm_url,
        discover_tokenizer=True,
        metrics_poll_interval_s=0.1,
        output_backend_prior=False,
        output_min_samples=OUTPUT_WINDOW_SAMPLES,  # never reached here
        priority_classes={"normal": {"queue_timeout_s": GENEROUS_QUEUE_S}},
    ) as served:
        yield served


@pytest.fixture(scope="module")
def warm(vllm_url: str, eos: int) -> Iterator[Served]:
    """A gateway that has learned one-token answers for both routes: its predictions are tiny,
    so only a request's own floor can make it reserve more."""
    with served_gateway(
        vllm_url,
        discover_tokenizer=True,
        metrics_poll_interval_s=0.1,
        output_backend_prior=False,
        output_min_samples=1,
        priority_classes={"normal": {"queue_timeout_s": GENEROUS_QUEUE_S}},
    ) as served:
        short = {"model": MODEL, "max_tokens": 1, "logit_bias": {str(eos): 100}}
        for path, body in (
            ("/v1/completions", {**short, "prompt": [FILLER_ID] * 8}),
            ("/v1/chat/completions", {**short, "messages": [{"role": "user", "content": "a"}]}),
        ):
            assert httpx.post(f"{served.url}{path}", json=body, timeout=120).status_code == 200
        served.wait_until(
            lambda gw: all(
                key in gw.output_model.describe() for key in (f"{MODEL}/completions", f"{MODEL}/chat")
            ),
            what="the warm-up answers to be learned",
        )
        yield served


@pytest.fixture(scope="module")
def chat_overhead(vllm_url: str) -> int:
    """Tokens the chat template adds around one user message (vLLM's own count)."""
    counts = [
        httpx.post(
            f"{vllm_url}/tokenize",
            json={"model": MODEL, "messages": [{"role": "user", "content": " ".join(["a"] * k)}]},
            timeout=30,
        ).json()["count"]
        for k in (1, 2)
    ]
    assert counts[1] == counts[0] + 1, "'a' is not one token per repetition in this template"
    return int(counts[0] - 1)


def completion_body(prompt: int | list[int], **fields: Any) -> dict[str, Any]:
    lengths = prompt if isinstance(prompt, list) else [prompt]
    prompts = [[FILLER_ID] * length for length in lengths]
    return {"model": MODEL, "prompt": prompts if isinstance(prompt, list) else prompts[0], **fields}


def chat_body(prompt: int, overhead: int, **fields: Any) -> dict[str, Any]:
    content = " ".join(["a"] * max(1, prompt - overhead))
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


# (route, prompt length(s), fields): the edges of vLLM 0.32's checks, at a 1,024 context.
BOUNDARIES: list[tuple[str, int | list[int], dict[str, Any]]] = [
    ("completions", 1023, {"max_tokens": 1}),  # prompt = ctx - 1
    ("completions", 1023, {}),
    ("completions", 1024, {"max_tokens": 1}),  # prompt = ctx
    ("completions", 1024, {}),
    ("completions", 1025, {"max_tokens": 1}),
    ("completions", 1000, {"max_tokens": 24}),  # prompt + max_tokens = ctx
    ("completions", 1000, {"max_tokens": 25}),  # = ctx + 1: served, stops at the context
    ("completions", 1000, {"max_tokens": 400}),
    ("completions", 10, {"max_tokens": 1024}),  # max_tokens = ctx
    ("completions", 10, {"max_tokens": 1025}),  # = ctx + 1
    ("completions", 10, {"max_tokens": 0}),
    ("completions", 10, {"max_tokens": 0, "echo": True}),
    ("completions", 1023, {"max_tokens": 0, "echo": True}),
    ("completions", 1024, {"max_tokens": 0, "echo": True}),
    ("completions", 1000, {"max_tokens": 30, "min_tokens": 24}),
    ("completions", 1000, {"max_tokens": 30, "min_tokens": 25}),  # beyond what the context leaves
    ("completions", 10, {"min_tokens": 16}),  # the default cap is 16
    ("completions", 10, {"min_tokens": 17}),
    ("completions", 10, {"max_tokens": 5, "min_tokens": 6}),
    ("completions", 10, {"max_tokens": 5, "min_tokens": -1}),
    ("completions", 1000, {"max_tokens": 30, "ignore_eos": True}),
    ("completions", [10, 1000], {"max_tokens": 100}),  # several prompts
    ("completions", [10, 1023], {"max_tokens": 1}),
    ("completions", [10, 1024], {"max_tokens": 1}),
    ("completions", [10, 1000], {"max_tokens": 30, "min_tokens": 24}),
    ("completions", [10, 1000], {"max_tokens": 30, "min_tokens": 25}),
    ("completions", 10, {"max_tokens": "3", "min_tokens": True, "ignore_eos": "yes"}),  # lax types
    ("completions", 10, {"max_tokens": 3, "ignore_eos": None}),
    ("chat", 1023, {"max_completion_tokens": 1}),
    ("chat", 1023, {}),
    ("chat", 1024, {}),
    ("chat", 1025, {"max_tokens": 1}),
    ("chat", 1000, {"max_tokens": 24}),
    ("chat", 1000, {"max_tokens": 25}),
    ("chat", 1000, {"max_completion_tokens": 25}),
    ("chat", 100, {"max_completion_tokens": 1024}),
    ("chat", 100, {"max_completion_tokens": 1025}),
    ("chat", 100, {"max_tokens": 1025}),
    ("chat", 100, {"max_completion_tokens": 5, "max_tokens": 1025}),  # the former decides
    ("chat", 100, {"max_completion_tokens": 0}),
    ("chat", 1000, {"min_tokens": 24}),  # no cap: what the context leaves
    ("chat", 1000, {"min_tokens": 25}),
    ("chat", 1000, {"max_tokens": 30, "min_tokens": 25}),
    ("chat", 100, {"max_tokens": 5, "min_tokens": 5, "ignore_eos": True}),
]


def boundary_id(case: tuple[str, int | list[int], dict[str, Any]]) -> str:
    route, prompt, fields = case
    return f"{route}-{prompt}-" + ",".join(f"{k}={v}" for k, v in fields.items())


@pytest.mark.parametrize("case", BOUNDARIES, ids=boundary_id)
def test_kvgate_refuses_exactly_what_vllm_refuses(
    cold: Served, vllm_url: str, eos: int, chat_overhead: int, case: tuple[str, Any, dict[str, Any]]
) -> None:
    route, prompt, fields = case
    fields = {"logit_bias": {str(eos): 100}, **fields}
    if route == "chat":
        path, body = "/v1/chat/completions", chat_body(prompt, chat_overhead, **fields)
    else:
        path, body = "/v1/completions", completion_body(prompt, **fields)
    direct = httpx.post(f"{vllm_url}{path}", json=body, timeout=300)
    relayed = httpx.post(f"{cold.url}{path}", json=body, timeout=300)
    if route == "chat" and direct.status_code == 200:
        assert direct.json()["usage"]["prompt_tokens"] == prompt  # the case is the one it names
    assert relayed.status_code == direct.status_code, (direct.text[:300], relayed.text[:300])
    if direct.status_code == 200:
        assert relayed.json()["usage"] == direct.json()["usage"]
    cold.wait_until(ledger_is_empty, what="the ledger to balance")


# -- the reservation covers what vLLM allocates ------------------------------------------------


def allocated_blocks(prompts: list[int], completions: list[list[int]], shares_prefix: bool) -> int:
    """Blocks vLLM holds at the end of a request, from its usage: every sequence holds its
    prompt and output tokens, and (prefix caching on, no prompt logprobs) the samples of one
    prompt share its full blocks but the last, which vLLM recomputes (prompt - 1 looked up)."""
    total = 0
    for prompt, outputs in zip(prompts, completions, strict=True):
        shared = (prompt - 1) // BLOCK_SIZE if shares_prefix and len(outputs) > 1 else 0
        total += shared + sum(math.ceil((prompt + output) / BLOCK_SIZE) - shared for output in outputs)
    return total


@st.composite
def request_bodies(draw: st.DrawFn) -> tuple[str, list[int], dict[str, Any]]:
    route = draw(st.sampled_from(["completions", "chat"]))
    count = draw(st.integers(1, 3)) if route == "completions" else 1
    n = draw(st.integers(1, 3))
    # Requests whose every sequence fits the pool together (kvgate refuses the others with
    # kv_pool_exceeded, a policy of its own): each sequence gets its share less the cap.
    longest = min(CONTEXT - 1, (POOL_BLOCKS // (count * n)) * BLOCK_SIZE - 41)
    lengths = draw(st.lists(st.integers(20, longest), min_size=count, max_size=count))
    fields: dict[str, Any] = {"return_token_ids": True, "temperature": 1.0, "n": n}
    cap_field = "max_completion_tokens" if route == "chat" and draw(st.booleans()) else "max_tokens"
    ignore_eos = draw(st.booleans())
    # Short answers keep the test fast: a cap of at most 40 tokens, or no cap where the
    # context leaves little (or the completions default of 16) and no ignore_eos otherwise.
    # A chat without a cap reserves the rest of the context: one sequence only, to fit the pool.
    uncapped_chat_fits = n == 1 and (not ignore_eos or max(lengths) >= 980)
    if draw(st.booleans()) or (route == "chat" and not uncapped_chat_fits):
        fields[cap_field] = draw(st.integers(1, 40))
    if ignore_eos:
        fields["ignore_eos"] = True
    if draw(st.booleans()):
        fields["min_tokens"] = draw(st.integers(0, 40))
    if route == "completions":
        if draw(st.booleans()):
            fields["echo"] = True
        if draw(st.booleans()):
            fields["logprobs"] = draw(st.integers(0, 2))
    else:
        if draw(st.booleans()):
            fields["echo"] = True
    if draw(st.booleans()):
        fields["prompt_logprobs"] = draw(st.integers(0, 1))
    return route, lengths, fields


def send(
    served: Served, route: str, lengths: list[int], fields: dict[str, Any], overhead: int
) -> httpx.Response:
    if route == "chat":
        return httpx.post(
            f"{served.url}/v1/chat/completions", json=chat_body(lengths[0], overhead, **fields), timeout=300
        )
    prompt = lengths if len(lengths) > 1 else lengths[0]
    return httpx.post(f"{served.url}/v1/completions", json=completion_body(prompt, **fields), timeout=300)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=request_bodies())
def test_every_accepted_body_reserves_what_vllm_allocates(
    cold: Served,
    warm: Served,
    vllm_url: str,
    eos: int,
    chat_overhead: int,
    case: tuple[str, list[int], dict[str, Any]],
) -> None:
    route, lengths, fields = case
    if not fields.get("ignore_eos"):
        fields = {**fields, "logit_bias": {str(eos): 100}}
    shares_prefix = fields.get("prompt_logprobs") is None and not (
        fields.get("echo") and (route == "chat" or fields.get("logprobs") is not None)
    )
    answers = [send(gateway, route, lengths, fields, chat_overhead) for gateway in (cold, warm)]
    assert answers[0].status_code == answers[1].status_code
    if answers[0].status_code != 200:
        # A refusal must be one vLLM makes too.
        assert answers[0].status_code == 400, answers[0].text
        direct = send(Served(vllm_url, cold.app, cold.loop), route, lengths, fields, chat_overhead)
        assert direct.status_code == 400, (answers[0].text, direct.text[:300])
        return
    for answer in answers:
        payload = answer.json()
        n = fields["n"]
        outputs = [len(choice["token_ids"]) for choice in payload["choices"]]
        assert sum(outputs) == payload["usage"]["completion_tokens"]
        assert sum(lengths) == payload["usage"]["prompt_tokens"]
        # Choices come per prompt, n at a time, in prompt order.
        per_prompt = [outputs[i * n : (i + 1) * n] for i in range(len(lengths))]
        actual = allocated_blocks(lengths, per_prompt, shares_prefix)
        reserved = int(answer.headers["x-kvgate-blocks"])
        if answer is answers[0]:
            assert reserved >= actual, (case, per_prompt)
        else:
            # Learned one-token answers: the floor alone must still be reserved.
            cap_asked = fields.get("max_completion_tokens", fields.get("max_tokens"))
            floors = []
            for prompt in lengths:
                room = CONTEXT - prompt
                cap = room if cap_asked is None and route == "chat" else min(cap_asked or 16, room)
                floors.append([cap if fields.get("ignore_eos") else fields.get("min_tokens", 0)] * n)
            assert reserved >= allocated_blocks(lengths, floors, shares_prefix), (case, floors)
    for gateway in (cold, warm):
        gateway.wait_until(ledger_is_empty, what="the ledger to balance")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, 3 + 3 * 1),  # 120 tokens, 4 blocks a sequence: the first 3 shared, 1 each
        ({"prompt_logprobs": 0}, 3 * 4),  # vLLM skips the prefix cache for prompt logprobs
        ({"echo": True, "logprobs": 0}, 3 * 4),  # so does echo with logprobs
        ({"echo": True}, 3 + 3 * 1),  # echo alone does not
    ],
)
def test_parallel_samples_share_prompt_blocks_as_vllm_does(
    cold: Served, fields: dict[str, Any], expected: int
) -> None:
    reading = cold.call(lambda: cold.gateway.budget.reading)
    assert reading is not None
    assert reading.prefix_caching is True
    body = completion_body(100, max_tokens=20, ignore_eos=True, n=3, temperature=1.0, **fields)
    answer = httpx.post(f"{cold.url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 60
    assert int(answer.headers["x-kvgate-blocks"]) == expected
    cold.wait_until(ledger_is_empty, what="the ledger to balance")
