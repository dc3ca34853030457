"""The admission policy: screening, planning, bounded bypass, early shedding, properties."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission import (
    AdmissionPolicy,
    Ask,
    DecisionKind,
    PolicyConfig,
    Prediction,
    Priority,
    Reason,
    Target,
    Waiter,
    retry_after,
)
from gateway.capacity import BudgetSnapshot, BudgetState

CONFIG = PolicyConfig(
    max_queued={Priority.HIGH: 4, Priority.NORMAL: 4, Priority.LOW: 4},
    max_bypass=2,
)
POLICY = AdmissionPolicy(CONFIG)


def budget(
    free: int,
    *,
    total: int = 100,
    state: BudgetState = BudgetState.FRESH,
    known: bool = True,
    renewing: bool = False,
) -> BudgetSnapshot:
    return BudgetSnapshot(
        state=state,
        known=known,
        total_blocks=total,
        pool_limit_blocks=total,
        admissible_blocks=total,
        committed_blocks=total - free,
        used_reported_blocks=0.0,
        external_blocks=0,
        fraction=1.0,
        age_s=0.0,
        detail="",
        renewing=renewing,
    )


def ask(
    blocks: int, *, priority: Priority = Priority.NORMAL, deadline: float = math.inf, worst: int | None = None
) -> Ask:
    return Ask(blocks, worst if worst is not None else blocks, priority, arrived_at=0.0, deadline_at=deadline)


# -- screen ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("the_ask", "snapshot", "now", "kind", "reason"),
    [
        (ask(5), budget(50), 0.0, None, None),
        (ask(5, worst=101), budget(50), 0.0, DecisionKind.REJECT, Reason.EXCEEDS_POOL),
        # A stale reading still sizes the pool: too big is refused as such, not "retry later".
        (
            ask(5, worst=101),
            budget(0, known=False, state=BudgetState.STALE),
            0.0,
            DecisionKind.REJECT,
            Reason.EXCEEDS_POOL,
        ),
        (
            ask(5),
            budget(0, known=False, state=BudgetState.STALE),
            0.0,
            DecisionKind.SHED,
            Reason.BUDGET_UNKNOWN,
        ),
        (
            ask(5),
            budget(0, known=False, state=BudgetState.UNSEEN, total=0),
            0.0,
            DecisionKind.SHED,
            Reason.BUDGET_UNKNOWN,
        ),
        (ask(5), budget(0, known=False, state=BudgetState.DOWN), 0.0, DecisionKind.SHED, Reason.BACKEND_DOWN),
        # Suspect (a request just failed to reach the backend): wait in the queue for the next scrape.
        (ask(5), budget(50, known=False, state=BudgetState.SUSPECT), 0.0, None, None),
        # Stale, but a scrape in flight may renew it: wait for it in the queue too.
        (ask(5), budget(50, known=False, state=BudgetState.STALE, renewing=True), 0.0, None, None),
        (ask(5, deadline=1.0), budget(50), 1.0, DecisionKind.SHED, Reason.DEADLINE_UNREACHABLE),
    ],
)
def test_screen(
    the_ask: Ask, snapshot: BudgetSnapshot, now: float, kind: DecisionKind | None, reason: Reason | None
) -> None:
    decision = POLICY.screen(the_ask, snapshot, now)
    if kind is None:
        assert decision is None
    else:
        assert decision is not None
        assert (decision.kind, decision.reason) == (kind, reason)
        if kind is DecisionKind.SHED:
            assert decision.retry_after_s is not None
            assert decision.retry_after_s > 0


@pytest.mark.parametrize(
    ("priority", "waiting", "full"),
    [
        (Priority.NORMAL, 3, False),
        (Priority.NORMAL, 4, True),
        (Priority.HIGH, 4, True),
        (Priority.LOW, 0, False),
    ],
)
def test_overflow(priority: Priority, waiting: int, full: bool) -> None:
    decision = POLICY.overflow(priority, waiting, queued_blocks=30, budget=budget(10), drain_rate=10.0)
    if not full:
        assert decision is None
    else:
        assert decision is not None
        assert (decision.reason, decision.retry_after_s) == (Reason.QUEUE_FULL, pytest.approx(2.0))


def test_a_fleet_queues_queue_max_per_backend_that_is_not_down() -> None:
    # Four per class and backend: three backends, one of them down, hold eight.
    down = budget(0, known=False, state=BudgetState.DOWN)
    fleet = [Target("a", budget(2), 1.0), Target("b", budget(2), 1.0), Target("c", down, None)]
    assert POLICY.overflow_fleet(Priority.NORMAL, 7, 30, fleet) is None
    full = POLICY.overflow_fleet(Priority.NORMAL, 8, 30, fleet)
    assert full is not None
    # The retry hint: the queued blocks beyond the free ones, at the two live drain rates.
    assert (full.reason, full.retry_after_s) == (Reason.QUEUE_FULL, pytest.approx(13.0))
    # With every backend down the bound is one backend's (the arrival is 503 before that).
    assert POLICY.overflow_fleet(Priority.NORMAL, 4, 30, [Target("c", down)]) is not None


# -- plan -------------------------------------------------------------------------------------


def waiters(*asks: Ask, bypassed: tuple[int, ...] = ()) -> list[Waiter]:
    counts = bypassed or (0,) * len(asks)
    return [Waiter(key, a, count) for key, (a, count) in enumerate(zip(asks, counts, strict=True))]


def test_admits_in_order_while_blocks_last() -> None:
    plan = POLICY.plan(waiters(ask(10), ask(10), ask(10)), budget(25), None, now=0.0)
    assert plan.admit == (0, 1)
    assert plan.shed == ()
    assert plan.bypassed == ()


def test_small_requests_overtake_a_big_head_a_bounded_number_of_times() -> None:
    queue = waiters(ask(30), ask(5), ask(5), ask(5))
    plan = POLICY.plan(queue, budget(20), None, now=0.0)
    # max_bypass = 2: two overtake the head, the third waits behind it.
    assert plan.admit == (1, 2)
    assert plan.bypassed == ((0, 2),)
    blocked = POLICY.plan(waiters(ask(30), ask(5), bypassed=(2, 0)), budget(20), None, now=0.0)
    assert blocked.admit == ()


def test_a_big_head_with_time_to_spare_is_overtaken_beyond_the_count() -> None:
    # 20 blocks short at 10 blocks/s: 2 s if blocks were held for it; its deadline is 10 s
    # away, so blocking now would idle the pool for nothing. The count bound (2) still holds.
    queue = waiters(ask(30, deadline=10.0), ask(5), ask(5), ask(5))
    plan = POLICY.plan(queue, budget(10), drain_rate=10.0, now=0.0)
    assert plan.admit == (1, 2)
    assert plan.bypassed == ((0, 2),)
    unbounded = AdmissionPolicy(replace(CONFIG, max_bypass=1000))
    assert unbounded.plan(queue, budget(15), drain_rate=10.0, now=0.0).admit == (1, 2, 3)


def test_a_big_head_blocks_the_queue_once_its_deadline_needs_the_blocks() -> None:
    policy = AdmissionPolicy(replace(CONFIG, max_bypass=1000, hol_deadline_share=0.5))
    queue = waiters(ask(30, deadline=10.0), ask(5))
    # 20 blocks short at 10 blocks/s = 2 s: below half of the 10 s left, the small one passes.
    assert policy.plan(queue, budget(10), drain_rate=10.0, now=0.0).admit == (1,)
    # 6 s later only 4 s are left: 2 s is half of them, so the blocks are held for the head.
    assert policy.plan(queue, budget(10), drain_rate=10.0, now=6.0).admit == ()
    # A slower drain reaches the same point earlier: 20 blocks at 4 blocks/s = 5 s of 10.
    assert policy.plan(queue, budget(10), drain_rate=4.0, now=0.0).admit == ()
    # Without a drain rate only the count bounds the bypass.
    assert policy.plan(queue, budget(10), None, now=6.0).admit == (1,)


def test_zero_deadline_share_blocks_at_once() -> None:
    policy = AdmissionPolicy(replace(CONFIG, max_bypass=1000, hol_deadline_share=0.0))
    plan = policy.plan(waiters(ask(30, deadline=10.0), ask(5)), budget(20), drain_rate=10.0, now=0.0)
    assert plan.admit == ()


def test_zero_bypass_is_strict_fifo() -> None:
    policy = AdmissionPolicy(replace(CONFIG, max_bypass=0))
    plan = policy.plan(waiters(ask(30), ask(5)), budget(20), None, now=0.0)
    assert plan.admit == ()


def test_expired_waiters_are_shed_wherever_they_are() -> None:
    plan = POLICY.plan(waiters(ask(50, deadline=5.0), ask(5, deadline=1.0)), budget(10), None, now=2.0)
    assert [(key, d.reason) for key, d in plan.shed] == [(1, Reason.DEADLINE_EXPIRED)]


def test_predicted_miss_is_shed_early_with_a_drain_based_retry_hint() -> None:
    # 40 blocks short at 10 blocks/s: 4 s; the deadline is 3 s away.
    plan = POLICY.plan(waiters(ask(50, deadline=3.0)), budget(10), drain_rate=10.0, now=0.0)
    ((key, decision),) = plan.shed
    assert (key, decision.kind, decision.reason) == (0, DecisionKind.SHED, Reason.DEADLINE_UNREACHABLE)
    assert decision.retry_after_s == pytest.approx(4.0)


def test_a_waiter_past_the_refusal_horizon_keeps_its_place_until_its_deadline() -> None:
    # 40 blocks short at 10 blocks/s: 4 s; arrived at 0 with a deadline at 3.5 s.
    late_call = ask(50, deadline=3.5)
    young = POLICY.plan(waiters(late_call), budget(10), 10.0, now=CONFIG.refuse_within_s - 0.01)
    assert [(k, d.reason) for k, d in young.shed] == [(0, Reason.DEADLINE_UNREACHABLE)]
    # Past the horizon the same prediction no longer refuses it: a refusal that late would
    # reach a client that has already waited for nothing.
    old = POLICY.plan(waiters(late_call), budget(10), 10.0, now=CONFIG.refuse_within_s)
    assert (old.admit, old.shed) == ((), ())
    # It still holds the queue for its blocks, and goes at its deadline if they never come.
    behind = POLICY.plan(waiters(late_call, ask(5)), budget(10), 10.0, now=CONFIG.refuse_within_s)
    assert (behind.admit, behind.shed) == ((), ())
    expired = POLICY.plan(waiters(late_call), budget(10), 10.0, now=3.5)
    assert [(k, d.reason) for k, d in expired.shed] == [(0, Reason.DEADLINE_EXPIRED)]
    assert POLICY.plan(waiters(late_call), budget(50), 10.0, now=3.0).admit == (0,)


def test_work_ahead_counts_in_the_predicted_wait() -> None:
    # The second waiter needs 10 but 40 are queued ahead of it: (40 + 10 - 0) / 10 = 5 s.
    queue = waiters(ask(40, deadline=100.0), ask(10, deadline=4.0))
    plan = POLICY.plan(queue, budget(0), drain_rate=10.0, now=0.0)
    assert [key for key, _ in plan.shed] == [1]
    relaxed = POLICY.plan(waiters(ask(40, deadline=100.0), ask(10, deadline=6.0)), budget(0), 10.0, now=0.0)
    assert relaxed.shed == ()


def test_the_wait_predicted_for_each_arrival_that_stays_is_reported() -> None:
    queue = [
        Waiter(0, ask(40, deadline=100.0)),  # queued before: no new prediction
        Waiter(1, ask(10, deadline=100.0), arriving=True),  # (40 + 10 - 5) / 10 = 4.5 s
        Waiter(2, ask(5), arriving=True),  # fits, admitted: nothing to predict
        Waiter(3, ask(10, deadline=1.0), arriving=True),  # shed: nothing to predict
    ]
    plan = AdmissionPolicy(replace(CONFIG, max_bypass=5)).plan(queue, budget(5), 10.0, now=0.0)
    assert plan.admit == (2,)
    assert [key for key, _ in plan.shed] == [3]
    assert plan.predicted == (Prediction(1, pytest.approx(4.5), pytest.approx(4.5)),)
    assert POLICY.plan(queue, budget(5), None, now=0.0).predicted == ()  # no rate, no prediction


@dataclass(frozen=True)
class BySize:
    """A WaitScale: `small` for requests up to a tenth of the pool, `large` above."""

    small: float
    large: float

    def factor(self, blocks: int, pool_blocks: int) -> float:
        return self.small if blocks <= pool_blocks / 10 else self.large


def test_a_size_correction_moves_arrivals_early_shedding_both_ways() -> None:
    # 100-block pool, 10 free, 10 blocks/s, 60 blocks queued ahead (no bypass allowance left).
    ahead = Waiter(0, ask(60, deadline=100.0), bypassed=CONFIG.max_bypass)
    small = Waiter(1, ask(5, deadline=6.0), arriving=True)  # in order (60 + 5 - 10) / 10: 5.5 s
    large = Waiter(2, ask(40, deadline=13.0), arriving=True)  # (60 + 5 + 40 - 10) / 10: 9.5 s
    queue = [ahead, small, large]
    scale = BySize(small=0.2, large=2.0)
    # In order, the small one is shed (5.5 s against its 6 s deadline less the slack) and the
    # large one stays (9.5 s against 13 s).
    policy = AdmissionPolicy(replace(CONFIG, arrival_slack=0.1))
    plain = policy.plan(queue, budget(10), 10.0, now=0.0)
    assert [key for key, _ in plain.shed] == [1]
    # Corrected for size, the small one waits 1.1 s and stays; the large one 2 x 9.5 s = 19 s
    # (the small one, staying, now counts ahead of it) and is shed at once.
    corrected = policy.plan(queue, budget(10), 10.0, now=0.0, scale=scale)
    assert [(key, d.reason) for key, d in corrected.shed] == [(2, Reason.DEADLINE_UNREACHABLE)]
    assert corrected.predicted == (Prediction(1, pytest.approx(1.1), pytest.approx(5.5)),)
    # Waiters queued before are judged by the in-order wait (and without the arrival slack):
    # the correction is for arrivals. Both stay, whatever the scale says.
    settled = [ahead, replace(small, arriving=False), replace(large, arriving=False)]
    assert policy.plan(settled, budget(10), 10.0, now=0.0, scale=BySize(0.01, 100.0)).shed == ()


def test_an_arrival_must_leave_slack_before_its_deadline_a_waiter_need_not() -> None:
    slack = AdmissionPolicy(replace(CONFIG, arrival_slack=0.2))
    # Ready in 4 s (40 blocks short at 10/s); deadline 4.5 s away: 0.5 s of slack, under 20%.
    close_call = ask(50, deadline=4.5)
    arriving = slack.plan([Waiter(0, close_call, arriving=True)], budget(10), 10.0, now=0.0)
    assert [(k, d.reason) for k, d in arriving.shed] == [(0, Reason.DEADLINE_UNREACHABLE)]
    # Once queued, the prediction only has to meet the deadline itself.
    assert slack.plan([Waiter(0, close_call)], budget(10), 10.0, now=0.0).shed == ()
    assert slack.plan([Waiter(0, ask(50, deadline=5.5), arriving=True)], budget(10), 10.0, now=0.0).shed == ()


def test_no_early_shedding_without_an_observed_rate() -> None:
    assert POLICY.plan(waiters(ask(50, deadline=3.0)), budget(10), None, now=0.0).shed == ()
    assert POLICY.plan(waiters(ask(50, deadline=3.0)), budget(10), 10.0, now=0.0).shed != ()


def test_unknown_budget_admits_nobody_and_a_down_backend_sheds_everyone() -> None:
    queue = waiters(ask(1), ask(1, deadline=1.0))
    stale = POLICY.plan(queue, budget(100, known=False, state=BudgetState.STALE), None, now=2.0)
    assert stale.admit == ()
    assert [(k, d.reason) for k, d in stale.shed] == [(1, Reason.DEADLINE_EXPIRED)]
    down = POLICY.plan(queue, budget(100, known=False, state=BudgetState.DOWN), None, now=0.0)
    assert [d.reason for _, d in down.shed] == [Reason.BACKEND_DOWN, Reason.BACKEND_DOWN]


@pytest.mark.parametrize(
    ("blocks", "rate", "expected"),
    [(10, None, 1.0), (10, 0.0, 1.0), (10, 5.0, 2.0), (0, 5.0, 0.25), (10_000, 1.0, 60.0)],
)
def test_retry_advice(blocks: float, rate: float | None, expected: float) -> None:
    assert retry_after(blocks, rate) == expected


# -- properties -------------------------------------------------------------------------------

ask_strategy = st.builds(
    lambda blocks, priority, deadline: Ask(blocks, blocks, priority, 0.0, deadline),
    st.integers(0, 60),
    st.sampled_from(list(Priority)),
    st.one_of(st.just(math.inf), st.floats(0.0, 20.0)),
)


@settings(max_examples=300, deadline=None)
@given(
    asks=st.lists(ask_strategy, max_size=12),
    free=st.integers(0, 100),
    bypassed=st.lists(st.integers(0, 4), min_size=12, max_size=12),
    rate=st.one_of(st.none(), st.floats(0.1, 50.0)),
    now=st.floats(0.0, 20.0),
)
def test_plan_never_admits_beyond_the_free_blocks(
    asks: list[Ask], free: int, bypassed: list[int], rate: float | None, now: float
) -> None:
    ordered = sorted(asks, key=lambda a: a.priority.rank)
    queue = [Waiter(i, a, bypassed[i]) for i, a in enumerate(ordered)]
    plan = POLICY.plan(queue, budget(free), rate, now)
    by_key = {w.key: w for w in queue}
    assert sum(by_key[k].ask.reserve_blocks for k in plan.admit) <= free
    decided = list(plan.admit) + [k for k, _ in plan.shed]
    assert len(decided) == len(set(decided))  # nobody is both admitted and shed
    for key, _ in plan.shed:
        assert key in by_key
    for key in plan.admit:
        assert now < by_key[key].ask.deadline_at  # nobody is admitted past its deadline


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.one_of(
            st.tuples(st.just("arrive"), ask_strategy),
            st.tuples(st.just("finish"), st.integers(0, 30)),
            st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
        ),
        max_size=50,
    ),
    pool=st.integers(1, 100),
)
def test_simulated_queue_keeps_budget_deadlines_and_bypass_bound(
    events: list[tuple[str, object]], pool: int
) -> None:
    """Drive the policy as the wait queue does, against a ledger of admitted blocks."""
    now = 0.0
    admitted: dict[int, int] = {}  # key -> blocks
    queue: list[Waiter] = []
    key = 0
    for kind, value in events:
        if kind == "arrive":
            assert isinstance(value, Ask)
            a = replace(
                value,
                reserve_blocks=min(value.reserve_blocks, pool),
                max_blocks=min(value.max_blocks, pool),
                arrived_at=now,
                deadline_at=now + (value.deadline_at if math.isfinite(value.deadline_at) else 1e9),
            )
            queue.append(Waiter(key, a))
            queue.sort(key=lambda w: (w.ask.priority.rank, w.key))
            key += 1
        elif kind == "finish" and admitted:
            assert isinstance(value, int)
            victim = sorted(admitted)[value % len(admitted)]
            del admitted[victim]
        elif kind == "tick":
            assert isinstance(value, float)
            now += value
        committed = sum(admitted.values())
        plan = POLICY.plan(queue, budget(pool - committed, total=pool), 5.0, now)
        by_key = {w.key: w for w in queue}
        for k in plan.admit:
            admitted[k] = by_key[k].ask.reserve_blocks
        gone = set(plan.admit) | {k for k, _ in plan.shed}
        increments = dict(plan.bypassed)
        queue = [
            replace(w, bypassed=w.bypassed + increments.get(w.key, 0)) for w in queue if w.key not in gone
        ]
        # Never admitted beyond the budget.
        assert sum(admitted.values()) <= pool
        # Deadlines are never exceeded while queued.
        assert all(w.ask.deadline_at > now for w in queue)
        # Nobody is overtaken more than max_bypass times.
        for w in queue:
            assert w.bypassed <= CONFIG.max_bypass
