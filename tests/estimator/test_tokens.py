"""TokenCounter without a server: validation, fallbacks, template detection, thread safety."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from estimator.tokens import RequestBodyError, Route, TokenCounter, detect_content_format


@pytest.fixture(scope="module")
def counter(tiny_model_dir: Path) -> TokenCounter:
    return TokenCounter.from_pretrained(tiny_model_dir)


BAD_BODIES: list[tuple[Route, Any, str | None]] = [
    (Route.CHAT, [], None),
    (Route.CHAT, {}, "messages"),
    (Route.CHAT, {"messages": "hi"}, "messages"),
    (Route.CHAT, {"messages": []}, "messages"),
    (Route.CHAT, {"messages": ["hi"]}, "messages[0]"),
    (Route.CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (Route.CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (Route.CHAT, {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
        "add_generation_prompt",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        "continue_final_message",
    ),
    (Route.CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "tools"),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        "tools[0]",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []},
        "chat_template_kwargs",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"type": "web"}]}]},
        "messages[0].tool_calls[0]",
    ),
    (Route.COMPLETIONS, {}, "prompt"),
    (Route.COMPLETIONS, {"prompt": None}, "prompt"),
    (Route.COMPLETIONS, {"prompt": ""}, "prompt"),
    (Route.COMPLETIONS, {"prompt": []}, "prompt"),
    (Route.COMPLETIONS, {"prompt": 42}, "prompt"),
    (Route.COMPLETIONS, {"prompt": ["ok", 3]}, "prompt[1]"),
    (Route.COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt[1]"),
    (Route.COMPLETIONS, {"prompt": [True, False]}, "prompt[0]"),
    (Route.COMPLETIONS, {"prompt": [224, -19547, 1030]}, "prompt"),
    (Route.COMPLETIONS, {"prompt": ["ok", [5, -1]]}, "prompt[1]"),
    (Route.COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD_BODIES)
@pytest.mark.parametrize("exact", [True, False], ids=["tokenizer", "approximate"])
def test_malformed_bodies_raise_with_param(
    counter: TokenCounter, route: Route, body: Any, param: str | None, exact: bool
) -> None:
    chosen = counter if exact else TokenCounter.approximate()
    with pytest.raises(RequestBodyError) as error:
        chosen.count(route, body)
    assert error.value.param == param


def test_approximate_counts_say_so_and_scale_with_text() -> None:
    approx = TokenCounter.approximate()
    short = approx.count(Route.CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    long = approx.count(Route.CHAT, {"messages": [{"role": "user", "content": "hi " * 500}]})
    assert not short.exact
    assert 0 < short.tokens < long.tokens
    ids = approx.count(Route.COMPLETIONS, {"prompt": [[1, 2, 3], [4]]})
    assert ids.per_prompt == (3, 1)


def test_token_ids_and_several_prompts(counter: TokenCounter) -> None:
    count = counter.count(Route.COMPLETIONS, {"prompt": ["a b c", [5, 6, 7, 8]]})
    assert count.exact
    assert count.per_prompt[1] == 4
    assert count.tokens == sum(count.per_prompt)
    assert count.longest == max(count.per_prompt)


def test_token_ids_beyond_the_vocabulary_are_refused(counter: TokenCounter, tiny_model_dir: Path) -> None:
    largest = max(AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab().values())
    assert counter.count(Route.COMPLETIONS, {"prompt": [0, largest]}).tokens == 2
    with pytest.raises(RequestBodyError, match=f"token id {largest + 1}, beyond") as error:
        counter.count(Route.COMPLETIONS, {"prompt": [1, largest + 1]})
    assert error.value.param == "prompt"
    # Without the tokenizer there is no vocabulary to hold them to.
    assert TokenCounter.approximate().count(Route.COMPLETIONS, {"prompt": [largest + 1]}).tokens == 1


def test_truncation_keeps_the_limit(counter: TokenCounter) -> None:
    body = {"prompt": "word " * 100, "truncate_prompt_tokens": 7}
    assert counter.count(Route.COMPLETIONS, body).tokens == 7


def test_images_are_dropped_from_an_exact_count(counter: TokenCounter) -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    }
    assert not counter.count(Route.CHAT, body).exact


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for message in messages %}{% for c in message.content | selectattr('type') %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for x in other %}{% endfor %}{% endfor %}", "string"),
        ("{% broken", "string"),
    ],
)
def test_content_format_detection(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_counting_is_thread_safe(counter: TokenCounter) -> None:
    bodies = [
        {"messages": [{"role": "user", "content": f"message number {i} " * (i % 17 + 1)}]} for i in range(200)
    ]
    serial = [counter.count(Route.CHAT, body).tokens for body in bodies]
    with ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(lambda body: counter.count(Route.CHAT, body).tokens, bodies))
    assert parallel == serial


def test_missing_tokenizer_folder_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="nowhere"):
        TokenCounter.from_pretrained(tmp_path / "nowhere")
