"""The async wait queue around the policy, with a fake clock and a fake budget."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace

import pytest

from gateway.admission import (
    AdmissionPolicy,
    Ask,
    Decision,
    DecisionKind,
    PolicyConfig,
    Priority,
    Reason,
)
from gateway.capacity import BudgetSnapshot, BudgetState
from gateway.rates import WaitCalibration
from gateway.waitqueue import WaitQueue

POLICY = AdmissionPolicy(
    PolicyConfig(
        max_queued={Priority.HIGH: 2, Priority.NORMAL: 2, Priority.LOW: 2},
        max_bypass=1,
    )
)


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeBudget:
    """A pool of `total` blocks; admissions book blocks through `book`."""

    total: int = 10
    committed: int = 0
    state: BudgetState = BudgetState.FRESH
    booked: dict[int, int] = field(default_factory=dict)

    def snapshot(self, now: float) -> BudgetSnapshot:
        return BudgetSnapshot(
            state=self.state,
            known=self.state is BudgetState.FRESH,
            total_blocks=self.total,
            pool_limit_blocks=self.total,
            admissible_blocks=self.total,
            committed_blocks=self.committed,
            used_reported_blocks=0.0,
            external_blocks=0,
            fraction=1.0,
            age_s=0.0,
            detail="",
        )

    def book(self, key: int, blocks: int) -> None:
        self.booked[key] = blocks
        self.committed += blocks

    def release(self, key: int) -> None:
        self.committed -= self.booked.pop(key)


def make_queue(clock: FakeClock, budget: FakeBudget) -> WaitQueue:
    return WaitQueue(policy=POLICY, budget=budget, drain_rate=lambda now: None, clock=clock)


def ask(
    blocks: int, clock: FakeClock, *, priority: Priority = Priority.NORMAL, within_s: float = math.inf
) -> Ask:
    return Ask(blocks, blocks, priority, clock.now, clock.now + within_s)


async def test_a_request_that_fits_is_admitted_without_waiting() -> None:
    clock, budget = FakeClock(), FakeBudget()
    queue = make_queue(clock, budget)
    admitted_at: list[float] = []
    entry = queue.enter(1, ask(4, clock), lambda now, onto: (admitted_at.append(now), budget.book(1, 4)))
    assert entry.done
    assert entry.future.result().kind is DecisionKind.ADMIT
    assert admitted_at == [100.0]
    assert len(queue) == 0


async def test_waiters_are_admitted_in_priority_order_when_blocks_free() -> None:
    clock, budget = FakeClock(), FakeBudget()
    queue = make_queue(clock, budget)
    queue.enter(1, ask(10, clock), lambda now, onto: budget.book(1, 10))
    low = queue.enter(2, ask(6, clock, priority=Priority.LOW), lambda now, onto: budget.book(2, 6))
    clock.now += 1
    high = queue.enter(3, ask(6, clock, priority=Priority.HIGH), lambda now, onto: budget.book(3, 6))
    assert not low.done
    assert not high.done
    assert queue.depth() == {Priority.HIGH: 1, Priority.NORMAL: 0, Priority.LOW: 1}
    budget.release(1)
    queue.pump()
    assert high.done
    assert high.future.result().kind is DecisionKind.ADMIT
    assert not low.done  # 4 blocks left, and the high one overtook it
    budget.release(3)
    queue.pump()
    assert low.future.result().kind is DecisionKind.ADMIT


async def test_an_arrival_that_must_wait_keeps_the_wait_predicted_for_it() -> None:
    clock, budget = FakeClock(), FakeBudget()
    queue = WaitQueue(policy=POLICY, budget=budget, drain_rate=lambda now: 4.0, clock=clock)
    first = queue.enter(1, ask(8, clock), lambda now, onto: budget.book(1, 8))
    second = queue.enter(2, ask(6, clock), lambda now, onto: budget.book(2, 6))
    third = queue.enter(3, ask(4, clock), lambda now, onto: budget.book(3, 4))
    assert first.done
    assert first.predicted_wait_s is None  # admitted at once
    assert second.predicted_wait_s == pytest.approx(1.0)  # 6 - 2 free, at 4 blocks/s
    assert third.predicted_wait_s == pytest.approx(2.0)  # 6 queued ahead + 4 - 2 free
    overflow = queue.enter(4, ask(4, clock), lambda now, onto: budget.book(4, 4))
    assert overflow.future.result().reason is Reason.QUEUE_FULL
    assert overflow.predicted_wait_s is None  # refused, it never waited
    clock.now += 5
    budget.release(1)
    queue.pump()  # later plans leave the arrival's prediction as it was
    assert second.done
    assert third.predicted_wait_s == pytest.approx(2.0)


async def test_the_calibration_learns_from_admissions_and_deadlines_and_corrects_arrivals() -> None:
    clock, budget = FakeClock(), FakeBudget(total=64, committed=64)
    policy = AdmissionPolicy(replace(POLICY.config, max_queued={p: 100 for p in Priority}))
    calibration = WaitCalibration(min_samples=2)
    queue = WaitQueue(
        policy=policy, budget=budget, drain_rate=lambda now: 4.0, clock=clock, calibration=calibration
    )
    # Two small requests predicted at 0.5 s and 1 s in order (2 and 4 blocks at 4 blocks/s)
    # are both admitted after 0.25 s.
    first = queue.enter(1, ask(2, clock), lambda now, onto: budget.book(1, 2))
    second = queue.enter(2, ask(2, clock), lambda now, onto: budget.book(2, 2))
    assert (first.in_order_wait_s, second.in_order_wait_s) == (pytest.approx(0.5), pytest.approx(1.0))
    clock.now += 0.25
    budget.committed = 60
    queue.pump()
    assert first.done
    assert second.done
    # A large one is still queued at its deadline: its wait counts too (what it waited).
    # (Their deadlines lie past their predictions, or they would be refused on arrival.)
    large = queue.enter(3, ask(30, clock, within_s=16.0), lambda now, onto: budget.book(3, 30))
    large_again = queue.enter(4, ask(30, clock, within_s=16.0), lambda now, onto: budget.book(4, 30))
    clock.now += 16.0
    queue.pump()
    assert large.future.result().reason is Reason.DEADLINE_EXPIRED
    assert large_again.future.result().reason is Reason.DEADLINE_EXPIRED
    # Small: about (0.25 + 0.25) / (0.5 + 1.0), a third (the later sample weighs a little more).
    # Large (in order 30/4 = 7.5 s and 15 s, with the first still ahead), 16 s each: about 32 / 22.5.
    small_factor = calibration.factor(2, 64)
    assert small_factor == pytest.approx(1 / 3, rel=0.02)
    assert calibration.factor(30, 64) == pytest.approx(32 / 22.5, rel=0.05)
    # The next small arrival is predicted at that share of its in-order wait.
    budget.committed = 64
    third = queue.enter(5, ask(2, clock), lambda now, onto: budget.book(5, 2))
    assert third.in_order_wait_s == pytest.approx(0.5)
    assert third.predicted_wait_s == pytest.approx(0.5 * small_factor)
    # Requests shed for other reasons teach nothing: the queue is cleared, nothing changes.
    queue.close(Decision(DecisionKind.SHED, Reason.SHUTTING_DOWN, 1.0))
    assert [row["samples"] for row in calibration.factors()] == [2, 0, 0, 2]


async def test_leaving_withdraws_at_once_and_lets_the_next_in() -> None:
    clock, budget = FakeClock(), FakeBudget(total=11)
    queue = make_queue(clock, budget)
    queue.enter(1, ask(5, clock), lambda now, onto: budget.book(1, 5))
    big = queue.enter(2, ask(8, clock), lambda now, onto: budget.book(2, 8))
    small = queue.enter(3, ask(5, clock), lambda now, onto: budget.book(3, 5))
    # max_bypass is 1: the small one overtook the big one once already.
    assert small.done
    assert not big.done
    third = queue.enter(4, ask(1, clock), lambda now, onto: budget.book(4, 1))
    assert not third.done  # it would fit, but the big one's bypass allowance is used up
    assert queue.leave(big)
    assert big.future.cancelled()
    assert third.done
    assert third.future.result().kind is DecisionKind.ADMIT
    assert not queue.leave(big)  # already gone
    assert len(queue) == 0


async def test_deadline_sheds_on_pump_with_a_fake_clock() -> None:
    clock, budget = FakeClock(), FakeBudget(committed=10)
    queue = make_queue(clock, budget)
    entry = queue.enter(1, ask(1, clock, within_s=2.0), lambda now, onto: budget.book(1, 1))
    clock.now += 1.999
    queue.pump()
    assert not entry.done
    clock.now += 0.001
    queue.pump()
    decision = entry.future.result()
    assert (decision.kind, decision.reason) == (DecisionKind.SHED, Reason.DEADLINE_EXPIRED)
    assert entry.resolved_at == clock.now


async def test_an_arrival_predicted_to_miss_its_deadline_is_shed_at_once_with_a_drain_hint() -> None:
    clock, budget = FakeClock(), FakeBudget(committed=10)
    queue = WaitQueue(policy=POLICY, budget=budget, drain_rate=lambda now: 2.0, clock=clock)
    # 4 blocks short at 2 blocks/s: ready in 2 s. With 1.5 s to its deadline it is refused
    # on arrival, not at its deadline; with 10 s it waits.
    doomed = queue.enter(1, Ask(4, 4, Priority.NORMAL, clock.now, clock.now + 1.5), lambda now, onto: None)
    decision = doomed.future.result()
    assert (decision.reason, decision.retry_after_s) == (Reason.DEADLINE_UNREACHABLE, pytest.approx(2.0))
    assert doomed.resolved_at == clock.now
    patient = queue.enter(2, Ask(4, 4, Priority.NORMAL, clock.now, clock.now + 10.0), lambda now, onto: None)
    assert not patient.done


async def test_the_deadline_timer_sheds_without_any_other_event() -> None:
    budget = FakeBudget(committed=10)
    queue = WaitQueue(policy=POLICY, budget=budget, drain_rate=lambda now: None, clock=time.monotonic)
    start = time.monotonic()
    entry = queue.enter(1, Ask(1, 1, Priority.NORMAL, start, start + 0.05), lambda now, onto: None)
    decision = await asyncio.wait_for(entry.future, timeout=5.0)
    assert decision.reason is Reason.DEADLINE_EXPIRED
    assert time.monotonic() - start >= 0.05


async def test_refused_arrivals_never_join() -> None:
    clock, budget = FakeClock(), FakeBudget(committed=10)
    queue = make_queue(clock, budget)
    for key in (1, 2):
        queue.enter(key, ask(1, clock), lambda now, onto: None)
    full = queue.enter(3, ask(1, clock), lambda now, onto: None)
    assert full.future.result().reason is Reason.QUEUE_FULL
    # One block free: a request that fits never waits, so no queue is full for it.
    budget.committed = 9
    fits = queue.enter(6, ask(1, clock, priority=Priority.HIGH), lambda now, onto: budget.book(6, 1))
    assert fits.future.result().kind is DecisionKind.ADMIT
    too_big = queue.enter(4, ask(11, clock), lambda now, onto: None)
    assert too_big.future.result().kind is DecisionKind.REJECT
    budget.state = BudgetState.STALE
    unknown = queue.enter(5, ask(1, clock, priority=Priority.HIGH), lambda now, onto: None)
    assert unknown.future.result().reason is Reason.BUDGET_UNKNOWN
    assert len(queue) == 2


async def test_a_down_backend_sheds_the_queue_and_close_answers_everyone() -> None:
    clock, budget = FakeClock(), FakeBudget(committed=10)
    queue = make_queue(clock, budget)
    first = queue.enter(1, ask(1, clock), lambda now, onto: None)
    budget.state = BudgetState.DOWN
    queue.pump()
    assert first.future.result().reason is Reason.BACKEND_DOWN
    budget.state = BudgetState.FRESH
    second = queue.enter(2, ask(1, clock), lambda now, onto: None)
    assert queue.close(Decision(DecisionKind.SHED, Reason.BACKEND_DOWN, 1.0)) == 1
    assert second.future.result().reason is Reason.BACKEND_DOWN


async def test_a_callback_that_pumps_again_is_deferred_not_nested() -> None:
    clock, budget = FakeClock(), FakeBudget(committed=10)
    queue = make_queue(clock, budget)
    order: list[int] = []

    def admit(key: int) -> None:
        order.append(key)
        budget.book(key, 1)
        queue.pump()  # re-entrant: must not run a nested plan with stale state

    entries = [
        queue.enter(
            k, ask(1, clock, priority=Priority.LOW if k else Priority.HIGH), lambda now, onto, k=k: admit(k)
        )
        for k in (0, 1)
    ]
    budget.committed = 8
    queue.pump()
    assert order == [0, 1]
    assert all(e.future.result().kind is DecisionKind.ADMIT for e in entries)


@pytest.mark.parametrize("blocks", [0, 10])
async def test_zero_and_exact_fits(blocks: int) -> None:
    clock, budget = FakeClock(), FakeBudget()
    entry = make_queue(clock, budget).enter(1, ask(blocks, clock), lambda now, onto: None)
    assert entry.future.result().kind is DecisionKind.ADMIT
