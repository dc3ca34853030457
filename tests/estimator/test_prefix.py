"""Chained block hashes: equal leading full blocks give equal leading hashes, nothing else does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.prefix import chained_block_hashes, prefix_seed

token_lists = st.lists(st.integers(min_value=0, max_value=40), max_size=120)
block_sizes = st.integers(min_value=1, max_value=17)


def test_only_full_blocks_are_hashed() -> None:
    assert len(chained_block_hashes(list(range(10)), 4)) == 2
    assert len(chained_block_hashes(list(range(12)), 4)) == 3
    assert chained_block_hashes([1, 2, 3], 4) == ()
    assert chained_block_hashes([], 1) == ()


def test_max_blocks_caps_the_count() -> None:
    ids = list(range(40))
    assert chained_block_hashes(ids, 4, max_blocks=3) == chained_block_hashes(ids, 4)[:3]
    assert chained_block_hashes(ids, 4, max_blocks=0) == ()
    assert chained_block_hashes(ids, 4, max_blocks=99) == chained_block_hashes(ids, 4)


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        chained_block_hashes([1, 2, 3], block_size)


def test_max_blocks_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        chained_block_hashes([1, 2, 3], 1, max_blocks=-1)


def test_a_block_hash_depends_on_its_parents_not_only_its_tokens() -> None:
    # The same second block after different first blocks: vLLM keys them apart too.
    first = chained_block_hashes([1, 1, 7, 7], 2)
    second = chained_block_hashes([2, 2, 7, 7], 2)
    assert first[1] != second[1]


def test_sequences_and_tuples_hash_alike() -> None:
    assert chained_block_hashes([5, 6, 7, 8], 2) == chained_block_hashes((5, 6, 7, 8), 2)


@given(ids=token_lists, block_size=block_sizes, seed=st.integers())
def test_count_is_the_number_of_full_blocks(ids: list[int], block_size: int, seed: int) -> None:
    assert len(chained_block_hashes(ids, block_size, seed)) == len(ids) // block_size


@given(ids=token_lists, block_size=block_sizes, cut=st.integers(min_value=0, max_value=130))
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(ids: list[int], block_size: int, cut: int) -> None:
    whole = chained_block_hashes(ids, block_size, 7)
    assert chained_block_hashes(ids[:cut], block_size, 7) == whole[: min(cut, len(ids)) // block_size]


@given(
    shared=token_lists,
    left=token_lists,
    right=token_lists,
    block_size=block_sizes,
)
def test_leading_equal_hashes_are_exactly_the_leading_equal_full_blocks(
    shared: list[int], left: list[int], right: list[int], block_size: int
) -> None:
    a, b = shared + left, shared + right
    ha, hb = chained_block_hashes(a, block_size), chained_block_hashes(b, block_size)
    # The first differing token (or the end of the shorter list) bounds the equal full blocks.
    first_difference = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    equal_blocks = min(first_difference // block_size, len(ha), len(hb))
    assert ha[:equal_blocks] == hb[:equal_blocks]
    # From the first block that differs on, no hash agrees (a 64-bit collision aside).
    for i in range(equal_blocks, min(len(ha), len(hb))):
        assert ha[i] != hb[i]


@given(ids=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=60), block_size=block_sizes)
def test_another_seed_shares_no_hash(ids: list[int], block_size: int) -> None:
    one = chained_block_hashes(ids, block_size, prefix_seed("m", None))
    other = chained_block_hashes(ids, block_size, prefix_seed("m", "tenant-a"))
    assert not set(one) & set(other)


def test_the_seed_separates_models_adapters_and_salts() -> None:
    seeds = {
        prefix_seed("tiny", None),
        prefix_seed("tiny-lora", None),
        prefix_seed("tiny", "alice"),
        prefix_seed("tiny", "bob"),
        prefix_seed("tiny-lora", "alice"),
    }
    assert len(seeds) == 5
    assert prefix_seed("tiny", "alice") == prefix_seed("tiny", "alice")


def test_an_empty_salt_is_no_salt() -> None:
    # vLLM adds the salt to the first block's keys only when it is truthy.
    assert prefix_seed("tiny", "") == prefix_seed("tiny", None)
