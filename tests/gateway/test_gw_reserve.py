"""The standing reserve's local account and its size (gateway.reserve), pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.reserve import RESERVE_DIVISOR, Reserve, reserve_target


def test_the_reserve_is_a_share_of_the_room_and_none_while_anyone_waits() -> None:
    room = 100 - 30 - 10
    assert reserve_target(cap=100, others_booked=30, own_reserved=10, processes=3, waiting=0) == room // (
        RESERVE_DIVISOR * 3
    )
    assert reserve_target(cap=100, others_booked=30, own_reserved=10, processes=3, waiting=1) == 0
    assert reserve_target(cap=None, others_booked=0, own_reserved=0, processes=1, waiting=0) == 0
    # Over the budget (a cap that shrank): none, never a negative one.
    assert reserve_target(cap=20, others_booked=30, own_reserved=0, processes=1, waiting=0) == 0


@given(
    cap=st.integers(-50, 10_000),
    booked=st.lists(st.integers(0, 2_000), min_size=1, max_size=8),
)
def test_every_process_at_its_target_leaves_most_of_the_room(cap: int, booked: list[int]) -> None:
    processes = len(booked)
    room = cap - sum(booked)
    targets = [
        reserve_target(
            cap=cap, others_booked=sum(booked) - own, own_reserved=own, processes=processes, waiting=0
        )
        for own in booked
    ]
    assert all(target >= 0 for target in targets)
    assert sum(targets) <= max(0, room) // RESERVE_DIVISOR


def test_takes_draw_on_what_redis_last_said_and_the_answer_nets_the_later_ones() -> None:
    reserve = Reserve()
    assert not reserve.take(1, 1)  # nothing held before Redis answered
    reserve.answered(10)
    assert reserve.take(1, 4)
    assert reserve.take(2, 5)
    assert not reserve.take(3, 2)  # 1 left
    assert reserve.send(None) == [(1, 4), (2, 5)]
    assert reserve.take(3, 1)  # taken while the round trip is under way
    # Redis moved 9 out and topped it up to 12; the take made since is not in that answer.
    reserve.answered(12)
    assert (reserve.available, reserve.held, reserve.takes) == (11, 12, [(3, 1)])


def test_a_smaller_size_counts_at_once_and_a_failed_trip_resends_its_takes() -> None:
    reserve = Reserve()
    reserve.answered(10)
    reserve.take(1, 3)
    assert reserve.send(0) == [(1, 3)]
    # Being given back: nothing may be taken from it meanwhile.
    assert reserve.available == 0
    assert not reserve.take(2, 1)
    reserve.failed()
    assert reserve.takes == [(1, 3)]
    assert reserve.available == 0
    reserve.answered(4)
    assert reserve.available == 4 - 3  # the take is still to be sent
