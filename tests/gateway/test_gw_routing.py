"""Backend choice: prefix reuse within an imbalance bound, else headroom; the prefix index is LRU."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.prefix import chained_block_hashes
from gateway.routing import IMBALANCE_THRESHOLD, Candidate, PrefixIndex, choose, load_after

# ---------------------------------------------------------------- PrefixIndex


def test_match_counts_leading_hashes_and_stops_at_the_first_absent() -> None:
    index = PrefixIndex(10)
    index.add([1, 2, 3])
    assert index.match([1, 2, 3, 4]) == 3
    assert index.match([1, 9, 3]) == 1
    assert index.match([9, 1, 2]) == 0
    assert index.match([]) == 0


def test_least_recently_added_is_evicted_first() -> None:
    index = PrefixIndex(4)
    index.add([1, 2])
    index.add([3, 4])
    index.add([5])
    assert len(index) == 4
    # The oldest chain lost its tail (2) first; its head (1) goes next.
    assert index.match([1, 2]) == 1
    index.add([6])
    assert index.match([1]) == 0
    assert index.match([3, 4]) == 2
    assert index.match([5, 6]) == 2


def test_a_chain_loses_its_tail_before_its_head() -> None:
    # vLLM frees a request's blocks tail first, so the head of a chain outlives its tail.
    index = PrefixIndex(3)
    index.add([1, 2, 3, 4, 5])
    assert index.match([1, 2, 3, 4, 5]) == 3
    index.add([9])
    assert index.match([1, 2, 3]) == 2


def test_re_adding_refreshes() -> None:
    index = PrefixIndex(3)
    index.add([1, 2])
    index.add([3])
    index.add([1])  # 1 is now the most recent; 2 is the oldest
    index.add([4])
    assert index.match([1]) == 1
    assert index.match([2]) == 0


def test_match_refreshes_nothing() -> None:
    index = PrefixIndex(2)
    index.add([1])
    index.add([2])
    assert index.match([1]) == 1
    index.add([3])
    assert index.match([1]) == 0
    assert index.match([2]) == 1


def test_resize_evicts_the_least_recent_and_clear_empties() -> None:
    index = PrefixIndex(5)
    index.add([1, 2, 3])
    index.add([4, 5])
    index.resize(2)
    assert len(index) == 2
    assert index.capacity_blocks == 2
    assert index.match([4, 5]) == 2
    index.resize(10)
    index.add([6, 7, 8])
    assert len(index) == 5
    index.clear()
    assert len(index) == 0
    assert index.match([4]) == 0


def test_zero_capacity_holds_nothing_and_negative_is_refused() -> None:
    index = PrefixIndex(0)
    index.add([1, 2])
    assert len(index) == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(-1)
    with pytest.raises(ValueError, match="capacity_blocks"):
        index.resize(-1)


def test_chains_of_prompts_that_share_a_prefix() -> None:
    shared = list(range(64))
    first = chained_block_hashes([*shared, *range(100, 132)], 16)
    second = chained_block_hashes([*shared, *range(200, 232)], 16)
    index = PrefixIndex(100)
    index.add(first)
    assert index.match(second) == 4


class _ModelIndex:
    """The specification: a list ordered least recent first, refreshed by add, cut at capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: list[int]) -> None:
        for h in reversed(hashes):
            self.order.pop(h, None)
            self.order[h] = None
        while len(self.order) > self.capacity:
            del self.order[next(iter(self.order))]

    def match(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.order:
            n += 1
        return n


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 30), max_size=8)),
        st.tuples(st.just("match"), st.lists(st.integers(0, 30), max_size=8)),
        st.tuples(st.just("resize"), st.integers(0, 12)),
    ),
    max_size=40,
)


@given(capacity=st.integers(0, 12), ops=operations)
def test_index_behaves_as_its_specification(capacity: int, ops: list[tuple[str, object]]) -> None:
    index, model = PrefixIndex(capacity), _ModelIndex(capacity)
    for op, arg in ops:
        if op == "add":
            assert isinstance(arg, list)
            index.add(arg)
            model.add(arg)
        elif op == "match":
            assert isinstance(arg, list)
            assert index.match(arg) == model.match(arg)
        else:
            assert isinstance(arg, int)
            index.resize(arg)
            model.capacity = arg
            model.add([])
        assert len(index) == len(model.order) <= model.capacity


# ---------------------------------------------------------------- choose


def _candidate(
    name: str, admissible: int, committed: int, prefix: int = 0, pool: int | None = None
) -> Candidate:
    """A candidate whose share is `admissible` blocks of a `pool` (by default the share is
    the whole pool: no overcommit)."""
    return Candidate(
        name=name,
        free_blocks=max(0, admissible - committed),
        admissible_blocks=admissible,
        pool_blocks=admissible if pool is None else pool,
        committed_blocks=committed,
        prefix_blocks=prefix,
    )


def test_none_when_no_candidate_has_room() -> None:
    fleet = [_candidate("a", 10, 8), _candidate("b", 10, 9)]
    assert choose(fleet, {"a": 3, "b": 3}) is None
    assert choose([], {}) is None


def test_a_candidate_without_a_reserve_is_not_eligible() -> None:
    fleet = [_candidate("a", 100, 0, prefix=5), _candidate("b", 10, 0)]
    assert choose(fleet, {"b": 2}) == "b"


def test_without_a_prefix_match_the_most_headroom_wins() -> None:
    fleet = [_candidate("a", 64, 40), _candidate("b", 64, 10), _candidate("c", 128, 80)]
    # Free after: a 24-4=20, b 54-4=50, c 48-6=42 (c's blocks are bigger in count).
    assert choose(fleet, {"a": 4, "b": 4, "c": 6}) == "b"


def test_an_overcommitted_share_is_no_more_headroom_than_the_pool() -> None:
    # a's share is overcommitted to 150 of its 100-block pool: 110 free for admission, but only
    # 100 - 40 = 60 of room, against b's 90. Counting the overcommit as room would send a every
    # request until its 40 committed blocks reached 60 more than b's.
    fleet = [_candidate("a", 150, 40, pool=100), _candidate("b", 100, 10)]
    assert choose(fleet, {"a": 2, "b": 2}) == "b"
    # Still eligible on its share: when b has no room left, a takes it.
    assert choose([fleet[0], _candidate("b", 100, 99)], {"a": 2, "b": 2}) == "a"
    # And its load is measured against the pool: (40 + 2) / 100.
    assert load_after(fleet[0], 2) == 0.42


def test_a_share_below_the_pool_is_the_room() -> None:
    # a promises 60 of its 100 blocks (budget_max_fraction 0.6, or the share of a shared ledger
    # it cannot reach): its room is 60 - 20 = 40, b's 50.
    fleet = [_candidate("a", 60, 20, pool=100), _candidate("b", 64, 14)]
    assert choose(fleet, {"a": 4, "b": 4}) == "b"


def test_headroom_ties_go_to_the_smallest_name() -> None:
    fleet = [_candidate("b", 64, 10), _candidate("a", 64, 10)]
    assert choose(fleet, {"a": 4, "b": 4}) == "a"


def test_a_prefix_match_within_the_threshold_wins_over_headroom() -> None:
    # Loads after: a (20+4)/64 = 0.375, b (10+4)/64 = 0.22: 0.16 apart, within 0.25.
    fleet = [_candidate("a", 64, 20, prefix=3), _candidate("b", 64, 10)]
    assert choose(fleet, {"a": 4, "b": 4}) == "a"


def test_a_prefix_match_past_the_threshold_loses_to_headroom() -> None:
    # Loads after: a (40+4)/64 = 0.69, b (10+4)/64 = 0.22: more than 0.25 apart.
    fleet = [_candidate("a", 64, 40, prefix=3), _candidate("b", 64, 10)]
    assert choose(fleet, {"a": 4, "b": 4}) == "b"


def test_exactly_at_the_threshold_the_match_still_wins() -> None:
    # Loads after: a (28+4)/64 = 0.5, b (12+4)/64 = 0.25, exactly 0.25 apart.
    fleet = [_candidate("a", 64, 28, prefix=1), _candidate("b", 64, 12)]
    assert load_after(fleet[0], 4) - load_after(fleet[1], 4) == IMBALANCE_THRESHOLD
    assert choose(fleet, {"a": 4, "b": 4}) == "a"
    assert choose([_candidate("a", 64, 29, prefix=1), fleet[1]], {"a": 4, "b": 4}) == "b"


def test_the_longest_match_wins_among_matches() -> None:
    # Loads after: a 0.375, b 0.406, c (10+4)/64 = 0.22: all within 0.25 of c.
    fleet = [_candidate("a", 64, 20, prefix=2), _candidate("b", 64, 22, prefix=5), _candidate("c", 64, 10)]
    assert choose(fleet, {"a": 4, "b": 4, "c": 4}) == "b"


def test_an_ineligible_match_is_ignored() -> None:
    fleet = [_candidate("a", 64, 62, prefix=9), _candidate("b", 64, 30)]
    assert choose(fleet, {"a": 4, "b": 4}) == "b"


def test_load_after_with_nothing_admissible() -> None:
    empty = _candidate("a", 0, 0)
    assert load_after(empty, 1) == float("inf")
    assert load_after(empty, 0) == 0.0
    assert choose([empty, _candidate("b", 10, 0, prefix=2)], {"a": 0, "b": 1}) == "b"


names = st.sampled_from(["a", "b", "c", "d", "e"])


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Candidate], dict[str, int]]:
    chosen = draw(st.lists(names, unique=True, max_size=5))
    fleet = []
    reserves: dict[str, int] = {}
    for name in chosen:
        admissible = draw(st.integers(0, 200))
        committed = draw(st.integers(0, 250))
        # The pool: the share's own size, or another (a share overcommitted or cut back).
        pool = draw(st.one_of(st.just(admissible), st.integers(0, 200)))
        fleet.append(_candidate(name, admissible, committed, draw(st.integers(0, 6)), pool=pool))
        if draw(st.booleans()) or len(chosen) == 1:
            reserves[name] = draw(st.integers(0, 60))
    return fleet, reserves


def _headroom_after(c: Candidate, reserves: dict[str, int]) -> int:
    """The oracle's headroom: the smaller of share and pool, less committed and reserve."""
    return min(c.admissible_blocks, c.pool_blocks) - c.committed_blocks - reserves[c.name]


def _eligible(fleet: list[Candidate], reserves: dict[str, int]) -> list[Candidate]:
    return [c for c in fleet if c.name in reserves and c.free_blocks >= reserves[c.name]]


@given(drawn=fleets())
def test_never_an_ineligible_name_and_none_only_when_none_is_eligible(
    drawn: tuple[list[Candidate], dict[str, int]],
) -> None:
    fleet, reserves = drawn
    chosen = choose(fleet, reserves)
    eligible = {c.name for c in _eligible(fleet, reserves)}
    assert (chosen is None) == (not eligible)
    assert chosen is None or chosen in eligible


@given(drawn=fleets())
def test_without_matches_the_choice_has_the_most_headroom(
    drawn: tuple[list[Candidate], dict[str, int]],
) -> None:
    fleet, reserves = drawn
    fleet = [_candidate(c.name, c.admissible_blocks, c.committed_blocks, pool=c.pool_blocks) for c in fleet]
    chosen = choose(fleet, reserves)
    eligible = _eligible(fleet, reserves)
    if not eligible:
        return
    most = max(_headroom_after(c, reserves) for c in eligible)
    best = min(c.name for c in eligible if _headroom_after(c, reserves) == most)
    assert chosen == best


@given(drawn=fleets())
def test_a_match_within_the_threshold_is_chosen_else_the_most_headroom(
    drawn: tuple[list[Candidate], dict[str, int]],
) -> None:
    fleet, reserves = drawn
    eligible = _eligible(fleet, reserves)
    if not eligible:
        return

    def headroom(c: Candidate) -> tuple[int, str]:
        return (-_headroom_after(c, reserves), c.name)

    longest = max(c.prefix_blocks for c in eligible)
    match = min((c for c in eligible if c.prefix_blocks == longest), key=headroom)
    least = min(load_after(c, reserves[c.name]) for c in eligible)
    within = longest > 0 and load_after(match, reserves[match.name]) <= least + IMBALANCE_THRESHOLD
    expected = match if within else min(eligible, key=headroom)
    assert choose(fleet, reserves) == expected.name


@given(drawn=fleets(), data=st.data())
def test_the_choice_is_deterministic_and_ignores_candidate_order(
    drawn: tuple[list[Candidate], dict[str, int]], data: st.DataObject
) -> None:
    fleet, reserves = drawn
    shuffled = data.draw(st.permutations(fleet))
    assert choose(fleet, reserves) == choose(fleet, reserves) == choose(shuffled, reserves)


def test_equal_candidates_take_turns() -> None:
    # An idle fleet: equal headroom, no prefix. The one chosen least recently takes it.
    a = Candidate("a", 10, 10, 10, 0, 0, chosen_at=5.0)
    b = Candidate("b", 10, 10, 10, 0, 0, chosen_at=3.0)
    assert choose([a, b], {"a": 2, "b": 2}) == "b"
    assert choose([replace(a, chosen_at=1.0), b], {"a": 2, "b": 2}) == "a"
