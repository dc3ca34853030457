"""The ledger: held and reserved blocks per request, credit, exact totals, balance to zero."""

from __future__ import annotations

import random
from statistics import NormalDist

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.demand import BlockCost, Demand
from gateway.ledger import (
    REBALANCE_ON_CLOSE_MAX_ENTRIES,
    InMemoryLedger,
    LedgerEntry,
    LedgerTotals,
    projected_peak_blocks,
    remaining_moments,
)
from gateway.output_model import OutputDistribution

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


# Output lengths some requests were learned from, for pooling.
OUTLOOK = OutputDistribution([0, 3, 8, 20, 20, 45, 60, 90, 150, 199, 250])


@pytest.mark.parametrize(
    ("multiplex", "pooling"), [(False, False), (True, False), (False, True), (True, True)]
)
@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_ledger_returns_to_zero_after_any_interleaving(
    multiplex: bool, pooling: bool, ops: list[tuple[str, int, int, int, int]]
) -> None:
    ledger = InMemoryLedger(multiplex=multiplex, pooling_z=1.28 if pooling else None)
    open_keys: set[int] = set()
    # Growth moves one request along without the others (in vLLM all decode together), so the
    # projection holds from the next recomputation on: a close or a new credit.
    grown_since_rebalance = False
    for step, (op, key, a, b, c) in enumerate(ops):
        if op == "open" and key not in open_keys:
            outlook = OUTLOOK if pooling and key % 2 == 0 else None  # some requests have none
            ledger.open(key, demand(prompt=a, expected=min(b, 200), cap=200, samples=c), float(step), outlook)
            open_keys.add(key)
        elif op == "grow":
            ledger.grow(key, a, b)
            grown_since_rebalance = grown_since_rebalance or (key in open_keys and b > 0)
        elif op == "close":
            closed = ledger.close(key)
            assert (closed is not None) == (key in open_keys)
            open_keys.discard(key)
            grown_since_rebalance = grown_since_rebalance and closed is None
        elif op == "credit":
            ledger.set_credit(key / 100, settled_before=float(step) / 2)
            grown_since_rebalance = False
        totals = ledger.totals()
        # Totals are exact sums over the open entries, and never negative.
        entries = list(ledger.entries())
        assert totals.entries == len(entries) == len(open_keys)
        assert totals.reserved_blocks == sum(e.reserved_blocks for e in entries)
        assert totals.held_blocks == sum(e.held_blocks for e in entries)
        assert totals.credit_blocks == sum(e.credit_blocks for e in entries)
        # What the drain-rate projection reads, kept as a running sum rather than recomputed.
        assert ledger.remaining_output_tokens() == sum(
            max(1, e.demand.expected_output_tokens - e.longest_output) for e in entries
        )
        for entry in entries:
            assert 0 <= entry.credit_blocks <= entry.held_blocks <= entry.reserved_blocks
        # Multiplexed, the commitment lies between the set's projected peak and the sum of
        # its reservations (net of credit); pooled, between what the set holds and that sum;
        # with neither, it is that sum.
        net = totals.reserved_blocks - totals.credit_blocks
        if multiplex or pooling:
            assert totals.held_blocks - totals.credit_blocks <= totals.committed_blocks <= net
            if multiplex and not pooling and not grown_since_rebalance:
                assert brute_force_peak(entries) <= totals.committed_blocks
        else:
            assert totals.committed_blocks == net
        if not pooling:
            assert totals.pooling_blocks == 0
    for key in list(open_keys):
        ledger.close(key)
    assert ledger.totals() == LedgerTotals(0, 0, 0, 0)
    assert ledger.remaining_output_tokens() == 0


def brute_force_peak(entries: list[LedgerEntry]) -> int:
    """The projected peak step by step: every entry grows one output token per step (per
    sequence) up to its reservation and holds that until its end, then frees it."""
    if not entries:
        return 0
    ends = [max(1, e.demand.expected_output_tokens - e.longest_output) for e in entries]
    peak = 0
    for step in range(max(ends) + 1):
        total = 0
        for entry, end in zip(entries, ends, strict=True):
            if end < step:
                continue
            demand = entry.demand
            grown = demand.blocks_at(min(entry.longest_output + step, demand.max_output_tokens))
            held = entry.reserved_blocks if step >= end else min(entry.reserved_blocks, grown)
            total += held - entry.credit_blocks
        peak = max(peak, total)
    return peak


def test_the_projected_peak_is_where_requests_end_not_the_sum_of_their_peaks() -> None:
    ledger = InMemoryLedger(multiplex=True)
    # 16-token blocks. One request ends in 10 steps at 12 blocks (150 of 160 tokens streamed:
    # its reservation now covers a block ahead); one just began and reaches 11 at its end.
    ledger.open(1, demand(prompt=16, expected=160, cap=512), now=0.0)
    ledger.grow(1, 0, 150)
    ledger.open(2, demand(prompt=16, expected=160, cap=512), now=0.0)
    assert ledger.totals().committed_blocks == 23  # until rebalanced: the sum of the peaks
    ledger.rebalance()
    # The peak is at the first one's end: its 12 blocks plus the 2 the other holds by then.
    assert ledger.totals().committed_blocks == 12 + 2 == projected_peak_blocks(list(ledger.entries()))
    ledger.close(1)  # few in flight: a close recomputes at once
    assert ledger.totals().committed_blocks == 11
    assert InMemoryLedger().totals().multiplex_blocks == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(0, 200), st.integers(0, 250), st.integers(1, 3)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 4),
)
def test_the_projected_peak_never_falls_below_the_step_by_step_peak(
    requests: list[tuple[int, int, int, int]], breakpoints: int
) -> None:
    ledger = InMemoryLedger()
    for key, (prompt, expected, streamed, samples) in enumerate(requests):
        ledger.open(key, demand(prompt=prompt, expected=expected, cap=200, samples=samples), now=0.0)
        ledger.grow(key, 0, streamed)
    entries = list(ledger.entries())
    exact = brute_force_peak(entries)
    assert projected_peak_blocks(entries) == exact  # few distinct ends: evaluated at each
    thinned = projected_peak_blocks(entries, breakpoints)
    assert exact <= thinned <= sum(e.reserved_blocks - e.credit_blocks for e in entries)


def test_remaining_moments_follow_the_outlook_given_the_progress() -> None:
    outlook = OutputDistribution([16, 32, 48, 64, 400])
    ledger = InMemoryLedger(pooling_z=1.0)
    # 16-token blocks. Two sequences; the shortest decides how far the request is.
    entry = ledger.open(1, demand(prompt=16, expected=48, cap=100, samples=2), 0.0, outlook)
    ledger.grow(1, 0, 40)
    ledger.grow(1, 1, 20)
    mean, variance = remaining_moments(entry)
    # Beyond 20 tokens: 32, 48, 64 and 400 cut at the cap of 100 -> 12, 28, 44, 80 to come.
    to_come = [12, 28, 44, 80]
    expected_mean = sum(to_come) / 4
    expected_variance = sum((v - expected_mean) ** 2 for v in to_come) / 4
    assert mean == pytest.approx(2 * (expected_mean / 16 + 1))
    assert variance == pytest.approx((2 / 16) ** 2 * expected_variance)
    # Beyond every length observed, or without an outlook: the reservation as it is.
    ledger.grow(1, 1, 90)
    ledger.grow(1, 0, 90)
    assert remaining_moments(entry) == (entry.reserved_blocks - entry.held_blocks, 0.0)
    plain = ledger.open(2, demand(), 0.0)
    assert remaining_moments(plain) == (plain.reserved_blocks - plain.held_blocks, 0.0)


def test_pooling_commits_the_quantile_of_the_sum_not_the_sum_of_quantiles() -> None:
    # Heavy-tailed answers, as chat traffic has: most short, some long, cut at the cap.
    rng = random.Random(7)
    cap = 512
    lengths = [min(cap, int(rng.lognormvariate(4.0, 1.0))) for _ in range(1000)]
    outlook = OutputDistribution(lengths)
    quantile = 0.9
    p90 = sorted(lengths)[int(quantile * len(lengths)) - 1]
    ledger = InMemoryLedger(pooling_z=NormalDist().inv_cdf(quantile))
    requests = 16
    progress = [rng.choice([0, 0, 10, 40, 100]) for _ in range(requests)]
    for key, produced in enumerate(progress):
        ledger.open(key, demand(prompt=64, expected=p90, cap=cap), 0.0, outlook)
        ledger.grow(key, 0, produced)
    ledger.rebalance()
    totals = ledger.totals()
    committed = totals.committed_blocks
    assert totals.pooling_blocks > 0
    # Sixteen at once: a fifth or more of the output still to come is not committed.
    assert totals.pooling_blocks >= 0.2 * (totals.reserved_blocks - totals.held_blocks)

    # Draw how long each request will really run, from the same lengths, given its progress:
    # the blocks they hold at their ends together exceed the commitment about one time in ten.
    entries = list(ledger.entries())
    trials = 4000
    exceeded = 0
    for _ in range(trials):
        total = 0
        for entry, produced in zip(entries, progress, strict=True):
            final = rng.choice([length for length in lengths if length > produced] or [produced])
            total += entry.demand.blocks_at(min(final, cap))
        exceeded += total > committed
    assert exceeded / trials <= 1 - quantile + 0.03

    # One request alone gains little: its own quantile is near what the pool commits.
    single = InMemoryLedger(pooling_z=NormalDist().inv_cdf(quantile))
    single.open(0, demand(prompt=64, expected=p90, cap=cap), 0.0, outlook)
    single.rebalance()
    assert single.totals().committed_blocks >= 0.85 * single.totals().reserved_blocks
    # Closing entries recomputes what the rest commit, down to nothing.
    for key in range(requests):
        ledger.close(key)
    assert ledger.totals() == LedgerTotals(0, 0, 0, 0)


@pytest.mark.parametrize(("multiplex", "pooling"), [(True, False), (False, True), (True, True)])
def test_with_many_in_flight_a_close_never_commits_less_than_a_recomputation(
    multiplex: bool, pooling: bool
) -> None:
    # Beyond REBALANCE_ON_CLOSE_MAX_ENTRIES a close does not recompute: it must stay on the
    # safe side of what the next scrape's recomputation will find.
    rng = random.Random(3)
    ledger = InMemoryLedger(multiplex=multiplex, pooling_z=1.28 if pooling else None)
    for key in range(REBALANCE_ON_CLOSE_MAX_ENTRIES + 20):
        ledger.open(key, demand(prompt=rng.randint(1, 100), expected=150, cap=200), 0.0, OUTLOOK)
        ledger.grow(key, 0, rng.randint(0, 30))
    ledger.rebalance()
    totals = ledger.totals()
    assert max(totals.multiplex_blocks, totals.pooling_blocks) > 0  # there is a discount to keep
    for key in rng.sample(range(REBALANCE_ON_CLOSE_MAX_ENTRIES + 20), 15):
        ledger.close(key)
        kept = ledger.totals().committed_blocks
        ledger.rebalance()
        assert kept >= ledger.totals().committed_blocks
