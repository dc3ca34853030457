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
than left to time out, as long as it is young enough (`REFUSE_WITHIN_S`) for a refusal to
be of use; with no rate observed yet nobody is shed early. That prediction holds
for a queue served in order; bypassing makes small requests wait less and large ones more, and
an optional `WaitScale` corrects an arrival's prediction for its size.

One deadline per request, `deadline_at`: the last moment it may leave the queue and still give
the client what its headers ask for (its whole answer by `X-Kvgate-Deadline-Ms`, or its first
token by `X-Kvgate-TTFT-Ms` alone; see `gateway.client_hints`). It is shed then, or as soon
as missing it is predicted within its refusal horizon. docs/admission.md states the whole
model with its formulas.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gateway.capacity import BudgetSnapshot, BudgetState
from gateway.routing import Candidate, choose


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
    last moment it may still leave the queue usefully (math.inf: none).
    """

    reserve_blocks: int
    max_blocks: int
    priority: Priority
    arrived_at: float
    deadline_at: float


# Target name -> (reserve_blocks, max_blocks) of one request there.
BlocksOn = Mapping[str, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Waiter:
    """A queued request as the policy sees it. `bypassed`: admissions that overtook it;
    `arriving`: this is its first plan."""

    key: int
    ask: Ask
    bypassed: int = 0
    arriving: bool = False
    # Over a fleet: (reserve, max) blocks on each target whose block size makes them differ
    # from the ask's, and the leading prompt blocks each target likely holds cached.
    blocks_on: BlocksOn | None = None
    prefix_on: Mapping[str, int] | None = None


# Retry-After when no drain rate is known, and its bounds otherwise: the OpenAI SDKs ignore
# hints above 60 s (and fall back on their own backoff), and below a quarter second a retry
# mostly finds the same queue.
RETRY_AFTER_DEFAULT_S = 1.0
RETRY_AFTER_MIN_S = 0.25
RETRY_AFTER_MAX_S = 60.0
# Overtakes after which a waiter blocks the queue even when no drain rate says its deadline
# needs the blocks (see the module docstring).
MAX_BYPASS = 128
# How long after its arrival a waiter may still be shed because a new prediction says it will
# miss its deadline. A refusal is worth something to a client only while it can still go
# elsewhere: at least 98% of refusals must come within 1 s of arrival, and the plans that
# re-predict run on events, so the horizon stops short of that second. Past it the waiter
# keeps its place until it is admitted or its deadline passes.
REFUSE_WITHIN_S = 0.9


def retry_after(blocks_to_free: float, drain_rate: float | None) -> float:
    """Retry-After: the predicted time for `blocks_to_free` to drain, within bounds."""
    if drain_rate is None or drain_rate <= 0:
        return RETRY_AFTER_DEFAULT_S
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, blocks_to_free / drain_rate))


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    max_queued: Mapping[Priority, int]
    # A waiter blocks the queue once its wait, were blocks held for it, reaches this share of
    # the time left to its deadline (see the module docstring). 0: no bypass once a drain rate
    # is known.
    hol_deadline_share: float = 0.5
    max_bypass: int = MAX_BYPASS
    # An arrival must be predicted ready this share of its time to the deadline early: a
    # prediction has errors, and a request let in on a close call that then misses waits for
    # nothing (past the refusal horizon, until its deadline).
    arrival_slack: float = 0.0
    # Past this age a waiter is no longer shed on a re-prediction (see REFUSE_WITHIN_S).
    refuse_within_s: float = REFUSE_WITHIN_S


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
    # The target each admitted waiter goes to, in the order of `admit`.
    onto: tuple[str, ...] = ()


EMPTY_PLAN = Plan((), (), ())


@dataclass(frozen=True, slots=True)
class Target:
    """One backend a queue can admit onto, as the policy sees it at one moment: its budget
    and the rate its blocks free up (None: not measured yet)."""

    name: str
    budget: BudgetSnapshot
    drain_rate: float | None = None
    # Connections it may still be given (None: not counted): a request waits for one as it
    # waits for blocks, rather than failing for lack of one once admitted.
    free_connections: int | None = None
    # When it was last given a request (monotonic seconds): equal targets take turns.
    chosen_at: float = 0.0


# The name of the only target of a single-budget call (`screen`, `overflow`, `plan`).
ONLY = ""


class AdmissionPolicy:
    """The decisions over a fleet of targets (one model's backends) and, as the special case
    of one target, over one backend. Over several, the queue is one: a waiter is admitted on
    whichever target can take it first (`gateway.routing.choose` picks among those that can),
    and its predicted wait is the blocks ahead of it over the fleet's combined drain rate."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    # -- one backend ------------------------------------------------------------------------

    def screen(self, ask: Ask, budget: BudgetSnapshot, now: float) -> Decision | None:
        """Refuse an arrival before it joins the queue, or None to let it join."""
        return self.screen_fleet(ask, (Target(ONLY, budget),), now)

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
        return self.overflow_fleet(priority, waiting, queued_blocks, (Target(ONLY, budget, drain_rate),))

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
        return self.plan_fleet(waiters, (Target(ONLY, budget, drain_rate),), now, scale)

    # -- a fleet ----------------------------------------------------------------------------

    def screen_fleet(
        self, ask: Ask, targets: Sequence[Target], now: float, blocks_on: BlocksOn | None = None
    ) -> Decision | None:
        """`screen` over the targets: refused for its size only when it exceeds every sized
        pool; shed for the budget only when no target is known (nor about to be)."""
        # The pool size outlives a stale reading: a request larger than the whole pool is
        # refused for what it is, not answered with "try later".
        sized = [t for t in targets if t.budget.total_blocks > 0]
        if sized and all(max_on(ask, blocks_on, t.name) > t.budget.pool_limit_blocks for t in sized):
            return Decision(DecisionKind.REJECT, Reason.EXCEEDS_POOL)
        if all(t.budget.state is BudgetState.DOWN for t in targets):
            return Decision(DecisionKind.SHED, Reason.BACKEND_DOWN, RETRY_AFTER_DEFAULT_S)
        # A budget the next scrape settles (a request just failed to reach the backend, or a
        # scrape is late but has not failed) is worth waiting for in the queue.
        if not any(t.budget.known or t.budget.settles_soon for t in targets):
            return Decision(DecisionKind.SHED, Reason.BUDGET_UNKNOWN, RETRY_AFTER_DEFAULT_S)
        if now >= ask.deadline_at:
            return Decision(DecisionKind.SHED, Reason.DEADLINE_UNREACHABLE, RETRY_AFTER_DEFAULT_S)
        return None

    def overflow_fleet(
        self, priority: Priority, waiting: int, queued_blocks: int, targets: Sequence[Target]
    ) -> Decision | None:
        """`overflow` over the targets' combined free blocks and drain rate. The bound is
        `max_queued` per target that is not down: the queue of a model drains into all of its
        backends, so a fleet of four queues four backends' worth, as four gateways in front of
        one backend each would."""
        serving = max(1, sum(1 for t in targets if t.budget.state is not BudgetState.DOWN))
        if waiting < self.config.max_queued.get(priority, 0) * serving:
            return None
        free = sum(t.budget.free_blocks for t in targets)
        retry_s = retry_after(queued_blocks - free, _combined_rate(targets))
        return Decision(DecisionKind.SHED, Reason.QUEUE_FULL, retry_s)

    def plan_fleet(
        self,
        waiters: Sequence[Waiter],
        targets: Sequence[Target],
        now: float,
        scale: WaitScale | None = None,
    ) -> Plan:
        """`plan` over the targets: `Plan.onto` says where each admitted waiter goes."""
        if not waiters:
            return EMPTY_PLAN
        admit: list[int] = []
        onto: list[str] = []
        shed: list[tuple[int, Decision]] = []
        known = [t for t in targets if t.budget.known]
        if not known:
            down = all(t.budget.state is BudgetState.DOWN for t in targets)
            for waiter in waiters:
                if down:
                    shed.append(
                        (waiter.key, Decision(DecisionKind.SHED, Reason.BACKEND_DOWN, RETRY_AFTER_DEFAULT_S))
                    )
                elif now >= waiter.ask.deadline_at:
                    shed.append(
                        (
                            waiter.key,
                            Decision(DecisionKind.SHED, Reason.DEADLINE_EXPIRED, RETRY_AFTER_DEFAULT_S),
                        )
                    )
            return Plan((), tuple(shed), ())

        free = {t.name: t.budget.free_blocks for t in known}
        committed = {t.name: t.budget.committed_blocks for t in known}
        connections = {t.name: t.free_connections for t in known}
        chosen_at = {t.name: t.chosen_at for t in known}
        free_total = sum(free.values())
        drain_rate = _combined_rate(known)
        pool_blocks = sum(t.budget.pool_limit_blocks for t in known)
        ahead = 0  # blocks of the waiters ahead that stay queued
        # How many more admissions may still overtake the waiters that stay: the smallest
        # allowance left among them. At zero the queue is blocked behind them.
        allowance = math.inf
        staying: list[tuple[int, int]] = []  # (key, admissions so far when it stayed)
        predicted: list[Prediction] = []
        for waiter in waiters:
            ask = waiter.ask
            if now >= ask.deadline_at:
                wait_s = retry_after(ahead + ask.reserve_blocks - free_total, drain_rate)
                shed.append((waiter.key, Decision(DecisionKind.SHED, Reason.DEADLINE_EXPIRED, wait_s)))
                continue
            if allowance > 0:
                chosen = _place(waiter, known, free, committed, connections, chosen_at)
                if chosen is not None:
                    chosen_at[chosen] = now
                    blocks = reserve_on(ask, waiter.blocks_on, chosen)
                    admit.append(waiter.key)
                    onto.append(chosen)
                    if (left := connections[chosen]) is not None:
                        connections[chosen] = left - 1
                    free[chosen] -= blocks
                    committed[chosen] += blocks
                    free_total -= blocks
                    allowance -= 1
                    continue
            shortfall = ahead + ask.reserve_blocks - free_total
            # Seconds until it fits if blocks were held for it from now; None: no rate known.
            held_wait_s = (
                max(0, shortfall) / drain_rate if drain_rate is not None and drain_rate > 0 else None
            )
            # An arrival's wait, corrected for its size; waiters already queued are judged by
            # the in-order wait alone (the correction was learned on arrivals' whole waits).
            predicted_s = held_wait_s
            if held_wait_s is not None and scale is not None and waiter.arriving:
                predicted_s = held_wait_s * scale.factor(ask.reserve_blocks, pool_blocks)
            # A waiter past the refusal horizon was promised its place: it holds it.
            refusable = now - ask.arrived_at < self.config.refuse_within_s
            if predicted_s is not None and refusable:
                latest = ask.deadline_at
                if waiter.arriving:
                    latest = now + (ask.deadline_at - now) * (1.0 - self.config.arrival_slack)
                if now + predicted_s > latest:
                    decision = Decision(
                        DecisionKind.SHED, Reason.DEADLINE_UNREACHABLE, retry_after(shortfall, drain_rate)
                    )
                    shed.append((waiter.key, decision))
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
        return Plan(tuple(admit), tuple(shed), bypassed, tuple(predicted), tuple(onto))


def _combined_rate(targets: Sequence[Target]) -> float | None:
    """The fleet's drain rate: the sum of the rates measured (None when none is)."""
    rates = [t.drain_rate for t in targets if t.drain_rate is not None and t.drain_rate > 0]
    return sum(rates) if rates else None


def reserve_on(ask: Ask, blocks_on: BlocksOn | None, name: str) -> int:
    """The blocks the request reserves on the target `name` (its own size there, if any)."""
    if blocks_on is not None and name in blocks_on:
        return blocks_on[name][0]
    return ask.reserve_blocks


def max_on(ask: Ask, blocks_on: BlocksOn | None, name: str) -> int:
    """The most blocks the request may come to hold on the target `name`."""
    if blocks_on is not None and name in blocks_on:
        return blocks_on[name][1]
    return ask.max_blocks


def _place(
    waiter: Waiter,
    known: Sequence[Target],
    free: Mapping[str, int],
    committed: Mapping[str, int],
    connections: Mapping[str, int | None],
    chosen_at: Mapping[str, float],
) -> str | None:
    """Where the waiter goes now, or None when no target can take it (see gateway.routing)."""
    ask, blocks_on, prefix_on = waiter.ask, waiter.blocks_on, waiter.prefix_on
    candidates = []
    reserve: dict[str, int] = {}
    for target in known:
        if max_on(ask, blocks_on, target.name) > target.budget.pool_limit_blocks:
            continue  # a pool too small for it, beside others that are large enough
        if (left := connections[target.name]) is not None and left <= 0:
            continue  # every connection to it is taken
        reserve[target.name] = reserve_on(ask, blocks_on, target.name)
        candidates.append(
            Candidate(
                name=target.name,
                free_blocks=free[target.name],
                admissible_blocks=target.budget.admissible_blocks,
                pool_blocks=target.budget.pool_limit_blocks,
                committed_blocks=committed[target.name],
                prefix_blocks=prefix_on.get(target.name, 0) if prefix_on is not None else 0,
                chosen_at=chosen_at[target.name],
            )
        )
    return choose(candidates, reserve)


def queue_order_key(priority: Priority, sequence: int) -> tuple[int, int]:
    return (priority.rank, sequence)


NO_DEADLINE = math.inf
