"""The admission policy: a request's block demand + the budget (+ now) -> a Decision (pure).

Two entry points, both free of I/O and of the clock:

- `screen(ask, budget, now)`: the checks an arrival must pass before it may join the queue at
  all (too big for the whole pool, no budget known, deadline already gone). Returns a refusal
  or None. `overflow` then sheds an arrival that would have to wait in a full queue.
- `plan(waiters, budget, drain_rate, now)`: given everyone waiting, in queue order, which to
  admit now, which to shed (deadline passed, or predicted to pass before the blocks they need
  free up), and which stay. The wait queue calls it on every change: an arrival, a completed
  reservation, a new scrape, a deadline timer.

Order: priority class first (high, normal, low), then arrival.

Head-of-line strategy, bypass until the deadline needs the blocks: a waiter that does not fit
does not stop smaller requests behind it from being admitted into the blocks that are free.
It blocks the queue (nothing behind it is admitted until it fits, so blocks accumulate for it
as in-flight requests complete) once either bound is reached:

- its deadline: the wait it would have if blocks were held for it from now on (its shortfall
  over the drain rate) reaches `hol_deadline_share` of the time left to its deadline. Holding
  blocks idle costs the whole queue throughput, so it is done only when the large request
  would otherwise be late: with a share of one half, a drain twice slower than predicted
  still lets it in on time;
- its count: it has been overtaken `max_bypass` times, a backstop for when no drain rate is
  known and against bypass without end.

Both bounds are needed. The count alone, at 8, blocked the queue within a tenth of a second of
a burst, and the pool sat partly empty behind every large prompt (vLLM's KV usage averaged 0.6
with a full queue on the CPU testbed); at 128 the large prompts were starved instead and some
were refused seconds later, at their deadlines. The deadline alone let large requests linger
at the head so long that everything behind them was predicted to wait, and refused.
Bypassing crosses priority classes the same way (a low request may fill blocks a high one
cannot use yet, within the same bounds).

Predicted wait: the blocks that must free up before a waiter fits (everything still queued
ahead of it, plus its own reservation, minus what is free) divided by the observed rate at
which blocks free up. When that lands past its deadline it is shed at once with 429 rather
than left to time out; with no rate observed yet nobody is shed early. That prediction holds
for a queue served in order; bypassing makes small requests wait less and large ones more, and
an optional `WaitScale` corrects an arrival's prediction for its size.

Two deadlines per request: `deadline_at`, past which the client no longer waits (it is shed
then, or as soon as that is predicted), and `objective_at`, when it wants its first token. The
objective weighs only on a `strict` arrival, in its first plan: one that a plain queue would
have served past its deadline (see `gateway.rates.VirtualBacklog`), i.e. one that arrives while
the offered load is beyond what the backend can serve within the clients' patience. Predicted
to miss its objective, it is shed at once. In a burst the backend absorbs, the same request
still finishes in time and is served; under overload it would take the place of later
requests that can still meet theirs. Once queued, a request is never shed for its objective:
a late first token is better than a late 429.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gateway.capacity import BudgetSnapshot, BudgetState


class Priority(StrEnum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        """Queue order: lower goes first."""
        return _PRIORITY_RANK[self]


_PRIORITY_RANK: Mapping[Priority, int] = {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}


class DecisionKind(StrEnum):
    ADMIT = "admit"
    QUEUE = "queue"
    SHED = "shed"  # the client may retry later: 429 or 503 with Retry-After
    REJECT = "reject"  # retrying cannot help: 400, x-should-retry false


class Reason(StrEnum):
    """Why a decision was taken; a small closed set, used as a metric label."""

    FITS = "fits"
    NO_ROOM = "no_room"
    QUEUE_FULL = "queue_full"
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    OBJECTIVE_UNREACHABLE = "objective_unreachable"  # beyond capacity, its first token would be late
    DEADLINE_EXPIRED = "deadline_expired"
    BUDGET_UNKNOWN = "budget_unknown"
    BACKEND_DOWN = "backend_down"
    EXCEEDS_POOL = "exceeds_pool"
    SHUTTING_DOWN = "shutting_down"


@dataclass(frozen=True, slots=True)
class Decision:
    kind: DecisionKind
    reason: Reason
    retry_after_s: float | None = None


ADMIT = Decision(DecisionKind.ADMIT, Reason.FITS)


@dataclass(frozen=True, slots=True)
class Ask:
    """What the policy weighs of one request, in blocks and monotonic seconds.

    `reserve_blocks` is what admitting it commits (prompt + expected output); `max_blocks` is its
    worst case (every sequence runs to its cap), checked against the pool. `deadline_at` is the
    last moment it may still leave the queue usefully (math.inf: none); `objective_at` the last
    moment that still meets its first-token objective (see the module docstring).
    """

    reserve_blocks: int
    max_blocks: int
    priority: Priority
    arrived_at: float
    deadline_at: float
    objective_at: float = math.inf


@dataclass(frozen=True, slots=True)
class Waiter:
    """A queued request as the policy sees it. `bypassed`: admissions that overtook it;
    `arriving`: this is its first plan; `strict`: its objective counts in this plan (an arrival
    beyond capacity, see above)."""

    key: int
    ask: Ask
    bypassed: int = 0
    arriving: bool = False
    strict: bool = False


@dataclass(frozen=True, slots=True)
class RetryAdvice:
    """How Retry-After is derived: the predicted drain time of the queue, within bounds."""

    default_s: float
    min_s: float
    max_s: float

    def after(self, blocks_to_free: float, drain_rate: float | None) -> float:
        if drain_rate is None or drain_rate <= 0:
            return self.default_s
        return min(self.max_s, max(self.min_s, blocks_to_free / drain_rate))


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    max_queued: Mapping[Priority, int]
    max_bypass: int
    early_shed: bool
    retry: RetryAdvice
    # A waiter blocks the queue once its wait, were blocks held for it, reaches this share of
    # the time left to its deadline (see the module docstring). 0: no bypass once a drain rate
    # is known.
    hol_deadline_share: float = 0.5
    # An arrival must be predicted ready this share of its time to the deadline early: a
    # prediction has errors, and a request let in on a close call that then misses would be
    # shed late, after waiting for nothing.
    arrival_slack: float = 0.0


class WaitScale(Protocol):
    """Corrects an in-order wait prediction for a request's size (see
    `gateway.rates.WaitCalibration`)."""

    def factor(self, blocks: int, pool_blocks: int) -> float: ...


@dataclass(frozen=True, slots=True)
class Prediction:
    """What an arriving waiter that stays was predicted to wait: `wait_s`, the prediction its
    early shedding weighed, and `in_order_s`, the same before any correction for its size."""

    key: int
    wait_s: float
    in_order_s: float


@dataclass(frozen=True, slots=True)
class Plan:
    """The outcome of one `plan` call. `admit` is in admission order; `bypassed` lists the
    waiters that stay queued and were overtaken, with how many times in this plan; `predicted`
    the waits of the arriving waiters that stay, when a drain rate is known."""

    admit: tuple[int, ...]
    shed: tuple[tuple[int, Decision], ...]
    bypassed: tuple[tuple[int, int], ...]
    predicted: tuple[Prediction, ...] = ()


EMPTY_PLAN = Plan((), (), ())


class AdmissionPolicy:
    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def screen(self, ask: Ask, budget: BudgetSnapshot, now: float) -> Decision | None:
        """Refuse an arrival before it joins the queue, or None to let it join."""
        retry = self.config.retry
        # The pool size outlives a stale reading: a request larger than the whole pool is
        # refused for what it is, not answered with "try later".
        if budget.total_blocks > 0 and ask.max_blocks > budget.pool_limit_blocks:
            return Decision(DecisionKind.REJECT, Reason.EXCEEDS_POOL)
        if budget.state is BudgetState.DOWN:
            return Decision(DecisionKind.SHED, Reason.BACKEND_DOWN, retry.default_s)
        # A suspect budget is settled by the next scrape, a moment away: wait for it in the queue.
        if not budget.known and budget.state is not BudgetState.SUSPECT:
            return Decision(DecisionKind.SHED, Reason.BUDGET_UNKNOWN, retry.default_s)
        if now >= ask.deadline_at:
            return Decision(DecisionKind.SHED, Reason.DEADLINE_UNREACHABLE, retry.default_s)
        return None

    def overflow(
        self,
        priority: Priority,
        waiting: int,
        queued_blocks: int,
        budget: BudgetSnapshot,
        drain_rate: float | None,
    ) -> Decision | None:
        """After a plan, an arrival that must wait is shed when its priority's queue already
        holds `max_queued` others (`waiting` counts them, not the arrival). A request that can
        be admitted at once is never refused for a full queue: it would not occupy it."""
        if waiting < self.config.max_queued.get(priority, 0):
            return None
        retry_s = self.config.retry.after(queued_blocks - budget.free_blocks, drain_rate)
        return Decision(DecisionKind.SHED, Reason.QUEUE_FULL, retry_s)

    def plan(
        self,
        waiters: Sequence[Waiter],
        budget: BudgetSnapshot,
        drain_rate: float | None,
        now: float,
        scale: WaitScale | None = None,
    ) -> Plan:
        """Decide for every waiter. `waiters` must be in queue order (priority, arrival).
        `scale`, when given, corrects the predicted wait of each arrival for its size."""
        if not waiters:
            return EMPTY_PLAN
        retry = self.config.retry
        admit: list[int] = []
        shed: list[tuple[int, Decision]] = []
        if not budget.known:
            for waiter in waiters:
                if budget.state is BudgetState.DOWN:
                    shed.append(
                        (waiter.key, Decision(DecisionKind.SHED, Reason.BACKEND_DOWN, retry.default_s))
                    )
                elif now >= waiter.ask.deadline_at:
                    shed.append(
                        (waiter.key, Decision(DecisionKind.SHED, Reason.DEADLINE_EXPIRED, retry.default_s))
                    )
            return Plan((), tuple(shed), ())

        free = budget.free_blocks
        ahead = 0  # blocks of the waiters ahead that stay queued
        # How many more admissions may still overtake the waiters that stay: the smallest
        # allowance left among them. At zero the queue is blocked behind them.
        allowance = math.inf
        staying: list[tuple[int, int]] = []  # (key, admissions so far when it stayed)
        predicted: list[Prediction] = []
        for waiter in waiters:
            ask = waiter.ask
            if now >= ask.deadline_at:
                wait_s = retry.after(ahead + ask.reserve_blocks - free, drain_rate)
                shed.append((waiter.key, Decision(DecisionKind.SHED, Reason.DEADLINE_EXPIRED, wait_s)))
                continue
            if ask.reserve_blocks <= free and allowance > 0:
                admit.append(waiter.key)
                free -= ask.reserve_blocks
                allowance -= 1
                continue
            shortfall = ahead + ask.reserve_blocks - free
            # Seconds until it fits if blocks were held for it from now; None: no rate known.
            held_wait_s = (
                max(0, shortfall) / drain_rate if drain_rate is not None and drain_rate > 0 else None
            )
            # An arrival's wait, corrected for its size; waiters already queued are judged by
            # the in-order wait alone (the correction was learned on arrivals' whole waits).
            predicted_s = held_wait_s
            if held_wait_s is not None and scale is not None and waiter.arriving:
                predicted_s = held_wait_s * scale.factor(ask.reserve_blocks, budget.pool_limit_blocks)
            if self.config.early_shed and predicted_s is not None:
                ready_at = now + predicted_s
                reason = None
                latest = ask.deadline_at
                if waiter.arriving:
                    latest = now + (ask.deadline_at - now) * (1.0 - self.config.arrival_slack)
                if ready_at > latest:
                    reason = Reason.DEADLINE_UNREACHABLE
                elif waiter.strict and ready_at > ask.objective_at:
                    reason = Reason.OBJECTIVE_UNREACHABLE
                if reason is not None:
                    shed.append(
                        (waiter.key, Decision(DecisionKind.SHED, reason, retry.after(shortfall, drain_rate)))
                    )
                    continue
            ahead += ask.reserve_blocks
            staying.append((waiter.key, len(admit)))
            if waiter.arriving and predicted_s is not None and held_wait_s is not None:
                predicted.append(Prediction(waiter.key, predicted_s, held_wait_s))
            allowance = min(allowance, max(0, self.config.max_bypass - waiter.bypassed))
            if held_wait_s is not None and held_wait_s >= self.config.hol_deadline_share * (
                ask.deadline_at - now
            ):
                allowance = 0  # its deadline needs the blocks: hold them for it from now on
        bypassed = tuple((key, len(admit) - before) for key, before in staying if len(admit) > before)
        return Plan(tuple(admit), tuple(shed), bypassed, tuple(predicted))

    def retry_after(self, blocks_to_free: float, drain_rate: float | None) -> float:
        return self.config.retry.after(blocks_to_free, drain_rate)


def queue_order_key(priority: Priority, sequence: int) -> tuple[int, int]:
    return (priority.rank, sequence)


NO_DEADLINE = math.inf
