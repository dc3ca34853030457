"""The counter hashes the full blocks of the ids it counted, and only when those are the ids
vLLM will run (the real testbed tokenizer and chat template)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from estimator.media import MediaProfile, MediaRule, Modality
from estimator.prefix import chained_block_hashes, prefix_seed
from estimator.tokens import PROBE_CHARS_PER_CONTEXT_TOKEN, Route, TokenCounter

CONTEXT = 1024
BLOCK = 32
SEED = prefix_seed("tiny", None)
SYSTEM = "You are the gateway's assistant. Answer briefly, cite the docs, and never guess. " * 3
PNG = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def counter(tokenizer: Any) -> TokenCounter:
    return TokenCounter(tokenizer, max_model_len=CONTEXT)


def _chat(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def _rendered_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The prompt's ids by the tokenizer's own chat path, independently of the counter."""
    ids: list[int] = tokenizer.apply_chat_template(
        body["messages"], tokenize=True, add_generation_prompt=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers answer a BatchEncoding
        ids = list(ids["input_ids"])
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _leading_equal(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_chats_sharing_their_first_messages_share_leading_hashes(
    counter: TokenCounter, tokenizer: Any
) -> None:
    first = _chat(("system", SYSTEM), ("user", "How do I reserve blocks?"))
    second = _chat(
        ("system", SYSTEM),
        ("user", "How do I reserve blocks?"),
        ("assistant", "With a budget."),
        ("user", "And release them?"),
    )
    a = counter.count(Route.CHAT, first, block_size=BLOCK, seed=SEED)
    b = counter.count(Route.CHAT, second, block_size=BLOCK, seed=SEED)
    ids_a, ids_b = _rendered_ids(tokenizer, first), _rendered_ids(tokenizer, second)
    assert a.tokens == len(ids_a)
    assert a.block_hashes == chained_block_hashes(ids_a, BLOCK, SEED)
    assert b.block_hashes == chained_block_hashes(ids_b, BLOCK, SEED)
    shared = _leading_equal(a.block_hashes, b.block_hashes)
    assert shared == _common_prefix(ids_a, ids_b) // BLOCK
    assert shared >= 2


def test_another_system_prompt_shares_no_hash(counter: TokenCounter) -> None:
    question = ("user", "How do I reserve blocks? " * 10)
    a = counter.count(Route.CHAT, _chat(("system", SYSTEM), question), block_size=BLOCK, seed=SEED)
    b = counter.count(
        Route.CHAT, _chat(("system", "Be verbose. " + SYSTEM), question), block_size=BLOCK, seed=SEED
    )
    assert len(a.block_hashes) >= 3
    assert len(b.block_hashes) >= 3
    assert not set(a.block_hashes) & set(b.block_hashes)


def test_another_seed_shares_no_hash(counter: TokenCounter) -> None:
    body = _chat(("system", SYSTEM), ("user", "hi"))
    a = counter.count(Route.CHAT, body, block_size=BLOCK, seed=prefix_seed("tiny", None))
    b = counter.count(Route.CHAT, body, block_size=BLOCK, seed=prefix_seed("tiny", "tenant"))
    assert a.block_hashes
    assert not set(a.block_hashes) & set(b.block_hashes)


def test_no_hashes_unless_asked(counter: TokenCounter) -> None:
    body = _chat(("system", SYSTEM), ("user", "hi"))
    assert counter.count(Route.CHAT, body).block_hashes == ()
    assert counter.count(Route.COMPLETIONS, {"prompt": SYSTEM}).block_hashes == ()


def test_the_count_is_the_same_with_or_without_hashes(counter: TokenCounter) -> None:
    for route, body in [
        (Route.CHAT, _chat(("system", SYSTEM), ("user", "hi"))),
        (Route.COMPLETIONS, {"prompt": [SYSTEM, "short"]}),
        (Route.COMPLETIONS, {"prompt": list(range(1, 100)), "truncate_prompt_tokens": 50}),
    ]:
        plain, hashed = counter.count(route, body), counter.count(route, body, block_size=16)
        assert (plain.per_prompt, plain.exact) == (hashed.per_prompt, hashed.exact)


def test_completion_text_hashes_the_tokenizer_ids_with_special_tokens(
    counter: TokenCounter, tokenizer: Any
) -> None:
    counted = counter.count(Route.COMPLETIONS, {"prompt": SYSTEM}, block_size=BLOCK, seed=SEED)
    ids = tokenizer.encode(SYSTEM, add_special_tokens=True)
    assert counted.block_hashes == chained_block_hashes(ids, BLOCK, SEED)
    bare = counter.count(
        Route.COMPLETIONS, {"prompt": SYSTEM, "add_special_tokens": False}, block_size=BLOCK, seed=SEED
    )
    assert bare.block_hashes == chained_block_hashes(
        tokenizer.encode(SYSTEM, add_special_tokens=False), BLOCK, SEED
    )
    assert len(counted.block_hashes) == counted.tokens // BLOCK


def test_completion_token_ids_are_hashed_as_given_and_only_the_first_prompt(counter: TokenCounter) -> None:
    first, second = list(range(1, 70)), list(range(100, 170))
    counted = counter.count(Route.COMPLETIONS, {"prompt": [first, second]}, block_size=BLOCK, seed=SEED)
    assert counted.per_prompt == (69, 70)
    assert counted.block_hashes == chained_block_hashes(first, BLOCK, SEED)
    mixed = counter.count(Route.COMPLETIONS, {"prompt": ["a b c", second]}, block_size=1, seed=SEED)
    assert len(mixed.block_hashes) == mixed.per_prompt[0]


def test_token_ids_need_no_tokenizer_but_text_does() -> None:
    approx = TokenCounter.approximate(max_model_len=CONTEXT)
    ids = list(range(1, 70))
    assert approx.count(Route.COMPLETIONS, {"prompt": ids}, block_size=BLOCK).block_hashes == (
        chained_block_hashes(ids, BLOCK)
    )
    text = approx.count(Route.COMPLETIONS, {"prompt": SYSTEM}, block_size=BLOCK)
    assert not text.exact
    assert text.block_hashes == ()
    chat = approx.count(Route.CHAT, _chat(("system", SYSTEM), ("user", "hi")), block_size=BLOCK)
    assert not chat.exact
    assert chat.block_hashes == ()


def test_media_parts_give_no_hashes(tokenizer: Any) -> None:
    counter = TokenCounter(
        tokenizer, max_model_len=CONTEXT, media=MediaProfile({Modality.IMAGE: MediaRule(300)})
    )
    parts = [{"type": "text", "text": SYSTEM}, {"type": "image_url", "image_url": {"url": PNG}}]
    counted = counter.count(Route.CHAT, {"messages": [{"role": "user", "content": parts}]}, block_size=BLOCK)
    assert counted.tokens > 300
    assert counted.block_hashes == ()
    text_only = counter.count(
        Route.CHAT, {"messages": [{"role": "user", "content": parts[:1]}]}, block_size=BLOCK
    )
    assert text_only.block_hashes


def test_a_text_too_long_for_the_context_gives_no_hashes(counter: TokenCounter) -> None:
    huge = "the gateway admits blocks " * (PROBE_CHARS_PER_CONTEXT_TOKEN * CONTEXT // 10)
    for route, body in [(Route.COMPLETIONS, {"prompt": huge}), (Route.CHAT, _chat(("user", huge)))]:
        counted = counter.count(route, body, block_size=BLOCK)
        assert counted.tokens > CONTEXT
        assert counted.block_hashes == ()


def test_a_long_prompt_that_was_tokenized_whole_is_capped_at_the_context(counter: TokenCounter) -> None:
    # Token ids are counted whole however many: the hashes stop at the context's blocks.
    ids = [7] * (CONTEXT * 3 + 5)
    counted = counter.count(Route.COMPLETIONS, {"prompt": ids}, block_size=BLOCK)
    assert len(counted.block_hashes) == CONTEXT // BLOCK
    odd = counter.count(Route.COMPLETIONS, {"prompt": ids}, block_size=100)
    assert len(odd.block_hashes) == -(-CONTEXT // 100)  # ceil(1024 / 100) = 11


def test_a_truncated_prompt_gives_no_hashes(counter: TokenCounter) -> None:
    ids = list(range(1, 100))
    cut = counter.count(Route.COMPLETIONS, {"prompt": ids, "truncate_prompt_tokens": 50}, block_size=BLOCK)
    assert cut.per_prompt == (50,)
    assert cut.block_hashes == ()
    uncut = counter.count(Route.COMPLETIONS, {"prompt": ids, "truncate_prompt_tokens": 500}, block_size=BLOCK)
    assert uncut.block_hashes == chained_block_hashes(ids, BLOCK)


def test_a_template_cut_at_max_length_gives_no_hashes(counter: TokenCounter) -> None:
    body = _chat(("system", SYSTEM), ("user", "hi"))
    body["chat_template_kwargs"] = {"tokenize": True, "truncation": True, "max_length": 40}
    cut = counter.count(Route.CHAT, body, block_size=BLOCK)
    assert cut.tokens == 40
    assert cut.block_hashes == ()


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(counter: TokenCounter, block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        counter.count(Route.COMPLETIONS, {"prompt": [1, 2, 3]}, block_size=block_size)


def test_hashing_is_thread_safe(counter: TokenCounter) -> None:
    bodies = [_chat(("system", SYSTEM), ("user", f"question {i} " * (i % 13 + 1))) for i in range(120)]
    serial = [counter.count(Route.CHAT, body, block_size=16).block_hashes for body in bodies]
    with ThreadPoolExecutor(max_workers=6) as pool:
        parallel = list(
            pool.map(lambda body: counter.count(Route.CHAT, body, block_size=16).block_hashes, bodies)
        )
    assert parallel == serial


@settings(max_examples=40)
@given(
    shared=st.lists(
        st.sampled_from(["blocks", "cache", "KV", "gateway", "数据", "\n"]), min_size=1, max_size=60
    ),
    tail_a=st.text(max_size=40),
    tail_b=st.text(max_size=40),
    block_size=st.integers(min_value=1, max_value=48),
)
def test_leading_equal_hashes_follow_the_rendered_ids(
    counter: TokenCounter, tokenizer: Any, shared: list[str], tail_a: str, tail_b: str, block_size: int
) -> None:
    system = " ".join(shared)
    first, second = _chat(("system", system), ("user", tail_a)), _chat(("system", system), ("user", tail_b))
    a = counter.count(Route.CHAT, first, block_size=block_size)
    b = counter.count(Route.CHAT, second, block_size=block_size)
    ids_a, ids_b = _rendered_ids(tokenizer, first), _rendered_ids(tokenizer, second)
    assert len(a.block_hashes) == len(ids_a) // block_size
    assert _leading_equal(a.block_hashes, b.block_hashes) == min(
        _common_prefix(ids_a, ids_b) // block_size, len(a.block_hashes), len(b.block_hashes)
    )
