"""Loads defined by measurement: the search for the rate the backend sustains, and the rates."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from bench.loads import describe, find_rate, finished_share_of, parse_rates


def backend(capacity: float) -> Callable[[float], float]:
    """A backend that finishes everything up to `capacity` requests/s and a falling share above."""

    def finished_share(rate: float) -> float:
        return 1.0 if rate <= capacity else capacity / rate

    return finished_share


def test_doubling_then_bisection_brackets_the_sustained_rate() -> None:
    search = find_rate(backend(5.0), start_rate=1.0, bisections=3)
    assert [round(s.rate, 3) for s in search.steps[:4]] == [1.0, 2.0, 4.0, 8.0]
    assert len(search.steps) == 4 + 3
    assert search.bounded
    assert search.sustained is not None
    # Three geometric bisections of [4, 8] leave it within a factor 2 ** (1/8) of the truth.
    assert 5.0 / 2 ** (1 / 8) <= search.sustained <= 5.0
    assert all(s.finished_share >= 0.98 for s in search.steps if s.rate <= search.sustained)
    assert search.one_x == pytest.approx(search.sustained * 0.8)
    loads = search.loads()
    assert loads["3x"] == pytest.approx(3 * loads["1x"])
    assert loads["0.5x"] == pytest.approx(0.5 * loads["1x"])


def test_a_start_above_capacity_halves_first() -> None:
    search = find_rate(backend(0.3), start_rate=1.0, bisections=2)
    assert [s.rate for s in search.steps[:3]] == [1.0, 0.5, 0.25]
    assert search.sustained is not None
    assert 0.25 <= search.sustained <= 0.3
    assert search.bounded


def test_no_failure_says_the_rate_is_not_bounded_and_nothing_passing_gives_no_loads() -> None:
    unbounded = find_rate(backend(math.inf), start_rate=1.0, max_doublings=2)
    assert (unbounded.sustained, unbounded.bounded) == (4.0, False)
    assert "may sustain more" in describe(unbounded)
    hopeless = find_rate(lambda rate: 0.5, start_rate=1.0, max_doublings=2)
    assert hopeless.sustained is None
    assert hopeless.loads() == {}
    assert "lower --start-rate" in describe(hopeless)


def test_the_search_uses_the_target_share_and_margin_it_is_given() -> None:
    search = find_rate(
        lambda rate: 0.95 if rate > 2 else 1.0, start_rate=1.0, target_share=0.9, margin=0.5, max_doublings=3
    )
    assert search.bounded is False
    assert search.sustained == 8.0
    assert search.loads()["1x"] == 4.0
    with pytest.raises(ValueError, match="margin"):
        find_rate(backend(1.0), margin=0.0)


def slice_backend(capacity: float, requests: int, deadline_s: float) -> Callable[[float], float]:
    """A backend serving `capacity` requests/s, fed a slice of `requests` at a rate: the share
    finished within the deadline, the backlog drained in order (a fluid queue)."""

    def finished_share(rate: float) -> float:
        if rate <= capacity:
            return 1.0
        # Request i arrives at i / rate and finishes at i / capacity: within the deadline
        # while i * (1 / capacity - 1 / rate) <= deadline_s.
        within = deadline_s / (1 / capacity - 1 / rate)
        return min(1.0, within / requests)

    return finished_share


def test_a_slice_shorter_than_its_backlog_is_not_mistaken_for_capacity() -> None:
    # 300 requests and a 10 s deadline: at 128/s a backend of 25/s still finishes them all in
    # time (the last one waits 300/25 - 300/128 = 9.7 s), so the rate that passes says little.
    share = slice_backend(25.0, 300, 10.0)
    assert share(128.0) == 1.0
    search = find_rate(share, start_rate=16.0, bisections=4, slice_requests=300, deadline_s=10.0)
    assert search.sustained is not None
    assert search.sustained > 100
    # What keeps up is recovered from the slice: within the bisection's step of 25/s.
    capacity = search.capacity
    assert capacity is not None
    assert capacity == pytest.approx(25.0, rel=0.05)
    assert search.one_x == pytest.approx(capacity * 0.8)
    assert "keeps up with: " in describe(search)
    recorded = search.to_json()
    assert (recorded["sustained_rate"], recorded["keeps_up_with"]) == (search.sustained, capacity)
    assert recorded["loads"] == search.loads()
    assert len(recorded["steps"]) == len(search.steps)
    # A longer slice needs no correction to speak of: its backlog is what fails it.
    longer = find_rate(
        slice_backend(25.0, 30_000, 10.0),
        start_rate=16.0,
        bisections=4,
        slice_requests=30_000,
        deadline_s=10.0,
    )
    assert longer.capacity == pytest.approx(25.0, rel=0.05)
    with pytest.raises(ValueError, match="slice_requests"):
        find_rate(share, slice_requests=0, deadline_s=10.0)


def test_rates_are_numbers_or_multiples_of_the_measured_1x() -> None:
    assert parse_rates("2,4.5", None) == [2.0, 4.5]
    assert parse_rates("0.5x,1x, 3x", 4.0) == [2.0, 4.0, 12.0]
    with pytest.raises(ValueError, match="--find-1x"):
        parse_rates("3x", None)
    with pytest.raises(ValueError, match="> 0"):
        parse_rates("0", None)


def test_the_share_finished_is_read_from_a_bench_summary_row() -> None:
    assert finished_share_of({"ok": 39, "sent": 40, "late": 1}) == pytest.approx(0.975)
    assert finished_share_of({"ok": 0, "sent": 0}) == 0.0  # nothing sent is nothing finished
