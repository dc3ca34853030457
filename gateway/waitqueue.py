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

`AdmissionQueue` is the interface the service uses; the contract: one event loop, `enter` and
`leave` and `pump` never await, each entry resolves at most once.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from gateway.admission import (
    ADMIT,
    AdmissionPolicy,
    Ask,
    Decision,
    DecisionKind,
    Priority,
    Reason,
    Waiter,
)
from gateway.capacity import BudgetSource
from gateway.rates import WaitCalibration


@dataclass(slots=True)
class QueueEntry:
    waiter: Waiter
    on_admit: Callable[[float], None]
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


class AdmissionQueue(Protocol):
    def enter(
        self, key: int, ask: Ask, on_admit: Callable[[float], None], *, strict: bool = False
    ) -> QueueEntry:
        """Screen and queue a request; the entry may already be resolved on return. A `strict`
        one is shed at once if it cannot meet its objective (see `gateway.admission`)."""
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
        budget: BudgetSource,
        drain_rate: Callable[[float], float | None],
        clock: Callable[[], float],
        on_resolved: Callable[[QueueEntry, Decision], None] | None = None,
        strict_lookback_s: float = 0.0,
        calibration: WaitCalibration | None = None,
    ) -> None:
        self._policy = policy
        # Learns from every admission and deadline how far waits stray from the in-order
        # prediction, and corrects the next arrivals' predictions (None: no correction).
        self.calibration = calibration
        self._budget = budget
        self._drain_rate = drain_rate
        self._clock = clock
        self._on_resolved = on_resolved
        # Per priority, in arrival order; dicts keep insertion order and remove in O(1).
        self._queues: dict[Priority, dict[int, QueueEntry]] = {p: {} for p in _ORDER}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._pumping = False
        self._again = False
        # Entries not yet seen by a plan (arrivals, and waiters made strict by one): their
        # next plan is the one that weighs slack and objectives.
        self._fresh: set[int] = set()
        self.strict_lookback_s = strict_lookback_s
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
        self, key: int, ask: Ask, on_admit: Callable[[float], None], *, strict: bool = False
    ) -> QueueEntry:
        now = self._clock()
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        entry = QueueEntry(Waiter(key, ask), on_admit, future, now)
        refusal = self._policy.screen(ask, self._budget.snapshot(now), now)
        if refusal is not None:
            self._resolve(entry, refusal, now)
            return entry
        queue = self._queues[ask.priority]
        queue[key] = entry
        entry.waiter = replace(entry.waiter, arriving=True)
        self._fresh.add(key)
        if strict:
            self._make_strict(entry, now)
        self.pump()
        if not entry.done:
            overflow = self._policy.overflow(
                ask.priority,
                len(queue) - 1,
                self.queued_blocks(),
                self._budget.snapshot(now),
                self._drain_rate(now),
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
        budget = self._budget.snapshot(now)
        plan = self._policy.plan(
            [entry.waiter for entry in self.waiting()],
            budget,
            self._drain_rate(now),
            now,
            self.calibration,
        )
        for key in plan.admit:
            entry = self._pop(key)
            entry.on_admit(now)
            self._learn(entry, budget.pool_limit_blocks, now)
            self._resolve(entry, ADMIT, now)
        for key, decision in plan.shed:
            entry = self._pop(key)
            if decision.reason is Reason.DEADLINE_EXPIRED:
                self._learn(entry, budget.pool_limit_blocks, now)
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
                seen.waiter = replace(seen.waiter, arriving=False, strict=False)
        self._fresh.clear()
        self._arm_timer(min((e.waiter.ask.deadline_at for e in self.waiting()), default=math.inf))

    def close(self, decision: Decision) -> int:
        now = self._clock()
        entries = list(self.waiting())
        for entry in entries:
            self._resolve(self._pop(entry.key), decision, now)
        self._fresh.clear()
        self._arm_timer(math.inf)
        return len(entries)

    # -- internals ------------------------------------------------------------------------

    def _make_strict(self, arrival: QueueEntry, now: float) -> None:
        """Judge the arrival by its objective, and with it whoever joined in the last
        `strict_lookback_s`: when the backend turns out to be beyond capacity, the requests
        queued just before were let in on the belief that it was not, and would hold the
        queue long for everyone after them. Shed now, their 429 still comes within the
        lookback of their arrival."""
        arrival.waiter = replace(arrival.waiter, strict=True)
        if self.strict_lookback_s <= 0:
            return
        for queue in self._queues.values():
            for entry in reversed(queue.values()):
                if now - entry.entered_at > self.strict_lookback_s:
                    break
                if entry is not arrival:
                    entry.waiter = replace(entry.waiter, strict=True)
                    self._fresh.add(entry.key)

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
