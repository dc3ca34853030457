"""The wait queue booking its admissions on a shared ledger (a scripted booker stands in for
Redis here: what Redis itself does is tested in test_gw_shared_scripts.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from test_gw_waitqueue import POLICY, FakeBudget, FakeClock, ask

from gateway.admission import ONLY, Decision, DecisionKind, Reason
from gateway.waitqueue import Booking, BookingAnswer, WaitQueue


@dataclass
class ScriptedBooker:
    """Holds each batch until the test answers it."""

    active: bool = True
    batches: list[tuple[Sequence[Booking], Callable[[BookingAnswer], None]]] = field(default_factory=list)
    released: list[tuple[str, int]] = field(default_factory=list)

    def book(self, bookings: Sequence[Booking], answer: Callable[[BookingAnswer], None]) -> None:
        self.batches.append((bookings, answer))

    def release(self, target: str, key: int) -> None:
        self.released.append((target, key))

    def answer(self, places: BookingAnswer) -> Sequence[Booking]:
        bookings, answer = self.batches.pop(0)
        answer(places)
        return bookings


def booking_queue(clock: FakeClock, budget: FakeBudget, booker: ScriptedBooker) -> WaitQueue:
    return WaitQueue(policy=POLICY, budget=budget, drain_rate=lambda now: None, clock=clock, booker=booker)


async def test_an_admission_waits_for_its_booking_and_counts_against_the_budget_meanwhile() -> None:
    clock, budget, booker = FakeClock(), FakeBudget(total=10), ScriptedBooker()
    queue = booking_queue(clock, budget, booker)
    first = queue.enter(1, ask(6, clock), lambda now, onto: budget.book(1, 6))
    assert not first.done  # proposed, not admitted: Redis has not answered
    second = queue.enter(2, ask(6, clock), lambda now, onto: budget.book(2, 6))
    # The first one's 6 blocks are spoken for while its booking is under way.
    assert len(booker.batches) == 1
    assert not second.done
    assert len(queue) == 1
    (booking,) = booker.answer([ONLY])
    assert booking.key == 1
    assert booking.candidates == ((ONLY, 6),)
    assert first.future.result().kind is DecisionKind.ADMIT
    assert budget.committed == 6
    assert not second.done
    assert booker.batches == []


async def test_a_refused_booking_returns_to_its_place_in_the_queue() -> None:
    clock, budget, booker = FakeClock(), FakeBudget(total=10), ScriptedBooker()
    queue = booking_queue(clock, budget, booker)
    first = queue.enter(1, ask(6, clock), lambda now, onto: budget.book(1, 6))
    budget.committed = 8  # meanwhile another process booked most of the pool
    second = queue.enter(2, ask(5, clock), lambda now, onto: budget.book(2, 5))
    assert len(queue) == 1
    assert not second.done
    booker.answer([None])
    assert not first.done
    assert [entry.key for entry in queue.waiting()] == [1, 2]  # back ahead of the later one
    # Planned again a moment later, not at once: a refusal never turns into a busy loop.
    assert booker.batches == []
    budget.committed = 0
    await asyncio.sleep(0.02)
    assert [b.key for b in booker.batches[0][0]] == [1]  # 6 + 5 > 10: the second still waits
    booker.answer([ONLY])
    assert first.future.result().kind is DecisionKind.ADMIT


async def test_a_booking_whose_client_left_is_given_back() -> None:
    clock, budget, booker = FakeClock(), FakeBudget(total=10), ScriptedBooker()
    queue = booking_queue(clock, budget, booker)
    admitted: list[int] = []
    entry = queue.enter(1, ask(6, clock), lambda now, onto: admitted.append(1))
    assert queue.leave(entry)
    booker.answer([ONLY])
    assert admitted == []
    assert booker.released == [(ONLY, 1)]
    # Refused after it left: nothing to give back.
    other = queue.enter(2, ask(6, clock), lambda now, onto: admitted.append(2))
    assert queue.leave(other)
    booker.answer([None])
    assert booker.released == [(ONLY, 1)]
    assert admitted == []
    assert len(queue) == 0


async def test_no_answer_from_the_store_puts_everyone_back_and_an_inactive_booker_books_locally() -> None:
    clock, budget, booker = FakeClock(), FakeBudget(total=10), ScriptedBooker()
    queue = booking_queue(clock, budget, booker)
    entry = queue.enter(1, ask(4, clock), lambda now, onto: budget.book(1, 4))
    booker.active = False  # Redis went away (failing open): book here, at once
    booker.answer(None)
    assert len(queue) == 1
    await asyncio.sleep(0.02)
    assert entry.future.result().kind is DecisionKind.ADMIT
    assert budget.committed == 4
    assert booker.batches == []


async def test_shutdown_answers_bookings_under_way_and_gives_back_what_lands() -> None:
    clock, budget, booker = FakeClock(), FakeBudget(total=10), ScriptedBooker()
    queue = booking_queue(clock, budget, booker)
    entry = queue.enter(1, ask(4, clock), lambda now, onto: budget.book(1, 4))

    assert queue.close(Decision(DecisionKind.SHED, Reason.SHUTTING_DOWN, 1.0)) == 1
    assert entry.future.result().reason is Reason.SHUTTING_DOWN
    booker.answer([ONLY])
    assert booker.released == [(ONLY, 1)]
    assert budget.committed == 0


async def test_an_arrival_proposed_for_booking_leaves_the_queue_whole() -> None:
    clock, budget, booker = FakeClock(), FakeBudget(total=10), ScriptedBooker()
    queue = booking_queue(clock, budget, booker)
    budget.committed = 4
    waiting = [queue.enter(key, ask(8, clock), lambda now, onto: None) for key in (1, 2)]
    # The newcomer fits beside them (one bypass allowed): proposed, and the two stay queued.
    arrival = queue.enter(3, ask(2, clock), lambda now, onto: budget.book(3, 2))
    assert [b.key for b in booker.batches[-1][0]] == [3]
    assert not arrival.done
    assert [entry.key for entry in queue.waiting()] == [1, 2]
    assert all(not entry.done for entry in waiting)
    booker.answer([ONLY])
    assert arrival.future.result().kind is DecisionKind.ADMIT
