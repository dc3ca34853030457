"""The budget: closed loop correcting the open loop both ways, AIMD, staleness (fake clock)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from estimator.demand import BlockCost, Demand
from gateway.capacity import AimdLimit, BudgetState, CapacityConfig, KvBudget
from gateway.ledger import InMemoryLedger
from gateway.vllm_metrics import BackendReading

CONFIG = CapacityConfig(
    stale_after_s=1.0,
    scrape_interval_s=0.2,
    scrape_timeout_s=0.5,
    settle_s=0.5,
    unknown_is_saturated=True,
    down_after_failures=2,
    max_fraction=1.0,
    decrease_factor=0.8,
    quiet_s=5.0,
    decrease_cooldown_s=2.0,
)
COST = BlockCost(block_size=16)


def reading(
    used: float, *, total: int = 100, waiting: int = 0, preemptions: float | None = 0.0
) -> BackendReading:
    return BackendReading(
        total_blocks=total,
        block_size=16,
        used_blocks=used,
        running=0,
        waiting=waiting,
        preemptions_total=preemptions,
        engines=1,
        prefix_caching=True,
    )


def moving(used: float, step: int) -> BackendReading:
    """A reading of an engine that has stepped and whose metrics text changed since the last."""
    return replace(reading(used), engine_steps_total=float(step), digest=float(step))


def booking(prompt_blocks: int, expected_blocks: int = 0) -> Demand:
    return Demand(
        prompt_tokens=(prompt_blocks * 16,),
        max_output_tokens=1000,
        expected_output_tokens=expected_blocks * 16,
        samples_per_prompt=1,
        cost=COST,
    )


def test_unseen_budget_is_unknown() -> None:
    budget = KvBudget(CONFIG, InMemoryLedger())
    snapshot = budget.snapshot(now=0.0)
    assert snapshot.state is BudgetState.UNSEEN
    assert not snapshot.known
    assert snapshot.free_blocks == 0


def test_fresh_reading_with_empty_ledger() -> None:
    budget = KvBudget(CONFIG, InMemoryLedger())
    budget.observe(reading(0.0), started_at=10.0, now=10.01)
    snapshot = budget.snapshot(now=10.2)
    assert snapshot.state is BudgetState.FRESH
    assert snapshot.known
    assert (snapshot.total_blocks, snapshot.admissible_blocks, snapshot.free_blocks) == (100, 100, 100)


def test_usage_the_ledger_does_not_explain_counts_as_external() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(10, 5), now=0.0)  # holds 10, reserves 15
    budget = KvBudget(CONFIG, ledger)
    # vLLM reports 30 used: 10 are ours, 1 block of slack for our one sequence, 19 are not.
    result = budget.observe(reading(30.0), started_at=10.0, now=10.0)
    assert result.external_blocks == 19
    snapshot = budget.snapshot(now=10.1)
    assert snapshot.committed_blocks == 15 + 19
    assert snapshot.free_blocks == 100 - 34


def test_external_usage_follows_the_ledger_between_scrapes() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(10, 5), now=0.0)
    budget = KvBudget(CONFIG, ledger)
    budget.observe(reading(30.0), started_at=10.0, now=10.0)
    ledger.close(1)  # completes before the next scrape: its 15 reserved blocks free at once
    assert budget.snapshot(now=10.1).committed_blocks == 19


def test_a_request_that_just_ended_is_not_taken_for_external_usage() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(20), now=0.0)
    ledger.open(2, booking(5), now=0.0)
    budget = KvBudget(CONFIG, ledger)
    assert budget.observe(reading(25.0), started_at=10.0, now=10.01).external_blocks == 0
    ledger.close(1)  # ends while the next scrape is under way, which still sees its 20 blocks
    result = budget.observe(reading(25.0), started_at=10.2, now=10.21)
    assert result.external_blocks == 0
    assert budget.snapshot(now=10.21).committed_blocks == 5
    # Settle time later vLLM still reports them: no longer explained by the ended request.
    assert budget.observe(reading(25.0), started_at=10.8, now=10.81).external_blocks == 19
    ledger.close(2)  # its 5 blocks may still be reported for the settle time, no longer
    assert budget.observe(reading(25.0), started_at=11.0, now=11.01).external_blocks == 25 - 5
    assert budget.observe(reading(25.0), started_at=12.0, now=12.01).external_blocks == 25


def test_less_usage_than_settled_entries_hold_is_credited() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(20), now=0.0)
    ledger.open(2, booking(20), now=0.0)  # same prompt: vLLM shares the prefix blocks
    budget = KvBudget(CONFIG, ledger)
    result = budget.observe(reading(20.0), started_at=10.0, now=10.0)
    assert result.kept_fraction == pytest.approx(0.5)
    assert budget.snapshot(now=10.0).committed_blocks == 40 - 20
    ledger.close(2)  # its credit leaves with it
    assert budget.snapshot(now=10.0).committed_blocks == 20 - 10


def test_fresh_entries_earn_no_credit() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(20), now=9.8)  # admitted 0.2 s before the scrape: maybe not in vLLM yet
    budget = KvBudget(CONFIG, ledger)
    result = budget.observe(reading(0.0), started_at=10.0, now=10.0)
    assert (result.kept_fraction, result.external_blocks) == (1.0, 0)
    assert budget.snapshot(now=10.0).committed_blocks == 20


def test_no_credit_while_vllm_has_waiting_requests() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(20), now=0.0)
    budget = KvBudget(CONFIG, ledger)
    result = budget.observe(reading(5.0, waiting=1), started_at=10.0, now=10.0)
    assert result.kept_fraction == 1.0
    assert budget.snapshot(now=10.0).committed_blocks == 20


@pytest.mark.parametrize(
    ("age_s", "state", "known"),
    [(0.0, BudgetState.FRESH, True), (1.0, BudgetState.FRESH, True), (1.01, BudgetState.STALE, False)],
)
def test_staleness(age_s: float, state: BudgetState, known: bool) -> None:
    budget = KvBudget(CONFIG, InMemoryLedger())
    budget.observe(reading(0.0), started_at=10.0, now=10.0)
    snapshot = budget.snapshot(now=10.0 + age_s)
    assert (snapshot.state, snapshot.known) == (state, known)


def test_stale_budget_may_fall_back_on_the_ledger_when_configured() -> None:
    ledger = InMemoryLedger()
    budget = KvBudget(replace(CONFIG, unknown_is_saturated=False), ledger)
    budget.observe(reading(50.0), started_at=10.0, now=10.0)  # 50 external blocks
    snapshot = budget.snapshot(now=20.0)
    assert snapshot.state is BudgetState.STALE
    assert snapshot.known
    assert snapshot.committed_blocks == 0  # the correction is dropped with the fresh data


def test_unreachable_backend_goes_down_and_recovers() -> None:
    budget = KvBudget(CONFIG, InMemoryLedger())
    budget.observe(reading(0.0), started_at=10.0, now=10.0)
    budget.observe_failure("refused", unreachable=True, now=10.2)
    assert budget.state(10.3) is BudgetState.FRESH  # one failure is not enough
    budget.observe_failure("refused", unreachable=True, now=10.4)
    assert budget.state(10.5) is BudgetState.DOWN
    assert "refused" in budget.snapshot(10.5).detail
    budget.observe(reading(0.0), started_at=11.0, now=11.0)
    assert budget.state(11.0) is BudgetState.FRESH


def test_a_failed_request_makes_the_budget_suspect_until_a_newer_scrape() -> None:
    budget = KvBudget(replace(CONFIG, unknown_is_saturated=False), InMemoryLedger())
    budget.observe(reading(0.0), started_at=10.0, now=10.0)
    budget.suspect(now=10.1)
    snapshot = budget.snapshot(10.1)
    assert snapshot.state is BudgetState.SUSPECT
    assert not snapshot.known  # even when configured to trust the ledger alone
    budget.observe(reading(0.0), started_at=10.05, now=10.15)  # began before the failure
    assert budget.state(10.15) is BudgetState.SUSPECT
    budget.observe(reading(0.0), started_at=10.2, now=10.25)
    assert budget.state(10.25) is BudgetState.FRESH
    # Suspect, then unreachable scrapes: down wins.
    budget.suspect(now=11.0)
    budget.observe_failure("refused", unreachable=True, now=11.1)
    budget.observe_failure("refused", unreachable=True, now=11.2)
    assert budget.state(11.2) is BudgetState.DOWN


def test_a_late_scrape_that_has_not_failed_may_still_renew_a_stale_budget() -> None:
    budget = KvBudget(CONFIG, InMemoryLedger())
    budget.observe(reading(0.0), started_at=10.0, now=10.0)
    assert not budget.snapshot(10.9).renewing  # fresh: nothing to renew
    late = budget.snapshot(11.2)  # stale, within one scrape's interval and time limit past it
    assert (late.state, late.known, late.renewing, late.settles_soon) == (
        BudgetState.STALE,
        False,
        True,
        True,
    )
    assert "in flight" in late.detail
    assert budget.snapshot(11.69).renewing
    # Past the interval and the time limit no scrape in flight can renew it any more.
    gone = budget.snapshot(11.71)
    assert (gone.state, gone.renewing, gone.settles_soon) == (BudgetState.STALE, False, False)
    # A scrape that answered wrong settles it the other way at once.
    budget.observe_failure("malformed", unreachable=False, now=11.1)
    assert not budget.snapshot(11.2).renewing
    # Nobody reads the metrics any more: nothing is in flight.
    budget.observe(reading(0.0), started_at=20.0, now=20.0)
    budget.halt("the poller ended")
    assert not budget.snapshot(20.1).settles_soon


def test_scrapes_too_slow_leave_a_stale_budget_renewable_until_as_many_as_mark_a_backend_down() -> None:
    budget = KvBudget(CONFIG, InMemoryLedger())
    budget.observe(reading(0.0), started_at=10.0, now=10.0)
    # One scrape timed out (CONFIG: 0.2 s apart, 0.5 s each): the next, in flight, may renew
    # the reading until it is 1.0 + 2 * 0.7 s old.
    budget.observe_failure("timed out reading the body", unreachable=False, slow=True, now=11.3)
    assert budget.snapshot(11.4).settles_soon
    assert budget.snapshot(12.39).renewing
    assert not budget.snapshot(12.41).renewing
    # A second one (down_after_failures = 2): the backend is taken as unable to answer.
    budget.observe_failure("timed out reading the body", unreachable=False, slow=True, now=12.0)
    assert not budget.snapshot(12.1).settles_soon
    # A good scrape resets the count; a wrong answer after a slow one ends the renewal at once.
    budget.observe(reading(0.0), started_at=20.0, now=20.0)
    budget.observe_failure(
        "timed out waiting for the response headers", unreachable=False, slow=True, now=21.3
    )
    assert budget.snapshot(21.4).renewing
    budget.observe_failure("HTTP 500", unreachable=False, now=21.6)
    assert not budget.snapshot(21.7).renewing
    # An unreachable backend is not slow: no renewal either.
    budget.observe(reading(0.0), started_at=30.0, now=30.0)
    budget.observe_failure("cannot connect", unreachable=True, now=31.3)
    assert not budget.snapshot(31.4).renewing


def test_a_resized_pool_resets_the_counter_baseline() -> None:
    budget = KvBudget(CONFIG, InMemoryLedger())
    budget.observe(reading(0.0, preemptions=50.0), started_at=0.0, now=0.0)
    budget.observe(reading(0.0, total=80, preemptions=3.0), started_at=1.0, now=1.0)
    assert budget.limit.fraction == 1.0
    assert budget.snapshot(1.0).total_blocks == 80


# The share past the pool: (time, preemptions_total, headroom) observations -> fraction after
# each, with room for 0.6 past the pool at most and growth resuming 5 s after a preemption.
GROWING = replace(CONFIG, overcommit=0.6)


@pytest.mark.parametrize(
    ("observations", "fractions"),
    [
        pytest.param([(0, 0, 0.0), (1, 0, 0.0), (2, 0, 0.0)], [1.0, 1.0, 1.0], id="quiet-at-the-pool"),
        pytest.param([(0, 0, 0.6), (1, 0, 0.6), (2, 0, 0.6)], [1.0, 1.25, 1.5], id="room-grows-it"),
        # The second before the preemption grew it to the ceiling (1.6) first.
        pytest.param([(0, 0, 0.6), (2, 0, 0.6), (3, 3, 0.6)], [1.0, 1.5, 1.28], id="preemption-cuts-it"),
        pytest.param(
            [(0, 0, 0.6), (2, 0, 0.6), (3, 3, 0.0), (4, 5, 0.0), (5.5, 6, 0.0)],
            [1.0, 1.5, 1.2, 1.2, 1.0],
            id="cooldown-bounds-cuts",
        ),
        pytest.param(
            [(0, 0, 0.0), (1, 1, 0.0), (3.1, 2, 0.0), (5.2, 3, 0.0)],
            [1.0, 1.0, 1.0, 1.0],
            id="never-below-the-pool",
        ),
        pytest.param(
            [(0, 0, 0.6), (2, 0, 0.6), (3, 1, 0.6), (7, 1, 0.6), (9, 1, 0.6)],
            [1.0, 1.5, 1.28, 1.28, 1.53],
            id="growth-resumes-after-quiet",
        ),
        pytest.param([(0, 10, 0.0), (1, 2, 0.0)], [1.0, 1.0], id="counter-reset-is-not-pressure"),
        pytest.param([(0, None, 0.6), (1, None, 0.6)], [1.0, 1.25], id="no-counter"),
    ],
)
def test_aimd(observations: list[tuple[float, float | None, float]], fractions: list[float]) -> None:
    limit = AimdLimit(GROWING)
    seen = []
    for now, total, headroom in observations:
        limit.observe(total, now, headroom=headroom)
        seen.append(round(limit.fraction, 6))
    assert seen == pytest.approx(fractions)


def test_preemptions_take_back_the_overcommit_only() -> None:
    # Reservations are peaks: those admitted within the pool cannot run one another out of
    # blocks, so preemptions there are no reason to promise less than the pool.
    ledger = InMemoryLedger()
    ledger.open(1, booking(10), now=0.0)  # the gateway has a request in flight
    budget = KvBudget(CONFIG, ledger)
    budget.observe(reading(10.0, preemptions=0.0), started_at=0.0, now=0.0)
    budget.observe(reading(10.0, preemptions=2.0), started_at=0.2, now=0.2)
    snapshot = budget.snapshot(0.3)
    assert snapshot.admissible_blocks == 100
    assert snapshot.pool_limit_blocks == 100
    assert budget.limit.preemptions_seen == 2.0


def test_preemptions_with_nothing_of_ours_in_flight_do_not_shrink_the_budget() -> None:
    # Traffic that bypassed the gateway preempted itself: counted, but no reason to admit less.
    budget = KvBudget(CONFIG, InMemoryLedger())
    budget.observe(reading(0.0, preemptions=0.0), started_at=0.0, now=0.0)
    budget.observe(reading(40.0, preemptions=5.0), started_at=0.2, now=0.2)
    assert budget.limit.fraction == 1.0
    assert budget.limit.preemptions_seen == 5.0


def test_config_refuses_a_share_outside_the_pool() -> None:
    with pytest.raises(ValueError, match="max_fraction"):
        replace(CONFIG, max_fraction=1.2)


OVERCOMMIT = replace(CONFIG, overcommit=0.3, overcommit_room=0.25)


def test_aimd_grows_past_the_pool_only_by_the_headroom_it_is_given() -> None:
    limit = AimdLimit(OVERCOMMIT)
    limit.observe(0.0, 0.0, headroom=0.2)
    limit.observe(0.0, 10.0)
    assert limit.fraction == 1.0  # quiet, but nothing shows the reservations overstate
    limit.observe(0.0, 20.0, headroom=0.2)
    assert limit.fraction == pytest.approx(1.2)  # past the pool it grows fast, to the headroom
    limit.observe(0.0, 30.0)
    assert limit.fraction == pytest.approx(1.2)  # no headroom now: it stops, keeps its gain
    limit.observe(0.0, 60.0, headroom=0.9)
    assert limit.fraction == pytest.approx(1.3)  # never past max_fraction + overcommit
    limit.observe(3.0, 61.0, headroom=0.9)
    assert limit.fraction == pytest.approx(1.04)  # a preemption cuts it
    limit.observe(6.0, 64.0, headroom=0.9)
    assert limit.fraction == pytest.approx(1.0)  # down to the pool, never below


def test_without_overcommit_the_share_stays_within_its_bounds() -> None:
    limit = AimdLimit(CONFIG)
    limit.observe(0.0, 0.0, headroom=0.5)
    limit.observe(0.0, 100.0, headroom=0.5)
    assert limit.fraction == 1.0


def overstated_budget(ledger: InMemoryLedger, reserved: int = 30, reached: int = 20) -> KvBudget:
    """A budget that has seen 20 requests complete at `reached` of `reserved` blocks."""
    budget = KvBudget(OVERCOMMIT, ledger)
    for _ in range(20):
        budget.observe_completion(reserved, reached)
    return budget


def test_overstatement_is_what_completed_reservations_exceeded() -> None:
    budget = KvBudget(OVERCOMMIT, InMemoryLedger())
    for _ in range(19):
        budget.observe_completion(30, 20)
    assert budget.overstatement == 0.0  # too few to say
    budget.observe_completion(30, 20)
    assert budget.overstatement == pytest.approx(0.5)
    for _ in range(200):
        budget.observe_completion(20, 20)  # lengths now met exactly: it fades away
    assert budget.overstatement == pytest.approx(0.0, abs=1e-3)


def test_waiting_requests_and_an_underused_pool_grow_the_budget() -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(30, 40), now=0.0)  # holds 30, reserves 70
    budget = KvBudget(OVERCOMMIT, ledger)
    budget.observe(moving(0.0, 0), started_at=-0.5, now=-0.5)  # a scrape from before it came
    budget.observe(moving(30.0, 1), started_at=0.5, now=0.5, waiting=True)
    snapshot = budget.snapshot(0.6)
    assert snapshot.admissible_blocks == 125  # 1 s at OVERCOMMIT_GROWTH_PER_S
    assert snapshot.pool_limit_blocks == 100  # no single request may need more than the pool
    assert snapshot.free_blocks == 55
    budget.observe(moving(30.0, 3), started_at=11.0, now=11.0, waiting=True)
    assert budget.snapshot(11.1).admissible_blocks == 130  # never past max + overcommit
    # The same readings from an engine not seen to move (frozen, or no step counter) are no
    # evidence of room: the share stays at the pool.
    still = KvBudget(OVERCOMMIT, ledger)
    for now in (-0.5, 0.5, 11.0):
        still.observe(reading(30.0), started_at=now, now=now, waiting=True)
    assert still.snapshot(11.1).admissible_blocks == 100


@pytest.mark.parametrize(
    ("used", "vllm_waiting", "gateway_waiting", "reached"),
    [
        pytest.param(80.0, 0, True, 20, id="pool-nearly-full"),
        pytest.param(30.0, 2, True, 20, id="vllm-has-its-own-queue"),
        pytest.param(30.0, 0, False, 20, id="nobody-waits-in-the-gateway"),
    ],
)
def test_the_budget_stays_within_the_pool_without_evidence_of_room(
    used: float, vllm_waiting: int, gateway_waiting: bool, reached: int
) -> None:
    ledger = InMemoryLedger()
    ledger.open(1, booking(30, 40), now=0.0)
    budget = overstated_budget(ledger, reserved=30, reached=reached)
    for now in (1.0, 11.0, 21.0):
        budget.observe(reading(used, waiting=vllm_waiting), started_at=now, now=now, waiting=gateway_waiting)
    assert budget.snapshot(21.1).admissible_blocks == 100


def test_answers_certain_to_grow_are_no_evidence_of_room() -> None:
    # A request that holds 30 blocks and reserves 80, with `ignore_eos`: its floor is its
    # reservation. vLLM shows 70 of 100 unused, but 50 of them are certain to be filled: 20
    # unused is under the room of 25, and the share stays at the pool.
    certain = replace(booking(30, 50), floor_output_tokens=50 * 16)
    ledger = InMemoryLedger()
    ledger.open(1, certain, now=0.0)
    budget = KvBudget(OVERCOMMIT, ledger)
    budget.observe(moving(0.0, 0), started_at=-0.5, now=-0.5)
    budget.observe(moving(30.0, 1), started_at=0.5, now=0.5, waiting=True)
    budget.observe(moving(30.0, 3), started_at=11.0, now=11.0, waiting=True)
    assert budget.snapshot(11.1).admissible_blocks == 100
    # Halfway (25 of its 50 floor blocks grown) the same: what it holds is in vLLM's count.
    ledger.grow(1, 0, 25 * 16)
    budget.observe(moving(55.0, 4), started_at=21.0, now=21.0, waiting=True)
    assert budget.snapshot(21.1).admissible_blocks == 100
    # A floor of 10 blocks leaves 100 - 30 - 10 = 60 unused: room, and the share grows.
    partly = replace(booking(30, 50), floor_output_tokens=10 * 16)
    ledger = InMemoryLedger()
    ledger.open(1, partly, now=0.0)
    budget = KvBudget(OVERCOMMIT, ledger)
    budget.observe(moving(0.0, 0), started_at=-0.5, now=-0.5)
    budget.observe(moving(30.0, 1), started_at=0.5, now=0.5, waiting=True)
    assert budget.snapshot(0.6).admissible_blocks == 125


def test_blocks_sent_since_the_scrape_settled_count_as_used() -> None:
    # vLLM reports 30 of 100 used, but 50 more were just sent: 20 unused is under the room.
    ledger = InMemoryLedger()
    ledger.open(1, booking(30, 10), now=0.0)
    ledger.open(2, booking(50, 0), now=10.9)
    budget = overstated_budget(ledger)
    budget.observe(reading(30.0), started_at=1.0, now=1.0, waiting=True)
    budget.observe(reading(30.0), started_at=11.0, now=11.0, waiting=True)
    assert budget.snapshot(11.1).admissible_blocks == 100


def test_an_answer_sent_whole_grows_within_its_reservation_without_counting_twice() -> None:
    ledger = InMemoryLedger()
    # 4 prompt blocks, 10 more reserved for its answer, which the ledger will not see grow.
    ledger.open(1, booking(4, 10), now=0.0, streamed=False)
    budget = KvBudget(CONFIG, ledger)
    # vLLM holds prompt + 8 blocks of answer by now: within the reservation, nobody else's.
    budget.observe(reading(12.0), started_at=10.0, now=10.0)
    assert budget.external_blocks == 0
    assert budget.snapshot(now=10.0).committed_blocks == 14
    # The same growth of a streamed answer the ledger has not seen is someone else's usage.
    streamed = InMemoryLedger()
    streamed.open(1, booking(4, 10), now=0.0)
    other = KvBudget(CONFIG, streamed)
    other.observe(reading(12.0), started_at=10.0, now=10.0)
    assert other.external_blocks > 0
    # Past its reservation, the excess is external after all.
    budget.observe(reading(20.0), started_at=11.0, now=11.0)
    assert budget.external_blocks == 20 - 14 - 1  # one partly filled block per sequence tolerated
