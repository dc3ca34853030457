"""Request chat templates against the real vLLM 0.32: kvgate answers what vLLM answers.

- The shared testbed does not trust request templates (vLLM's default): a template in the body
  or in `chat_template_kwargs` (an empty one too) gets 400 from vLLM, and the same 400 from
  kvgate with trust_request_chat_template off, before anything is rendered or forwarded.
- A testbed started with `--trust-request-chat-template` (KVGATE_TEST_VLLM_TRUSTED_URL, else one
  is started for the module): kvgate with the setting on counts such requests exactly as vLLM's
  usage.prompt_tokens, body-level and kwargs-level, string and content-part templates; a
  template that raises is 400 from both. Bombs are sent to kvgate only: its workers refuse them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import testbed
from faultkit import Served, free_port, served_gateway

from estimator.tokens import UNTRUSTED_TEMPLATE_MESSAGE, Route, TokenCounter
from gateway.discovery import load_token_counter

pytestmark = pytest.mark.vllm

TRUSTED_URL_ENV = "KVGATE_TEST_VLLM_TRUSTED_URL"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
STRING_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
PARTS_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
MAX_BODY_BYTES = 8 * 1024 * 1024
# The shared testbed answers /metrics slowly under other helpers' load: a budget that goes stale
# at once would turn these comparisons into 503s.
PATIENT_BUDGET: dict[str, Any] = {"metrics_poll_interval_s": 0.2, "metrics_stale_after_s": 3.0}

# Sent to vLLM (no --trust-request-chat-template) and to kvgate with trust off: 400 from both.
REFUSED: list[Any] = [
    pytest.param({"chat_template": STRING_TEMPLATE}, id="body"),
    pytest.param({"chat_template": "{{ 1/0 }}"}, id="body-raising"),
    pytest.param({"chat_template": ""}, id="body-empty"),
    pytest.param({"chat_template_kwargs": {"chat_template": STRING_TEMPLATE}}, id="kwargs"),
    pytest.param({"chat_template_kwargs": {"chat_template": 5}}, id="kwargs-not-a-string"),
]
# Sent to both: no template, served by both.
SERVED: list[Any] = [
    pytest.param({"chat_template": None}, id="body-null"),
    pytest.param({"chat_template_kwargs": {"chat_template": None}}, id="kwargs-null"),
]
# Trusted: counted by kvgate as vLLM counts them.
TRUSTED: list[Any] = [
    pytest.param({"chat_template": STRING_TEMPLATE}, id="body-string-template"),
    pytest.param({"chat_template": PARTS_TEMPLATE}, id="body-content-parts-template"),
    pytest.param({"chat_template_kwargs": {"chat_template": STRING_TEMPLATE}}, id="kwargs-string-template"),
    pytest.param(
        {"chat_template": STRING_TEMPLATE, "chat_template_kwargs": {"chat_template": PARTS_TEMPLATE}},
        id="body-outranks-kwargs",
    ),
    pytest.param({"chat_template": ""}, id="empty-means-the-models"),
]
RAISING: list[Any] = [
    pytest.param({"chat_template": "{{ 1/0 }}"}, id="division-by-zero"),
    pytest.param({"chat_template": "{{ raise_exception('not this role') }}"}, id="raise-exception"),
    pytest.param({"chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}}, id="kwargs-division-by-zero"),
]


def chat(base: str, fields: dict[str, Any], messages: list[dict[str, Any]] = HELLO) -> httpx.Response:
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 1, **fields}
    return httpx.post(f"{base}{CHAT}", json=body, timeout=60)


@pytest.fixture(scope="module")
def counter(tiny_model_dir: Path) -> TokenCounter:
    return TokenCounter.from_pretrained(tiny_model_dir, max_model_len=1024)


@pytest.fixture(scope="module")
def untrusting(vllm_url: str, counter: TokenCounter) -> Iterator[Served]:
    with served_gateway(vllm_url, counter=counter, **PATIENT_BUDGET) as kvgate:
        yield kvgate


@pytest.mark.parametrize("fields", REFUSED)
def test_untrusted_templates_are_refused_as_vllm_refuses_them(
    vllm_url: str, untrusting: Served, fields: dict[str, Any]
) -> None:
    direct, through = chat(vllm_url, fields), chat(untrusting.url, fields)
    assert direct.status_code == through.status_code == 400, (direct.text, through.text)
    assert "--trust-request-chat-template is not set" in direct.json()["error"]["message"]
    error = through.json()["error"]
    assert error["code"] == "untrusted_chat_template"
    assert error["message"] == UNTRUSTED_TEMPLATE_MESSAGE


@pytest.mark.parametrize("fields", SERVED)
def test_absent_templates_are_served_by_both(
    vllm_url: str, untrusting: Served, fields: dict[str, Any]
) -> None:
    direct, through = chat(vllm_url, fields), chat(untrusting.url, fields)
    assert direct.status_code == through.status_code == 200, (direct.text, through.text)
    assert through.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def trusted_vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A vLLM testbed started with --trust-request-chat-template."""
    log_dir = tmp_path_factory.mktemp("vllm-trusted")
    with testbed.serving(TRUSTED_URL_ENV, log_dir, ["--trust-request-chat-template"], free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def trusting_counter(tiny_model_dir: Path) -> Iterator[TokenCounter]:
    counter, _ = load_token_counter(
        [str(tiny_model_dir)],
        max_model_len=1024,
        trust_request_chat_template=True,
        max_body_bytes=MAX_BODY_BYTES,
    )
    try:
        yield counter
    finally:
        counter.close()


@pytest.fixture(scope="module")
def trusting(trusted_vllm_url: str, trusting_counter: TokenCounter) -> Iterator[Served]:
    with served_gateway(
        trusted_vllm_url,
        counter=trusting_counter,
        trust_request_chat_template=True,
        max_body_bytes=MAX_BODY_BYTES,
        **PATIENT_BUDGET,
    ) as kvgate:
        yield kvgate


@pytest.mark.parametrize("fields", TRUSTED)
@pytest.mark.parametrize(
    "messages",
    [
        pytest.param(HELLO, id="one-message"),
        pytest.param(
            [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}],
                },
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and again"},
            ],
            id="parts-and-turns",
        ),
    ],
)
def test_trusted_templates_are_counted_as_vllm_counts_them(
    trusted_vllm_url: str,
    trusting: Served,
    trusting_counter: TokenCounter,
    fields: dict[str, Any],
    messages: list[dict[str, Any]],
) -> None:
    direct = chat(trusted_vllm_url, fields, messages)
    assert direct.status_code == 200, direct.text
    expected = direct.json()["usage"]["prompt_tokens"]
    body = {"model": "tiny-llama", "messages": messages, **fields}
    assert trusting_counter.count(Route.CHAT, body).tokens == expected
    through = chat(trusting.url, fields, messages)
    assert through.status_code == 200, through.text
    assert through.json()["usage"]["prompt_tokens"] == expected


@pytest.mark.parametrize("fields", RAISING)
def test_a_raising_trusted_template_is_a_400_from_both(
    trusted_vllm_url: str, trusting: Served, fields: dict[str, Any]
) -> None:
    direct, through = chat(trusted_vllm_url, fields), chat(trusting.url, fields)
    assert direct.status_code == through.status_code == 400, (direct.text, through.text)
    assert through.json()["error"]["code"] == "chat_template_error"


def test_a_trusted_bomb_is_refused_by_kvgate_and_never_forwarded(trusting: Served) -> None:
    """Sent to kvgate only: the 10 GB it asks for would be vLLM's problem otherwise."""
    response = chat(trusting.url, {"chat_template": "{{ 'a' * 10**10 }}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "chat_template_too_costly"
    newest = trusting.call(lambda: trusting.gateway.recent.latest()[0])
    assert (newest.outcome, newest.code, newest.prompt_tokens) == (
        "rejected_invalid",
        "chat_template_too_costly",
        None,  # refused while counting: never admitted, never forwarded
    )
