"""The ledger: held and reserved blocks per request, credit, exact totals, balance to zero."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.demand import BlockCost, Demand
from gateway.ledger import InMemoryLedger, LedgerTotals

COST = BlockCost(block_size=16)


def demand(prompt: int = 20, expected: int = 30, cap: int = 100, samples: int = 1) -> Demand:
    return Demand(
        prompt_tokens=(prompt,),
        max_output_tokens=cap,
        expected_output_tokens=expected,
        samples_per_prompt=samples,
        cost=COST,
        shares_prefix=True,
    )


def test_open_books_prompt_as_held_and_expected_output_as_reserved() -> None:
    ledger = InMemoryLedger()
    entry = ledger.open(1, demand(prompt=20, expected=30), now=0.0)
    assert entry.held_blocks == 2  # 20 tokens
    assert entry.reserved_blocks == 4  # 50 tokens
    assert ledger.totals() == LedgerTotals(entries=1, reserved_blocks=4, held_blocks=2, credit_blocks=0)


@pytest.mark.parametrize(
    ("streamed", "held", "reserved"),
    [
        (0, 2, 4),
        (12, 2, 4),  # 32 tokens: still 2 blocks
        (13, 3, 4),  # 33 tokens
        (14, 3, 4),  # a block ahead of the stream (50 tokens) is still within the reservation
        (30, 4, 5),  # the reservation reached: a block ahead (66 tokens) needs a fifth block
        (44, 4, 5),  # 64 tokens held, 80 covered
        (60, 5, 6),
        (80, 7, 7),  # at the cap (100 output tokens): no further token to cover
    ],
)
def test_growth_moves_held_and_outgrows_reservation(streamed: int, held: int, reserved: int) -> None:
    ledger = InMemoryLedger()
    ledger.open(1, demand(prompt=20, expected=30, cap=80), now=0.0)
    ledger.grow(1, 0, streamed)
    totals = ledger.totals()
    assert (totals.held_blocks, totals.reserved_blocks) == (held, reserved)


def test_parallel_samples_grow_by_their_longest_sequence() -> None:
    ledger = InMemoryLedger()
    entry = ledger.open(1, demand(prompt=32, expected=0, cap=64, samples=2), now=0.0)
    # 32 prompt tokens: the first block shared (vLLM looks up prompt - 1 tokens in its prefix
    # cache), the second held by each sequence.
    assert entry.held_blocks == 1 + 2 * 1
    ledger.grow(1, 0, 1)
    ledger.grow(1, 1, 20)
    assert entry.output_tokens == [1, 20]
    # Both sequences counted at 20 tokens (conservative): 1 shared + 2 x 3 blocks.
    assert entry.held_blocks == 1 + 2 * 3
    ledger.grow(1, 5, 1)  # a choice index the demand did not predict: folded into the last
    assert entry.output_tokens == [1, 21]


def test_close_is_idempotent_and_reports_what_was_held() -> None:
    ledger = InMemoryLedger()
    ledger.open(7, demand(expected=10), now=1.5)
    ledger.grow(7, 0, 40)
    closed = ledger.close(7)
    assert closed is not None
    assert closed.output_tokens == (40,)
    assert closed.outgrew_reservation
    assert closed.admitted_at == 1.5
    assert ledger.close(7) is None
    assert ledger.totals() == LedgerTotals(0, 0, 0, 0)
    assert ledger.released_blocks == closed.held_blocks > 0  # counted once
    ledger.grow(7, 0, 5)  # late tokens of a closed entry are ignored
    assert ledger.totals() == LedgerTotals(0, 0, 0, 0)


def test_a_closed_entry_reached_what_it_held_if_streamed_else_what_it_reserved() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, demand(prompt=20, expected=60), now=0.0)
    ledger.grow(1, 0, 10)
    ledger.open(2, demand(prompt=20, expected=60), now=0.0, streamed=False)
    streamed, whole = ledger.close(1), ledger.close(2)
    assert streamed is not None
    assert whole is not None
    assert streamed.reached_blocks == streamed.held_blocks < streamed.reserved_blocks
    # An answer sent whole grew unseen: the most it may have reached is what it reserved.
    assert not whole.streamed
    assert whole.reached_blocks == whole.reserved_blocks > whole.held_blocks


def test_the_split_counts_what_entries_are_certain_still_to_grow_into() -> None:
    ledger = InMemoryLedger()
    # 20 prompt tokens (2 blocks), a floor of 60 output tokens: certain to reach 5 blocks.
    floored = Demand(
        prompt_tokens=(20,),
        max_output_tokens=100,
        expected_output_tokens=60,
        samples_per_prompt=1,
        cost=COST,
        floor_output_tokens=60,
    )
    ledger.open(1, floored, now=0.0)
    ledger.open(2, demand(prompt=20, expected=60), now=5.0)  # no floor: nothing certain
    assert ledger.held_split(settled_before=1.0).certain_growth_blocks == 3
    ledger.grow(1, 0, 30)  # 50 tokens: 4 blocks held
    assert ledger.held_split(settled_before=1.0).certain_growth_blocks == 1
    ledger.grow(1, 0, 40)  # past the floor: nothing left to be certain of
    assert ledger.held_split(settled_before=1.0).certain_growth_blocks == 0
    with pytest.raises(ValueError, match="floor"):
        replace(floored, floor_output_tokens=61)


def test_double_open_is_refused() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, demand(), now=0.0)
    with pytest.raises(KeyError):
        ledger.open(1, demand(), now=0.0)


def test_credit_applies_to_settled_entries_only_and_leaves_with_them() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, demand(prompt=160, expected=0), now=0.0)  # 10 blocks held
    ledger.open(2, demand(prompt=160, expected=0), now=5.0)  # fresh at the scrape
    split = ledger.held_split(settled_before=1.0)
    assert (split.settled_blocks, split.fresh_blocks, split.settled_sequences) == (10, 10, 1)
    ledger.set_credit(0.25, settled_before=1.0)
    totals = ledger.totals()
    assert totals.credit_blocks == 7  # floor(0.75 * 10)
    assert totals.committed_blocks == totals.reserved_blocks - 7
    ledger.close(1)
    assert ledger.totals().credit_blocks == 0
    with pytest.raises(ValueError, match="kept_fraction"):
        ledger.set_credit(1.5, settled_before=1.0)


# An operation on the ledger: open a key, grow one, close one. Any interleaving must leave
# every total at zero once every key is closed.
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("open"), st.integers(0, 9), st.integers(1, 300), st.integers(0, 200), st.integers(1, 3)
        ),
        st.tuples(st.just("grow"), st.integers(0, 9), st.integers(0, 3), st.integers(0, 100), st.just(0)),
        st.tuples(st.just("close"), st.integers(0, 9), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("credit"), st.integers(0, 100), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_ledger_returns_to_zero_after_any_interleaving(ops: list[tuple[str, int, int, int, int]]) -> None:
    ledger = InMemoryLedger()
    open_keys: set[int] = set()
    for step, (op, key, a, b, c) in enumerate(ops):
        if op == "open" and key not in open_keys:
            # Odd keys are answers sent whole: the ledger never sees them grow.
            ledger.open(
                key,
                demand(prompt=a, expected=min(b, 200), cap=200, samples=c),
                float(step),
                streamed=key % 2 == 0,
            )
            open_keys.add(key)
        elif op == "grow":
            ledger.grow(key, a, b)
        elif op == "close":
            closed = ledger.close(key)
            assert (closed is not None) == (key in open_keys)
            open_keys.discard(key)
        elif op == "credit":
            ledger.set_credit(key / 100, settled_before=float(step) / 2)
        totals = ledger.totals()
        # Totals are exact sums over the open entries, and never negative.
        entries = list(ledger.entries())
        assert totals.entries == len(entries) == len(open_keys)
        assert totals.reserved_blocks == sum(e.reserved_blocks for e in entries)
        assert totals.held_blocks == sum(e.held_blocks for e in entries)
        assert totals.credit_blocks == sum(e.credit_blocks for e in entries)
        assert totals.unseen_blocks == sum(
            e.reserved_blocks - e.held_blocks for e in entries if not e.streamed
        )
        # What the drain-rate projection reads, kept as a running sum rather than recomputed.
        assert ledger.remaining_output_tokens() == sum(
            max(1, e.demand.expected_output_tokens - e.longest_output) for e in entries
        )
        for entry in entries:
            assert 0 <= entry.credit_blocks <= entry.held_blocks <= entry.reserved_blocks
            if entry.longest_output:
                # What a grown entry reserves depends on its longest sequence alone, however
                # its growth came (the ledger skips the computation when it cannot change).
                peak = InMemoryLedger._reserved_for(entry.demand, entry.longest_output)
                assert entry.reserved_blocks == max(entry.demand.reserved_blocks, peak)
        assert totals.committed_blocks == totals.reserved_blocks - totals.credit_blocks
    for key in list(open_keys):
        ledger.close(key)
    assert ledger.totals() == LedgerTotals(0, 0, 0, 0)
    assert ledger.remaining_output_tokens() == 0
