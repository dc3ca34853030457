"""RenderPool: trusted request templates render in worker processes that no template can make
grow past RENDER_MEMORY_BYTES, run past the timeout, or send back more than max_prompt_chars.

Each hostile template gets a 400 (ChatTemplateError with its code); the worker that ran out of
memory exits and the one that ran out of time is killed, and a fresh one serves the next render;
the gateway's process (this one) never holds what the template asked for. No timing is asserted:
a timeout shows as its message and as the killed worker's exit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from estimator.tokens import ChatTemplateError, RenderedChat, RequestBodyError, Route, TokenCounter
from gateway.render_pool import RENDER_MEMORY_BYTES, RenderPool, RenderPoolError

HELLO = [{"role": "user", "content": "hello"}]
STRING_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
MAX_PROMPT_CHARS = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path) -> Iterator[RenderPool]:
    pool = RenderPool(str(tiny_model_dir), max_model_len=1024, max_prompt_chars=MAX_PROMPT_CHARS, workers=1)
    try:
        yield pool
    finally:
        pool.close()


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def render(pool: RenderPool, template: str, **extra: Any) -> RenderedChat | int:
    return pool.render_chat({"messages": HELLO, "chat_template": template, **extra})


def test_a_trusted_template_renders_as_in_process(pool: RenderPool, tiny_model_dir: Path) -> None:
    rendered = render(pool, STRING_TEMPLATE)
    local = TokenCounter(AutoTokenizer.from_pretrained(str(tiny_model_dir)), request_templates="render")
    assert rendered == local.render_chat({"messages": HELLO, "chat_template": STRING_TEMPLATE})
    assert rendered == RenderedChat("<user>hello", add_special_tokens=False)


def test_a_raising_template_is_a_400_and_the_worker_serves_on(pool: RenderPool) -> None:
    render(pool, "warm")
    (pid,) = pool.worker_pids()
    with pytest.raises(ChatTemplateError) as caught:
        render(pool, "{{ 1/0 }}")
    assert caught.value.code == "chat_template_error"
    assert "ZeroDivisionError" in caught.value.message
    assert render(pool, "ok") == RenderedChat("ok", add_special_tokens=False)
    assert pool.worker_pids() == [pid]


# Each asks for far more than RENDER_MEMORY_BYTES (the 1 GB ones through filters).
MEMORY_BOMBS = [
    pytest.param("{{ 'a' * 10**10 }}", {}, id="string-times-1e10"),
    pytest.param("{{ 'x' | center(10**9) }}", {}, id="center-1GB"),
    pytest.param("{{ '%0999999999d' | format(1) }}", {}, id="format-1GB"),
    pytest.param("{{ (('x' ~ '\\n') * 10) | indent(10**8) }}", {}, id="indent-1GB"),
    pytest.param(
        None,
        {
            "chat_template_kwargs": {
                "chat_template": "{% for i in range(100000) %}{{ big }}{% endfor %}",
                "big": "y" * 1_000_000,
            }
        },
        id="huge-kwarg-100GB",
    ),
]


@pytest.mark.parametrize(("template", "extra"), MEMORY_BOMBS)
def test_a_memory_bomb_is_a_400_and_its_worker_is_replaced(
    pool: RenderPool, template: str | None, extra: dict[str, Any]
) -> None:
    render(pool, "warm")
    (pid,) = pool.worker_pids()
    peak_before = peak_rss_bytes()
    body: dict[str, Any] = {"messages": HELLO, **extra}
    if template is not None:
        body["chat_template"] = template
    with pytest.raises(ChatTemplateError) as caught:
        pool.render_chat(body)
    assert caught.value.code == "chat_template_too_costly"
    assert "MemoryError" in caught.value.message
    assert not alive(pid)
    assert peak_rss_bytes() - peak_before < RENDER_MEMORY_BYTES
    assert render(pool, "after") == RenderedChat("after", add_special_tokens=False)
    assert pool.worker_pids() != [pid]


def test_an_endless_template_is_stopped_at_the_timeout_and_its_worker_killed(pool: RenderPool) -> None:
    render(pool, "warm")
    (pid,) = pool.worker_pids()
    # 10**10 iterations that print nothing: no memory to run out of, only time.
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError) as caught:
        render(pool, nested)
    assert caught.value.code == "chat_template_too_costly"
    assert f"within kvgate's bound of {pool.timeout_s:g} s" in caught.value.message
    assert not alive(pid)
    assert render(pool, "after") == RenderedChat("after", add_special_tokens=False)


def test_deep_recursion_is_a_400(pool: RenderPool) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        render(pool, "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    assert caught.value.code == "chat_template_too_costly"
    assert "RecursionError" in caught.value.message


def test_output_past_the_bound_never_comes_back(pool: RenderPool) -> None:
    """40 M characters fit the worker's memory but not max_prompt_chars: refused there."""
    with pytest.raises(ChatTemplateError) as caught:
        render(pool, "{{ 'x' * 40000000 }}")
    assert caught.value.code == "chat_template_too_costly"
    assert f"bound of {MAX_PROMPT_CHARS}" in caught.value.message


def test_body_errors_come_back_as_body_errors(pool: RenderPool) -> None:
    with pytest.raises(RequestBodyError) as caught:
        pool.render_chat({"messages": [], "chat_template": "x"})
    assert not isinstance(caught.value, ChatTemplateError)
    assert caught.value.param == "messages"


def test_a_counter_with_the_pool_counts_here_what_the_worker_rendered(
    pool: RenderPool, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    counter = TokenCounter(tokenizer, request_templates=pool)
    body = {"messages": HELLO, "chat_template": STRING_TEMPLATE}
    assert counter.screen(Route.CHAT, body) is pool
    assert counter.screen(Route.CHAT, {"messages": HELLO}) is None
    assert counter.count(Route.CHAT, body).tokens == len(
        tokenizer.encode("<user>hello", add_special_tokens=False)
    )


def test_close_stops_the_workers_and_the_pool_starts_again(pool: RenderPool) -> None:
    render(pool, "warm")
    (pid,) = pool.worker_pids()
    pool.close()
    assert not alive(pid)
    assert pool.worker_pids() == []
    assert render(pool, "again") == RenderedChat("again", add_special_tokens=False)


def test_a_worker_that_cannot_load_is_the_gateways_fault(tmp_path: Path) -> None:
    broken = RenderPool(str(tmp_path / "no-tokenizer"), max_model_len=None, max_prompt_chars=None, workers=1)
    try:
        with pytest.raises(RenderPoolError, match="could not start"):
            render(broken, "x")
    finally:
        broken.close()
