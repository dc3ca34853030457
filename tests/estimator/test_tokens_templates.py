"""Chat templates as code: request templates refused unless trusted, every exception a template
raises a 400 (the model's own template too), rendered output bounded, and counting without a
shared lock (each thread its own tokenizer copy)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from estimator.tokens import (
    UNTRUSTED_TEMPLATE_MESSAGE,
    ChatTemplateError,
    RequestBodyError,
    Route,
    TokenCounter,
    request_chat_template,
)

HELLO = [{"role": "user", "content": "hello"}]
STRING_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def refusing(tokenizer: Any) -> TokenCounter:
    return TokenCounter(tokenizer)


@pytest.fixture(scope="module")
def rendering(tokenizer: Any) -> TokenCounter:
    """What a render worker runs: request templates rendered in this process."""
    return TokenCounter(tokenizer, request_templates="render")


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        pytest.param({"chat_template": "{{ 1/0 }}"}, "chat_template", id="body"),
        pytest.param({"chat_template": ""}, "chat_template", id="empty-string-counts"),
        pytest.param(
            {"chat_template_kwargs": {"chat_template": "{{ 'a' * 10**10 }}"}},
            "chat_template_kwargs.chat_template",
            id="kwargs",
        ),
        pytest.param(
            {"chat_template_kwargs": {"chat_template": 5}},
            "chat_template_kwargs.chat_template",
            id="kwargs-not-str",
        ),
    ],
)
def test_request_templates_are_refused_unless_trusted(
    refusing: TokenCounter, extra: dict[str, Any], where: str
) -> None:
    body = {"messages": HELLO, **extra}
    assert request_chat_template(body) == where
    with pytest.raises(ChatTemplateError) as caught:
        refusing.count(Route.CHAT, body)
    assert (caught.value.code, caught.value.param) == ("untrusted_chat_template", where)
    assert caught.value.message == UNTRUSTED_TEMPLATE_MESSAGE


@pytest.mark.parametrize(
    "extra",
    [
        {"chat_template": None},
        {"chat_template_kwargs": {"chat_template": None}},
        {"chat_template_kwargs": {}},
    ],
)
def test_absent_templates_are_not_refused(refusing: TokenCounter, extra: dict[str, Any]) -> None:
    body = {"messages": HELLO, **extra}
    assert request_chat_template(body) is None
    assert refusing.count(Route.CHAT, body).tokens == refusing.count(Route.CHAT, {"messages": HELLO}).tokens


def test_completions_ignore_template_fields(refusing: TokenCounter) -> None:
    """vLLM's completions endpoint has no chat template: the field is ignored, not refused."""
    body = {"prompt": "hello", "chat_template": "{{ 1/0 }}"}
    assert (
        refusing.count(Route.COMPLETIONS, body).tokens
        == refusing.count(Route.COMPLETIONS, {"prompt": "hello"}).tokens
    )


def test_a_trusted_request_template_renders_with_its_own_content_format(
    rendering: TokenCounter, tokenizer: Any
) -> None:
    """The model's template iterates over content parts ("openai"); a request template that prints
    content as a string gets strings, as vLLM detects the format of the request's template."""
    assert rendering.content_format == "openai"
    body = {"messages": HELLO, "chat_template": STRING_TEMPLATE}
    rendered = rendering.render_chat(body)
    assert not isinstance(rendered, int)
    assert rendered.prompt == "<user>hello"
    expected = len(tokenizer.encode("<user>hello", add_special_tokens=False))
    assert rendering.count(Route.CHAT, body).tokens == expected


# Templates that fail in every way Python can: each is the request's fault, a 400.
HOSTILE_IN_PROCESS = [
    pytest.param("{{ 1/0 }}", "chat_template_error", "ZeroDivisionError", id="division-by-zero"),
    pytest.param(
        "{{ raise_exception('no such role') }}", "chat_template_error", "no such role", id="raise-exception"
    ),
    pytest.param("{{ 10.0 ** 400 }}", "chat_template_error", "OverflowError", id="overflow"),
    pytest.param(
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "chat_template_too_costly",
        "RecursionError",
        id="recursion",
    ),
    pytest.param("{{ messages[0].nope.deeper }}", "chat_template_error", "UndefinedError", id="undefined"),
    pytest.param("{{ ''.__class__.__mro__ }}", "chat_template_error", "SecurityError", id="sandbox-escape"),
    pytest.param("{% if %}", "chat_template_error", "TemplateSyntaxError", id="syntax"),
]


@pytest.mark.parametrize(("template", "code", "text"), HOSTILE_IN_PROCESS)
def test_the_models_own_template_failing_is_a_400(
    tokenizer: Any, template: str, code: str, text: str
) -> None:
    """An operator's template (the model's own) renders in process: whatever it raises is caught."""
    counter = TokenCounter(tokenizer, chat_template=template)
    with pytest.raises(ChatTemplateError) as caught:
        counter.count(Route.CHAT, {"messages": HELLO})
    assert caught.value.code == code
    assert text in caught.value.message


@pytest.mark.parametrize(("template", "code", "text"), HOSTILE_IN_PROCESS)
def test_a_trusted_request_template_failing_is_a_400(
    rendering: TokenCounter, template: str, code: str, text: str
) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        rendering.count(Route.CHAT, {"messages": HELLO, "chat_template": template})
    assert caught.value.code == code
    assert text in caught.value.message


def test_deeply_nested_kwargs_are_a_400(tokenizer: Any) -> None:
    """Template data are copied recursively before rendering: nesting past Python's recursion
    limit is a RecursionError, the request's, not a 500."""
    deep: Any = "leaf"
    for _ in range(5000):
        deep = {"a": deep}
    # A template that reads the kwarg: vLLM (and kvgate) pass on only the kwargs a template names.
    counter = TokenCounter(tokenizer, chat_template="{% if deep %}{{ messages[0]['content'] }}{% endif %}")
    with pytest.raises(ChatTemplateError) as caught:
        counter.count(Route.CHAT, {"messages": HELLO, "chat_template_kwargs": {"deep": deep}})
    assert caught.value.code == "chat_template_too_costly"


def test_a_long_exception_message_is_cut(tokenizer: Any) -> None:
    counter = TokenCounter(tokenizer, chat_template="{{ raise_exception(messages[0]['content'] * 10000) }}")
    with pytest.raises(ChatTemplateError) as caught:
        counter.count(Route.CHAT, {"messages": HELLO})
    assert len(caught.value.message) < 500


def test_a_rendered_prompt_past_the_bound_is_refused_before_tokenizing(tokenizer: Any) -> None:
    counter = TokenCounter(tokenizer, max_prompt_chars=1000)
    assert counter.count(Route.CHAT, {"messages": [{"role": "user", "content": "x" * 900}]}).tokens > 0
    with pytest.raises(ChatTemplateError) as caught:
        counter.count(Route.CHAT, {"messages": [{"role": "user", "content": "x" * 1001}]})
    assert caught.value.code == "chat_template_too_costly"
    assert "1000" in caught.value.message


def test_a_template_error_is_still_a_body_error(refusing: TokenCounter) -> None:
    """Callers that only know RequestBodyError (400) keep working."""
    with pytest.raises(RequestBodyError):
        refusing.count(Route.CHAT, {"messages": HELLO, "chat_template": "x"})


def test_each_thread_counts_with_its_own_tokenizer(tokenizer: Any) -> None:
    counter = TokenCounter(tokenizer)
    assert counter.tokenizer_copies == 0
    assert not any(isinstance(value, type(threading.Lock())) for value in vars(counter).values())
    bodies = [{"messages": [{"role": "user", "content": f"message {i} " * (i % 13 + 1)}]} for i in range(120)]
    serial = [counter.count(Route.CHAT, body).tokens for body in bodies]
    assert counter.tokenizer_copies == 1
    with ThreadPoolExecutor(max_workers=3) as pool:
        parallel = list(pool.map(lambda body: counter.count(Route.CHAT, body).tokens, bodies))
        workers = {thread.ident for thread in pool._threads}
    assert parallel == serial
    assert counter.tokenizer_copies == 1 + len(workers)


def test_a_threads_copy_can_be_made_ahead_from_another_thread(tokenizer: Any) -> None:
    """The gateway makes the event loop's copy in its pool, so the loop never spends the time."""
    counter = TokenCounter(tokenizer)
    here = threading.get_ident()
    thread = threading.Thread(target=counter.prepare_thread, args=(here,))
    thread.start()
    thread.join()
    assert counter.tokenizer_copies == 1
    counter.count(Route.COMPLETIONS, {"prompt": "hello"})
    assert counter.tokenizer_copies == 1  # this thread used the copy made for it
