"""Prompt token counts equal the real vLLM's `usage.prompt_tokens`, request by request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.tokens import Route, TokenCounter

pytestmark = pytest.mark.vllm

LONG_TEXT = " ".join(f"word{i}" for i in range(120))
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
BARE_TOOL = {"type": "function", "function": {"name": "now"}}

CHAT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"messages": [{"role": "user", "content": "Hello there"}]}),
    ("empty content", {"messages": [{"role": "user", "content": ""}]}),
    ("whitespace", {"messages": [{"role": "user", "content": "   \n\t  "}]}),
    ("unicode", {"messages": [{"role": "user", "content": "Grüße, 世界! Ça va? Здравствуйте 🙂🚀"}]}),
    ("emoji only", {"messages": [{"role": "user", "content": "👩‍👩‍👧‍👦🏳️‍🌈"}]}),
    (
        "system",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Why is the sky blue?"},
            ]
        },
    ),
    (
        "multi-turn",
        {
            "messages": [
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Bonjour !"},
                {"role": "user", "content": "How are you?"},
                {"role": "assistant", "content": "Très bien."},
                {"role": "user", "content": "And now?"},
            ]
        },
    ),
    (
        "content parts",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first part"},
                        {"type": "text", "text": "second part"},
                    ],
                }
            ]
        },
    ),
    ("single part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "only"}]}]}),
    ("empty parts list", {"messages": [{"role": "user", "content": []}]}),
    (
        "null assistant content",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "again"},
            ]
        },
    ),
    ("named user", {"messages": [{"role": "user", "name": "alice", "content": "hello"}]}),
    ("long", {"messages": [{"role": "user", "content": LONG_TEXT}]}),
    (
        "no generation prompt",
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    ),
    (
        "continue final",
        {
            "messages": [
                {"role": "user", "content": "Count:"},
                {"role": "assistant", "content": "one, two,"},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    ("special tokens", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}),
    (
        "tools",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "none",
        },
    ),
    (
        "bare tool",
        {
            "messages": [{"role": "user", "content": "time?"}],
            "tools": [BARE_TOOL, WEATHER_TOOL],
            "tool_choice": "none",
        },
    ),
    (
        "tool round trip",
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": "none",
        },
    ),
    (
        "tool parts",
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "tool",
                    "tool_call_id": "c",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        },
    ),
    (
        "documents",
        {
            "messages": [{"role": "user", "content": "Summarise"}],
            "documents": [{"title": "A", "text": "alpha beta"}, {"title": "B", "text": "gamma"}],
        },
    ),
    (
        "template kwargs",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
    ),
    ("markup-like text", {"messages": [{"role": "user", "content": "<|user|> </s> <s> [INST] {{ x }}"}]}),
    ("newlines", {"messages": [{"role": "user", "content": "line1\nline2\r\nline3\n\n"}]}),
    ("code", {"messages": [{"role": "user", "content": "def f(x):\n    return {'a': [1, 2]}  # ok"}]}),
    (
        "max_completion_tokens",
        {"messages": [{"role": "user", "content": "short"}], "max_completion_tokens": 1},
    ),
]

COMPLETION_CASES: list[tuple[str, dict[str, Any]]] = [
    ("string", {"prompt": "Once upon a time"}),
    ("unicode string", {"prompt": "naïve café — 東京 🍣"}),
    ("single space", {"prompt": " "}),
    ("token ids", {"prompt": [1, 415, 2936, 9060, 285, 1142]}),
    ("no special tokens", {"prompt": "Once upon a time", "add_special_tokens": False}),
    ("long string", {"prompt": LONG_TEXT}),
    ("truncated", {"prompt": LONG_TEXT, "truncate_prompt_tokens": 50}),
]

MULTI_PROMPT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("list of strings", {"prompt": ["alpha", "beta gamma delta"]}),
    ("list of token lists", {"prompt": [[1, 2, 3], [1, 5, 6, 7, 8]]}),
]


@pytest.fixture(scope="module")
def counter(tiny_model_dir: Path) -> TokenCounter:
    return TokenCounter.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def client(vllm_url: str) -> httpx.Client:
    with httpx.Client(base_url=vllm_url, timeout=120) as client:
        yield client  # type: ignore[misc]


def _usage(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json={"model": "tiny-llama", "max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


@pytest.mark.parametrize(("name", "body"), CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_count_matches_vllm(
    counter: TokenCounter, client: httpx.Client, name: str, body: dict[str, Any]
) -> None:
    count = counter.count(Route.CHAT, body)
    assert count.exact
    assert count.tokens == _usage(client, "/v1/chat/completions", body)["prompt_tokens"]


@pytest.mark.parametrize(("name", "body"), COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_completion_count_matches_vllm(
    counter: TokenCounter, client: httpx.Client, name: str, body: dict[str, Any]
) -> None:
    count = counter.count(Route.COMPLETIONS, body)
    assert count.exact
    assert count.tokens == _usage(client, "/v1/completions", body)["prompt_tokens"]


@pytest.mark.parametrize(("name", "body"), MULTI_PROMPT_CASES, ids=[c[0] for c in MULTI_PROMPT_CASES])
def test_each_of_several_prompts_matches_vllm(
    counter: TokenCounter, client: httpx.Client, name: str, body: dict[str, Any]
) -> None:
    # vLLM sums usage over the prompts of one request; check the sum and every prompt alone.
    count = counter.count(Route.COMPLETIONS, body)
    assert count.tokens == _usage(client, "/v1/completions", body)["prompt_tokens"]
    for prompt, expected in zip(body["prompt"], count.per_prompt, strict=True):
        assert expected == _usage(client, "/v1/completions", {**body, "prompt": prompt})["prompt_tokens"]


@pytest.mark.parametrize("route", [Route.CHAT, Route.COMPLETIONS])
def test_streaming_usage_matches(counter: TokenCounter, client: httpx.Client, route: Route) -> None:
    if route is Route.CHAT:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "stream me, ß"}]}
    else:
        path, body = "/v1/completions", {"prompt": "stream me, ß"}
    request = {
        "model": "tiny-llama",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    usage = None
    with client.stream("POST", path, json=request) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
    assert usage is not None
    assert counter.count(route, body).tokens == usage["prompt_tokens"]


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_content = st.one_of(
    _text,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, _text), max_size=3),
)
_message = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["system", "user", "assistant"]),
    _content,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_message, min_size=1, max_size=5), add_generation_prompt=st.booleans())
def test_random_conversations_match_vllm(
    counter: TokenCounter, client: httpx.Client, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    expected = _usage(client, "/v1/chat/completions", body)["prompt_tokens"]
    assert counter.count(Route.CHAT, body).tokens == expected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=80)
)
def test_random_completion_prompts_match_vllm(
    counter: TokenCounter, client: httpx.Client, prompt: str
) -> None:
    expected = _usage(client, "/v1/completions", {"prompt": prompt})["prompt_tokens"]
    assert counter.count(Route.COMPLETIONS, {"prompt": prompt}).tokens == expected
