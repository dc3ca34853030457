"""Prompt token counts equal the real vLLM's `usage.prompt_tokens`, request by request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.tokens import RequestBodyError, Route, TokenCounter

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
        "developer first",
        {"messages": [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]},
    ),
    (
        "developer after user",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "developer", "content": "Be terse."}]},
    ),
    (
        "system and developer parts",
        {
            "messages": [
                {"role": "system", "content": "S1"},
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "D"}, {"type": "text", "text": "E"}],
                },
                {"role": "user", "content": "hi"},
            ]
        },
    ),
    (
        "reasoning_content",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "x", "reasoning_content": "thought"},
                {"role": "user", "content": "hi"},
            ]
        },
    ),
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


# chat_template_kwargs ------------------------------------------------------------------------
# vLLM 0.32 lays the request's add_generation_prompt / continue_final_message / documents over
# the kwargs, and the kwargs' tools / tokenize over the request's; unknown kwargs are dropped.
# Bodies with tools carry tool_choice "none": the testbed has no tool parser, and vLLM refuses
# the default "auto" choice without one whatever the kwargs say.
DOCS_A = [{"title": "A", "text": "alpha beta"}]
DOCS_B = [{"title": "B", "text": "gamma delta epsilon zeta eta theta"}]
ASSISTANT_PREFIX = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
HI = [{"role": "user", "content": "hi"}]
KWARGS_CASES: list[tuple[str, dict[str, Any]]] = [
    ("tools in kwargs", {"messages": HI, "chat_template_kwargs": {"tools": [WEATHER_TOOL]}}),
    ("bare tool in kwargs", {"messages": HI, "chat_template_kwargs": {"tools": [BARE_TOOL]}}),
    (
        "tools both places",
        {
            "messages": HI,
            "tools": [WEATHER_TOOL],
            "tool_choice": "none",
            "chat_template_kwargs": {"tools": [BARE_TOOL]},
        },
    ),
    (
        "null tools in kwargs",
        {
            "messages": HI,
            "tools": [WEATHER_TOOL],
            "tool_choice": "none",
            "chat_template_kwargs": {"tools": None},
        },
    ),
    ("documents in kwargs", {"messages": HI, "chat_template_kwargs": {"documents": DOCS_B}}),
    (
        "documents both places",
        {"messages": HI, "documents": DOCS_A, "chat_template_kwargs": {"documents": DOCS_B}},
    ),
    (
        "null documents in kwargs",
        {"messages": HI, "documents": DOCS_A, "chat_template_kwargs": {"documents": None}},
    ),
    (
        "no generation prompt in kwargs",
        {"messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}},
    ),
    (
        "generation prompt both places",
        {
            "messages": HI,
            "add_generation_prompt": False,
            "chat_template_kwargs": {"add_generation_prompt": True},
        },
    ),
    (
        "continue final in kwargs",
        {
            "messages": ASSISTANT_PREFIX,
            "add_generation_prompt": False,
            "chat_template_kwargs": {"continue_final_message": True},
        },
    ),
    (
        "unknown kwargs",
        {"messages": HI, "chat_template_kwargs": {"foo": 1, "enable_thinking": True, "conversations": []}},
    ),
    ("template variable", {"messages": HI, "chat_template_kwargs": {"bos_token": "hello world "}}),
    (
        "tokenize in kwargs",
        {"messages": HI, "add_special_tokens": True, "chat_template_kwargs": {"tokenize": True}},
    ),
    ("tokenize false in kwargs", {"messages": HI, "chat_template_kwargs": {"tokenize": False}}),
    (
        "tokenize and truncate",
        {"messages": HI, "chat_template_kwargs": {"tokenize": True, "truncation": True, "max_length": 3}},
    ),
    ("return_dict in kwargs", {"messages": HI, "chat_template_kwargs": {"return_dict": True}}),
    ("reasoning effort", {"messages": HI, "reasoning_effort": "low"}),
    ("null chat_template in kwargs", {"messages": HI, "chat_template_kwargs": {"chat_template": None}}),
]


@pytest.mark.parametrize(("name", "body"), KWARGS_CASES, ids=[c[0] for c in KWARGS_CASES])
def test_template_kwargs_count_as_vllm_counts_them(
    counter: TokenCounter, client: httpx.Client, name: str, body: dict[str, Any]
) -> None:
    count = counter.count(Route.CHAT, body)
    assert count.exact
    assert count.tokens == _usage(client, "/v1/chat/completions", body)["prompt_tokens"]


def test_kwargs_that_change_the_prompt_are_not_ignored(counter: TokenCounter) -> None:
    # Guards the cases above from passing by accident: each of these changes the prompt.
    plain = counter.count(Route.CHAT, {"messages": HI}).tokens
    for name in ("tools in kwargs", "documents in kwargs", "template variable", "tokenize and truncate"):
        body = dict(KWARGS_CASES)[name]
        assert counter.count(Route.CHAT, body).tokens != plain, name


KWARGS_REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("messages in kwargs", {"messages": HI, "chat_template_kwargs": {"messages": ASSISTANT_PREFIX}}),
    ("conversation in kwargs", {"messages": HI, "chat_template_kwargs": {"conversation": ASSISTANT_PREFIX}}),
    ("tools not a list", {"messages": HI, "chat_template_kwargs": {"tools": "abc"}}),
    ("documents not a list", {"messages": HI, "chat_template_kwargs": {"documents": "abc"}}),
    ("assistant mask", {"messages": HI, "chat_template_kwargs": {"return_assistant_tokens_mask": True}}),
]


@pytest.mark.parametrize(("name", "body"), KWARGS_REFUSED, ids=[c[0] for c in KWARGS_REFUSED])
def test_kwargs_vllm_refuses_are_refused(
    counter: TokenCounter, client: httpx.Client, name: str, body: dict[str, Any]
) -> None:
    response = client.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    with pytest.raises(RequestBodyError):
        counter.count(Route.CHAT, body)


# content parts ----------------------------------------------------------------------------
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
PARTS: list[tuple[str, Any]] = [
    ("image_url", {"type": "image_url", "image_url": {"url": PNG}}),
    ("remote image_url", {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}),
    ("image_url as a string", {"type": "image_url", "image_url": PNG}),
    ("input_image", {"type": "input_image", "image_url": PNG, "detail": "auto"}),
    ("image_pil", {"type": "image_pil", "image_pil": "AAAA"}),
    ("image_embeds", {"type": "image_embeds", "image_embeds": "AAAA"}),
    ("audio_url", {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}),
    ("input_audio", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
    ("audio_embeds", {"type": "audio_embeds", "audio_embeds": "AAAA"}),
    ("video_url", {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}),
    ("video_embeds", {"type": "video_embeds", "video_embeds": "AAAA"}),
    ("prompt_embeds", {"type": "prompt_embeds", "data": "AAAA"}),
    ("untyped image", {"image_url": {"url": PNG}}),
    ("image with uuid", {"type": "image_url", "image_url": {"url": PNG}, "uuid": "u1"}),
    ("file", {"type": "file", "file": {"file_data": "AAAA", "filename": "a.pdf"}}),
    ("unknown type", {"type": "banana", "banana": 1}),
    ("type not a string", {"type": 5}),
    ("untyped text", {"text": "hello"}),
    ("text with uuid", {"type": "text", "text": "x", "uuid": "u2"}),
    ("thinking", {"type": "thinking", "thinking": "let me see"}),
    ("tool_reference", {"type": "tool_reference", "name": "lookup"}),
    ("refusal", {"type": "refusal", "refusal": "no"}),
    ("input_text", {"type": "input_text", "text": "hello"}),
    ("output_text", {"type": "output_text", "text": "hello"}),
    ("null text", {"type": "text", "text": None}),
    ("missing text", {"type": "text"}),
    ("extra fields", {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}),
]


@pytest.mark.parametrize(("name", "part"), PARTS, ids=[c[0] for c in PARTS])
def test_content_parts_are_refused_or_counted_as_vllm_does(
    counter: TokenCounter, client: httpx.Client, name: str, part: Any
) -> None:
    # The part goes second: vLLM 0.32 validates the schema of a message's first part only.
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    response = client.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 1, **body})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        with pytest.raises(RequestBodyError):
            counter.count(Route.CHAT, body)
    else:
        count = counter.count(Route.CHAT, body)
        assert count.exact
        assert count.tokens == response.json()["usage"]["prompt_tokens"]


def test_a_media_part_is_refused_in_any_role_and_position(
    counter: TokenCounter, client: httpx.Client
) -> None:
    image = {"type": "image_url", "image_url": {"url": PNG}}
    for messages in (
        [{"role": "system", "content": [image]}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": [image]}],
        [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c", "content": [image]}],
    ):
        body = {"messages": messages}
        response = client.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 1, **body})
        assert response.status_code == 400, response.text
        with pytest.raises(RequestBodyError, match="not a multimodal model"):
            counter.count(Route.CHAT, body)


def test_completion_prompt_embeds_are_refused_as_vllm_refuses_them(
    counter: TokenCounter, client: httpx.Client
) -> None:
    body = {"prompt": "hi", "prompt_embeds": "AAAA"}
    response = client.post("/v1/completions", json={"model": "tiny-llama", "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    with pytest.raises(RequestBodyError):
        counter.count(Route.COMPLETIONS, body)


def test_system_billing_header_is_dropped_as_vllm_drops_it(
    counter: TokenCounter, client: httpx.Client
) -> None:
    for content in (
        "x-anthropic-billing-header: cch=1234\nYou are terse.",
        [
            {"type": "text", "text": "x-anthropic-billing-header: cch=99"},
            {"type": "text", "text": "Be brief."},
        ],
    ):
        body = {"messages": [{"role": "system", "content": content}, {"role": "user", "content": "hi"}]}
        assert (
            counter.count(Route.CHAT, body).tokens
            == _usage(client, "/v1/chat/completions", body)["prompt_tokens"]
        )
