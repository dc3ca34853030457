"""Hostile chat templates and large bodies never freeze, pin or crash the gateway.

- Tokenization never blocks the loop: while a body of several MB is being counted in the
  tokenizer pool (held there on purpose until the test lets it go), a small request is counted
  inline and answered, and /healthz answers; the order of events is asserted, not durations.
- Template bombs against a real `kvgate serve`: with trust off each is refused at once
  (untrusted_chat_template) and nothing renders; with trust on each is a 400 from the bounded
  render workers. Either way the process lives, serves on, and its peak resident memory grows
  by less than RENDER_MEMORY_BYTES, nowhere near what the templates ask for (10 GB to 100 GB).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import KvgateProcess, kvgate_process, poll_until, served_gateway, tokenizer_dir
from transformers import AutoTokenizer

from estimator.tokens import TokenCounter
from gateway.render_pool import RENDER_MEMORY_BYTES, RENDER_WORKERS
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import SimServer, running_sim_server

INSTANT = EngineConfig(step_cost=StepCost(base_s=0.0, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0))
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
GATE_CHARS = 1_000_000
WAIT_S = 120.0

# What each template asks for, and the code of the 400 a trusting gateway answers it with.
BOMBS: list[tuple[str, dict[str, Any], str]] = [
    ("division-by-zero", {"chat_template": "{{ 1/0 }}"}, "chat_template_error"),
    ("10-GB-string", {"chat_template": "{{ 'a' * 10**10 }}"}, "chat_template_too_costly"),
    (
        "nested-loops",
        {
            "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
        },
        "chat_template_too_costly",
    ),
    (
        "deep-recursion",
        {"chat_template": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"},
        "chat_template_too_costly",
    ),
    ("1-GB-center", {"chat_template": "{{ 'x' | center(10**9) }}"}, "chat_template_too_costly"),
    ("1-GB-format", {"chat_template": "{{ '%0999999999d' | format(1) }}"}, "chat_template_too_costly"),
    (
        "huge-kwarg",
        {
            "chat_template_kwargs": {
                "chat_template": "{% for i in range(100000) %}{{ big }}{% endfor %}",
                "big": "y" * 1_000_000,
            }
        },
        "chat_template_too_costly",
    ),
]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with running_sim_server(SimConfig(engine=INSTANT)) as server:
        yield server


class GatedTokenizer:
    """The real tokenizer, except that encoding more than GATE_CHARS characters first sets
    `entered` and waits for `release`: the test decides when a large count ends. Its copies (one
    per counting thread) share the two events."""

    def __init__(self, inner: Any, entered: threading.Event, release: threading.Event) -> None:
        self.inner = inner
        self.entered = entered
        self.release = release

    @property
    def chat_template(self) -> Any:
        return self.inner.chat_template

    def get_vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = self.inner.get_vocab()
        return vocab

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self.inner.apply_chat_template(conversation, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GATE_CHARS:
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the large count"
        ids: list[int] = self.inner.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def __deepcopy__(self, memo: dict[int, Any]) -> GatedTokenizer:
        return GatedTokenizer(copy.deepcopy(self.inner, memo), self.entered, self.release)


def test_a_large_count_in_the_pool_never_holds_a_small_one_on_the_loop(sim: SimServer) -> None:
    """With one tokenizer behind a lock, the small inline count would wait for the lock the
    large count holds, and with it the whole event loop: the small request would not be
    answered until the large count ended."""
    entered, release = threading.Event(), threading.Event()
    counter = TokenCounter(
        GatedTokenizer(AutoTokenizer.from_pretrained(str(tokenizer_dir())), entered, release)
    )
    large = {"model": "tiny-llama", "prompt": "word " * GATE_CHARS, "max_tokens": 1}  # 5 MB
    small = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 1}
    with served_gateway(sim.url, counter=counter) as kvgate, ThreadPoolExecutor(1) as client:
        counter.prepare_thread(kvgate.call(threading.get_ident))  # as discovery does for the loop
        try:
            big = client.submit(httpx.post, f"{kvgate.url}/v1/completions", json=large, timeout=WAIT_S)
            assert entered.wait(WAIT_S), "the large body never reached the tokenizer"
            assert kvgate.call(lambda: kvgate.gateway.preparer._pending_counts) == 1  # it is in the pool
            answered = httpx.post(f"{kvgate.url}/v1/completions", json=small, timeout=30)
            health = httpx.get(f"{kvgate.url}/healthz", timeout=30)
            still_counting = not big.done()
        finally:
            release.set()
        assert answered.status_code == 200, answered.text
        assert health.status_code == 200
        assert still_counting, "the large count ended before the small request was answered"
        assert big.result().status_code < 500
        assert counter.tokenizer_copies == 2  # the loop's and one pool thread's


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def children(pid: int) -> list[int]:
    """The child processes of `pid`, whichever of its threads started them."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue  # the thread ended meanwhile
    return found


def post_bomb(kvgate: KvgateProcess, fields: dict[str, Any]) -> httpx.Response:
    body = {"model": "tiny-llama", "messages": HELLO, "max_tokens": 1, **fields}
    return httpx.post(f"{kvgate.url}{CHAT}", json=body, timeout=WAIT_S)


def warm(kvgate: KvgateProcess) -> None:
    poll_until(lambda: httpx.get(f"{kvgate.url}/readyz", timeout=5).status_code == 200, 60, "kvgate ready")
    ok = httpx.post(
        f"{kvgate.url}{CHAT}", json={"model": "tiny-llama", "messages": HELLO, "max_tokens": 1}, timeout=30
    )
    assert ok.status_code == 200, ok.text


def test_template_bombs_with_trust_off_are_refused_and_nothing_renders(
    sim: SimServer, tmp_path: Path
) -> None:
    with kvgate_process(sim.url, tmp_path / "kvgate.log") as kvgate:
        warm(kvgate)
        before = peak_rss_bytes(kvgate.pid)
        for name, fields, _ in BOMBS:
            response = post_bomb(kvgate, fields)
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["code"] == "untrusted_chat_template", (name, error)
            assert "trust_request_chat_template" in error["message"]
        assert children(kvgate.pid) == []  # no render worker was ever started
        assert peak_rss_bytes(kvgate.pid) - before < RENDER_MEMORY_BYTES
        warm(kvgate)


def test_template_bombs_with_trust_on_are_400s_within_the_bounds(sim: SimServer, tmp_path: Path) -> None:
    with kvgate_process(
        sim.url, tmp_path / "kvgate.log", settings={"trust_request_chat_template": True}
    ) as kvgate:
        warm(kvgate)
        before = peak_rss_bytes(kvgate.pid)
        for name, fields, code in BOMBS:
            response = post_bomb(kvgate, fields)
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["code"] == code, (name, response.text)
            assert len(children(kvgate.pid)) <= RENDER_WORKERS
        assert peak_rss_bytes(kvgate.pid) - before < RENDER_MEMORY_BYTES
        assert kvgate.process.poll() is None
        warm(kvgate)
        assert "Traceback" not in kvgate.output()
