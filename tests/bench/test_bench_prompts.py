"""Prompt synthesis: exact token counts and prefixes that really share tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.counting import eos_token_id, local_counter
from bench.prompts import CANDIDATE_WORDS, PromptError, PromptFactory
from bench.workload import RequestSpec, load_trace, scale_lengths

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"


def words_plus_bos(text: str) -> int:
    """A stand-in tokenizer: one token per word plus a BOS token."""
    return len(text.split()) + 1


def test_calibration_learns_overhead_and_drops_multi_token_words() -> None:
    def count(text: str) -> int:
        # 'people' costs two tokens wherever it stands
        return words_plus_bos(text) + text.split().count("people")

    factory = PromptFactory.calibrate(count, seed=0, block_tokens=16)
    assert factory.overhead == 1
    assert "people" not in factory.words
    assert set(factory.words) == set(CANDIDATE_WORDS) - {"people"}
    assert factory.min_prompt_tokens == 2


@pytest.mark.parametrize("tokens", [2, 3, 17, 512, 1000])
def test_prompts_have_exact_counts(tokens: int) -> None:
    factory = PromptFactory.calibrate(words_plus_bos, seed=0, block_tokens=16)
    text, counted = factory.text_for(RequestSpec(0.0, tokens, 5), index=3)
    assert counted == tokens == words_plus_bos(text)


def test_too_short_requests_get_the_shortest_possible_prompt() -> None:
    factory = PromptFactory.calibrate(words_plus_bos, seed=0, block_tokens=16)
    text, counted = factory.text_for(RequestSpec(0.0, 1, 5), index=0)
    assert counted == 2
    assert len(text.split()) == 1


def test_shared_blocks_give_shared_text_and_distinct_requests_differ() -> None:
    factory = PromptFactory.calibrate(words_plus_bos, seed=0, block_tokens=8)
    a, _ = factory.text_for(RequestSpec(0.0, 30, 1, prefix_blocks=(1, 2, 3, 4)), index=0)
    b, _ = factory.text_for(RequestSpec(0.0, 30, 1, prefix_blocks=(1, 2, 9, 10)), index=1)
    c, _ = factory.text_for(RequestSpec(0.0, 30, 1), index=2)
    d, _ = factory.text_for(RequestSpec(0.0, 30, 1), index=3)
    assert a.split()[:16] == b.split()[:16]
    assert a.split()[16:] != b.split()[16:]
    assert c.split()[:8] != d.split()[:8]
    # the same seed builds the same texts; another seed other texts
    again = PromptFactory.calibrate(words_plus_bos, seed=0, block_tokens=8)
    assert again.text_for(RequestSpec(0.0, 30, 1, prefix_blocks=(1, 2, 3, 4)), 0)[0] == a
    other = PromptFactory.calibrate(words_plus_bos, seed=1, block_tokens=8)
    assert other.text_for(RequestSpec(0.0, 30, 1, prefix_blocks=(1, 2, 3, 4)), 0)[0] != a


def test_a_count_off_by_one_is_repaired_at_the_tail() -> None:
    def count(text: str) -> int:
        # long texts cost one token more than their words: not seen during calibration
        words = len(text.split())
        return words + (1 if words > 300 else 0)

    factory = PromptFactory.calibrate(count, seed=0, block_tokens=16)
    text, counted = factory.text_for(RequestSpec(0.0, 400, 1, prefix_blocks=(5,)), index=0)
    assert counted == 400 == count(text)
    assert text.split()[:16] == list(factory._block(5))


def test_a_first_word_tokenized_apart_gets_a_fixed_lead_word() -> None:
    def count(text: str) -> int:
        # like a chat template that glues the content to a tag: the first word's cost depends
        # on the word; every later word costs one token
        words = text.split()
        return 5 + (len(words[0]) % 3 + 1 if words else 0) + max(0, len(words) - 1)

    factory = PromptFactory.calibrate(count, seed=0, block_tokens=8)
    assert factory.lead == "the"
    assert factory.overhead == 5 + 1  # the template, and 'the' at the start (3 % 3 + 1)
    for tokens in (7, 8, 40):
        text, counted = factory.text_for(RequestSpec(0.0, tokens, 1, prefix_blocks=(3,)), 0)
        assert counted == tokens == count(text)
        assert text.split()[0] == "the"
        assert text.split()[1:9] == list(factory._block(3))[: tokens - 6]


def test_non_additive_tokenizers_are_refused() -> None:
    with pytest.raises(PromptError, match="additive"):
        # one token per word in a run of one word, but mixed words merge now and then
        PromptFactory.calibrate(
            lambda text: len(text.split()) + len(set(text.split())) // 10, seed=0, block_tokens=8
        )
    with pytest.raises(PromptError, match="single tokens"):
        PromptFactory.calibrate(lambda text: 2 * len(text.split()), seed=0, block_tokens=8)


def test_real_tokenizer_counts_are_exact_and_prefixes_share_token_ids(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    count = local_counter(tiny_model_dir, "completions", "tiny-llama")
    work = scale_lengths(load_trace(FIXTURES / "mooncake_sample.jsonl"), ctx_scale=0.1)
    factory = PromptFactory.calibrate(count, seed=0, block_tokens=work.block_tokens)
    assert len(factory.words) > 200
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = []
    for i, spec in enumerate(work.requests):
        text, counted = factory.text_for(spec, i)
        assert counted == spec.prompt_tokens
        ids.append(tokenizer.encode(text))
        assert len(ids[-1]) == spec.prompt_tokens
    # rows 4 and 6 share 5 blocks of 51 tokens, row 5 the same 5 blocks then its own block
    shared = 5 * work.block_tokens
    assert ids[3][:shared] == ids[5][:shared] == ids[6][:shared]
    assert ids[3] == ids[6]  # same hash ids and the same length
    assert ids[3][shared:] != ids[5][shared:]
    assert eos_token_id(tiny_model_dir) == 2
