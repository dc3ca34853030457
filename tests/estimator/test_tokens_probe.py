"""A prompt far longer than the context is counted by its beginning (TokenCounter._encode_ids):
the count is then a lower bound that already exceeds the context, which is all that decides
such a request (vLLM refuses it, or truncates it to the context). The work stays bounded by
the context, not by the body, and a prompt that fits is still counted exactly."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from estimator.tokens import PROBE_CHARS_PER_CONTEXT_TOKEN, PROBE_MARGIN_TOKENS, Route, TokenCounter

CONTEXT = 1024


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class RecordingTokenizer:
    """The real tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.chat_template = inner.chat_template
        self.encoded: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        ids: list[int] = self._inner.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._inner.apply_chat_template(conversation, **kwargs)

    def get_vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = self._inner.get_vocab()
        return vocab

    def __deepcopy__(self, memo: Any) -> RecordingTokenizer:
        return self  # one recorder for every thread's copy


def words(count: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocabulary = ["the", "gateway", "admits", "blocks", "of", "KV", "cache", "κόσμε", "数据", "1234", "\n"]
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def test_a_megabyte_prompt_is_counted_by_its_beginning(tokenizer: Any) -> None:
    recorder = RecordingTokenizer(tokenizer)
    counter = TokenCounter(recorder, max_model_len=CONTEXT)
    prompt = words(400_000)  # about 2.5 MB
    count = counter.count(Route.COMPLETIONS, {"prompt": prompt}).tokens
    assert count >= CONTEXT + PROBE_MARGIN_TOKENS
    assert max(recorder.encoded) <= PROBE_CHARS_PER_CONTEXT_TOKEN * CONTEXT  # the whole was never encoded
    assert len(tokenizer.encode(prompt)) >= CONTEXT  # and it really does not fit


def test_a_long_chat_message_is_counted_by_its_beginning(tokenizer: Any) -> None:
    recorder = RecordingTokenizer(tokenizer)
    counter = TokenCounter(recorder, max_model_len=CONTEXT)
    body = {"messages": [{"role": "user", "content": words(300_000, seed=1)}]}
    assert counter.count(Route.CHAT, body).tokens >= CONTEXT + PROBE_MARGIN_TOKENS
    assert max(recorder.encoded) <= PROBE_CHARS_PER_CONTEXT_TOKEN * CONTEXT


def test_truncation_still_gets_exactly_the_context(tokenizer: Any) -> None:
    counter = TokenCounter(tokenizer, max_model_len=CONTEXT)
    body = {"prompt": words(200_000, seed=2), "truncate_prompt_tokens": 500}
    assert counter.count(Route.COMPLETIONS, body).tokens == 500


def test_long_text_of_few_tokens_is_counted_whole(tokenizer: Any) -> None:
    # Many characters per token (a run of one character, merged into long pieces): longer than
    # the probe, and still within the context. Its count must be the exact one.
    counter = TokenCounter(tokenizer, max_model_len=CONTEXT)
    prompt = "=" * (3 * PROBE_CHARS_PER_CONTEXT_TOKEN * CONTEXT)
    exact = len(tokenizer.encode(prompt))
    assert counter.count(Route.COMPLETIONS, {"prompt": prompt}).tokens == exact


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=100, max_value=6000),
    st.integers(min_value=0, max_value=10_000),
    st.sampled_from([1, 2, 4, 8, 16]),
)
def test_the_beginning_never_overstates_what_decides(
    tokenizer: Any, count: int, seed: int, repeat: int
) -> None:
    """Whatever the text, the counter's answer is exact when the text fits the context, and
    otherwise at least the context, as the whole text's exact count is."""
    rng = random.Random(seed)
    pieces = ["a", "aa", " ", "the ", "数据", "κόσμε ", "\n", "1", "==", "<s>", "▁"]
    text = "".join(rng.choice(pieces) * rng.randint(1, repeat) for _ in range(count))
    if not text:
        return
    counter = TokenCounter(tokenizer, max_model_len=256)
    got = counter.count(Route.COMPLETIONS, {"prompt": text}).tokens
    exact = len(tokenizer.encode(text))
    if exact < 256:
        assert got == exact
    else:
        assert got >= 256
