"""The async wait queue around the admission policy: order, deadlines, cancellation.

Requests that do not fit wait here, in the gateway, not inside vLLM. `enter` runs the policy's
arrival screen and then `pump`, so a request that fits is admitted without ever awaiting.
`pump` asks the policy for a `Plan` over everyone waiting and carries it out synchronously:
admitted entries have their `on_admit` callback run (it books the ledger) before anything else
can look at the budget, so two admissions can never spend the same free blocks. `pump` runs on
every event that can change the answer: an arrival, a completed reservation, a new scrape, and
a timer armed for the earliest queue deadline, so nobody stays queued past it.

With a `WaitCalibration`, every admission from the queue and every deadline expiry teaches it
how far the wait strayed from the in-order prediction, and the next arrivals' predictions are
corrected for their size (see `gateway.rates.WaitCalibration`).

Futures resolve to a `Decision` (admit or shed), never to an exception, so a waiter that went
away before reading its answer leaves nothing unretrieved behind. A waiter that is cancelled
(its client left) is removed at once (`leave`).

With a `Booker` (several kvgate processes sharing one budget in Redis), a plan's admissions
are proposals: they are booked on the shared ledger in one round trip per pump, each on the
first of its candidate backends that the shared total still allows, and only then admitted
(`on_admit`). Until the answer they count against the targets they were placed on, so later
plans do not spend the same blocks; one that Redis refused returns to its place in the queue.
While the booker is not `active` (no shared ledger, or Redis unreachable and the budget failing
open), admissions are booked locally at once, as alone.

`AdmissionQueue` is the interface the service uses; the contract: one event loop, `enter` and
`leave` and `pump` never await, each entry resolves at most once.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gateway.admission import (
    ADMIT,
    ONLY,
    AdmissionPolicy,
    Ask,
    BlocksOn,
    Decision,
    DecisionKind,
    Priority,
    Reason,
    Target,
    Waiter,
    max_on,
    reserve_on,
)
from gateway.capacity import BudgetSource
from gateway.rates import WaitCalibration


@dataclass(slots=True)
class QueueEntry:
    waiter: Waiter
    # Books the admission on the target named (the ledger of that backend), synchronously.
    on_admit: Callable[[float, str], None]
    future: asyncio.Future[Decision]
    entered_at: float
    resolved_at: float | None = None
    # Seconds the policy predicted it would wait, in its first plan (None: admitted or shed
    # then, or no drain rate known), and the same before the correction for its size.
    predicted_wait_s: float | None = None
    in_order_wait_s: float | None = None

    @property
    def key(self) -> int:
        return self.waiter.key

    @property
    def done(self) -> bool:
        return self.future.done()


@dataclass(frozen=True, slots=True)
class Booking:
    """One admission to book on the shared ledger: its candidates in order of preference, with
    the blocks it reserves on each."""

    key: int
    candidates: tuple[tuple[str, int], ...]


# What a booker answers for a batch: per booking, the target it was booked on or None
# (refused); None for the whole batch when the store could not be asked.
BookingAnswer = Sequence[str | None] | None


class Booker(Protocol):
    """Books admissions on a ledger shared with other processes (`gateway.redis_store`)."""

    @property
    def active(self) -> bool:
        """Whether admissions must be booked through it now (else: locally, at once)."""
        ...

    def book(self, bookings: Sequence[Booking], answer: Callable[[BookingAnswer], None]) -> None:
        """Send `bookings`; `answer` is called once, later, on the event loop. Never raises."""
        ...

    def release(self, target: str, key: int) -> None:
        """Give back a booking that will not be admitted (its client left meanwhile)."""
        ...


# After a refusal from the shared ledger, the queue plans again this much later, not at once:
# the answer updated what the targets show, but a refusal must never turn into a busy loop.
REFUSED_REPLAN_S = 0.005


class AdmissionQueue(Protocol):
    def enter(
        self,
        key: int,
        ask: Ask,
        on_admit: Callable[[float, str], None],
        blocks_on: BlocksOn | None = None,
        prefix_on: Mapping[str, int] | None = None,
    ) -> QueueEntry:
        """Screen and queue a request; the entry may already be resolved on return."""
        ...

    def leave(self, entry: QueueEntry) -> bool:
        """Withdraw an unresolved entry (client gone); False if it was already resolved."""
        ...

    def pump(self) -> None: ...

    def depth(self) -> dict[Priority, int]: ...

    def close(self, decision: Decision) -> int:
        """Resolve everyone still waiting with `decision` (shutdown); returns how many."""
        ...


@dataclass(slots=True)
class _Stats:
    pumps: int = 0
    admitted: int = 0
    shed: int = 0
    left: int = 0


class WaitQueue:
    def __init__(
        self,
        *,
        policy: AdmissionPolicy,
        clock: Callable[[], float],
        targets: Callable[[float], Sequence[Target]] | None = None,
        budget: BudgetSource | None = None,
        drain_rate: Callable[[float], float | None] | None = None,
        on_resolved: Callable[[QueueEntry, Decision], None] | None = None,
        calibration: WaitCalibration | None = None,
        booker: Booker | None = None,
    ) -> None:
        """Admit onto `targets` (a model's backends, as they stand at `now`), or onto the one
        `budget` draining at `drain_rate`."""
        self._policy = policy
        # Learns from every admission and deadline how far waits stray from the in-order
        # prediction, and corrects the next arrivals' predictions (None: no correction).
        self.calibration = calibration
        if targets is None:
            if budget is None:
                raise ValueError("a wait queue needs targets or a budget")
            only, rate = budget, drain_rate or (lambda now: None)
            targets = lambda now: (Target(ONLY, only.snapshot(now), rate(now)),)  # noqa: E731
        self._targets = targets
        self._clock = clock
        self._on_resolved = on_resolved
        # Per priority, in arrival order; dicts keep insertion order and remove in O(1).
        self._queues: dict[Priority, dict[int, QueueEntry]] = {p: {} for p in _ORDER}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._pumping = False
        self._again = False
        # Entries not yet seen by a plan (arrivals): their next plan is the one that weighs
        # the arrival slack.
        self._fresh: set[int] = set()
        self._booker = booker
        # Admissions proposed to the booker and not answered yet: (entry, target), and the
        # blocks and connections they take on each target meanwhile.
        self._booking: dict[int, tuple[QueueEntry, str]] = {}
        self._pending_blocks: dict[str, int] = {}
        self._pending_connections: dict[str, int] = {}
        # Entries whose client left while their booking was under way.
        self._abandoned: set[int] = set()
        self._replan: asyncio.TimerHandle | None = None
        self.stats = _Stats()

    # -- queries --------------------------------------------------------------------------

    def depth(self) -> dict[Priority, int]:
        return {p: len(q) for p, q in self._queues.items()}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting(self) -> Iterator[QueueEntry]:
        """Entries in queue order."""
        for priority in _ORDER:
            yield from self._queues[priority].values()

    def queued_blocks(self) -> int:
        return sum(entry.waiter.ask.reserve_blocks for entry in self.waiting())

    # -- changes --------------------------------------------------------------------------

    def enter(
        self,
        key: int,
        ask: Ask,
        on_admit: Callable[[float, str], None],
        blocks_on: BlocksOn | None = None,
        prefix_on: Mapping[str, int] | None = None,
    ) -> QueueEntry:
        now = self._clock()
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        entry = QueueEntry(Waiter(key, ask, blocks_on=blocks_on, prefix_on=prefix_on), on_admit, future, now)
        refusal = self._policy.screen_fleet(ask, self._targets(now), now, blocks_on)
        if refusal is not None:
            self._resolve(entry, refusal, now)
            return entry
        queue = self._queues[ask.priority]
        queue[key] = entry
        entry.waiter = replace(entry.waiter, arriving=True)
        self._fresh.add(key)
        self.pump()
        # Still queued (not admitted, nor proposed to the booker: that one fits, and a request
        # that can be admitted at once is never refused for a full queue).
        if not entry.done and key in queue:
            overflow = self._policy.overflow_fleet(
                ask.priority, len(queue) - 1, self.queued_blocks(), self._targets(now)
            )
            if overflow is not None:
                del queue[key]
                # It never waited: nothing to check the prediction by.
                entry.predicted_wait_s = entry.in_order_wait_s = None
                self._resolve(entry, overflow, now)
        return entry

    def leave(self, entry: QueueEntry) -> bool:
        if entry.done:
            return False
        if entry.key in self._booking:
            self._abandoned.add(entry.key)
        self._queues[entry.waiter.ask.priority].pop(entry.key, None)
        entry.future.cancel()
        entry.resolved_at = self._clock()
        self.stats.left += 1
        # Whoever was blocked behind it may fit now (bypass bounds, shortfalls).
        self.pump()
        return True

    def pump(self) -> None:
        if self._pumping:  # a callback re-entered: run once more after this pass
            self._again = True
            return
        self._pumping = True
        try:
            while True:
                self._again = False
                self._pump_once()
                if not self._again:
                    break
        finally:
            self._pumping = False

    def _pump_once(self) -> None:
        self.stats.pumps += 1
        if not len(self):
            self._fresh.clear()
            self._arm_timer(math.inf)
            return
        now = self._clock()
        targets = self._with_pending(self._targets(now))
        plan = self._policy.plan_fleet(
            [entry.waiter for entry in self.waiting()], targets, now, self.calibration
        )
        pool_blocks = sum(t.budget.pool_limit_blocks for t in targets)
        booker = self._booker if self._booker is not None and self._booker.active else None
        bookings: list[Booking] = []
        for key, onto in zip(plan.admit, plan.onto, strict=True):
            entry = self._pop(key)
            if booker is not None:
                bookings.append(self._propose(entry, onto, targets))
                continue
            entry.on_admit(now, onto)
            self._learn(entry, pool_blocks, now)
            self._resolve(entry, ADMIT, now)
        if booker is not None and bookings:
            booker.book(bookings, lambda answer: self._booked(bookings, answer, pool_blocks))
        for key, decision in plan.shed:
            entry = self._pop(key)
            if decision.reason is Reason.DEADLINE_EXPIRED:
                self._learn(entry, pool_blocks, now)
            self._resolve(entry, decision, now)
        for key, count in plan.bypassed:
            entry = self._find(key)
            entry.waiter = replace(entry.waiter, bypassed=entry.waiter.bypassed + count)
        for prediction in plan.predicted:
            predicted = self._find(prediction.key)
            predicted.predicted_wait_s = prediction.wait_s
            predicted.in_order_wait_s = prediction.in_order_s
        for key in self._fresh:
            if (seen := self._find_waiting(key)) is not None:
                seen.waiter = replace(seen.waiter, arriving=False)
        self._fresh.clear()
        self._arm_timer(min((e.waiter.ask.deadline_at for e in self.waiting()), default=math.inf))

    def close(self, decision: Decision) -> int:
        now = self._clock()
        entries = list(self.waiting())
        for entry in entries:
            self._resolve(self._pop(entry.key), decision, now)
        # Bookings under way are answered with the same; a booking that lands is given back.
        booking = [entry for entry, _ in self._booking.values() if not entry.done]
        for entry in booking:
            self._abandoned.add(entry.key)
            self._resolve(entry, decision, now)
        self._fresh.clear()
        self._arm_timer(math.inf)
        return len(entries) + len(booking)

    # -- booking on a shared ledger ---------------------------------------------------------

    def _with_pending(self, targets: Sequence[Target]) -> Sequence[Target]:
        """The targets less what the bookings under way take of them."""
        if not self._booking:
            return targets
        adjusted: list[Target] = []
        for target in targets:
            blocks = self._pending_blocks.get(target.name, 0)
            connections = self._pending_connections.get(target.name, 0)
            if blocks or connections:
                budget = replace(target.budget, committed_blocks=target.budget.committed_blocks + blocks)
                free = None if target.free_connections is None else target.free_connections - connections
                target = replace(target, budget=budget, free_connections=free)
            adjusted.append(target)
        return adjusted

    def _propose(self, entry: QueueEntry, onto: str, targets: Sequence[Target]) -> Booking:
        waiter = entry.waiter
        chosen = reserve_on(waiter.ask, waiter.blocks_on, onto)
        self._booking[entry.key] = (entry, onto)
        self._pending_blocks[onto] = self._pending_blocks.get(onto, 0) + chosen
        self._pending_connections[onto] = self._pending_connections.get(onto, 0) + 1
        # Should the chosen one be full by the shared count, any other known target may take it.
        others = [
            (target.name, reserve_on(waiter.ask, waiter.blocks_on, target.name))
            for target in sorted(targets, key=lambda t: -t.budget.free_blocks)
            if target.name != onto
            and target.budget.known
            and max_on(waiter.ask, waiter.blocks_on, target.name) <= target.budget.pool_limit_blocks
            and (target.free_connections is None or target.free_connections > 0)
        ]
        return Booking(entry.key, ((onto, chosen), *others))

    def _booked(self, bookings: Sequence[Booking], answer: BookingAnswer, pool_blocks: int) -> None:
        now = self._clock()
        places: Sequence[str | None] = answer if answer is not None else [None] * len(bookings)
        refused = False
        for booking, place in zip(bookings, places, strict=True):
            entry, onto = self._booking.pop(booking.key)
            chosen = booking.candidates[0][1]
            self._pending_blocks[onto] -= chosen
            self._pending_connections[onto] -= 1
            if booking.key in self._abandoned:
                self._abandoned.discard(booking.key)
                if place is not None and self._booker is not None:
                    self._booker.release(place, booking.key)
                continue
            if place is not None:
                entry.on_admit(now, place)
                self._learn(entry, pool_blocks, now)
                self._resolve(entry, ADMIT, now)
                continue
            refused = True
            self._requeue(entry)
        if refused:
            # Not at once: see REFUSED_REPLAN_S.
            if self._replan is None:
                self._replan = asyncio.get_running_loop().call_later(REFUSED_REPLAN_S, self._on_replan)
        elif len(self):
            self.pump()

    def _requeue(self, entry: QueueEntry) -> None:
        """Put a refused booking back at its place: queues are in arrival (key) order."""
        queue = self._queues[entry.waiter.ask.priority]
        queue[entry.key] = entry
        if next(reversed(queue)) != entry.key or len(queue) == 1:
            return
        ordered = sorted(queue.items())
        queue.clear()
        queue.update(ordered)

    def _on_replan(self) -> None:
        self._replan = None
        self.pump()

    # -- internals ------------------------------------------------------------------------

    def _find(self, key: int) -> QueueEntry:
        entry = self._find_waiting(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def _find_waiting(self, key: int) -> QueueEntry | None:
        for queue in self._queues.values():
            entry = queue.get(key)
            if entry is not None:
                return entry
        return None

    def _pop(self, key: int) -> QueueEntry:
        for queue in self._queues.values():
            entry = queue.pop(key, None)
            if entry is not None:
                return entry
        raise KeyError(key)

    def _learn(self, entry: QueueEntry, pool_blocks: int, now: float) -> None:
        """Teach the calibration how long a waiter with a prediction really waited: called for
        admissions and deadline expiries only (both come from a plan)."""
        if self.calibration is not None and entry.in_order_wait_s is not None:
            self.calibration.observe(
                entry.waiter.ask.reserve_blocks, pool_blocks, entry.in_order_wait_s, now - entry.entered_at
            )

    def _resolve(self, entry: QueueEntry, decision: Decision, now: float) -> None:
        entry.resolved_at = now
        if decision.kind is DecisionKind.ADMIT:
            self.stats.admitted += 1
        else:
            self.stats.shed += 1
        if not entry.future.done():
            entry.future.set_result(decision)
        if self._on_resolved is not None:
            self._on_resolved(entry, decision)

    def _arm_timer(self, deadline_at: float) -> None:
        if deadline_at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline_at
        if math.isfinite(deadline_at):
            delay = max(0.0, deadline_at - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self.pump()


_ORDER: tuple[Priority, ...] = tuple(sorted(Priority, key=lambda p: p.rank))
