"""Small online estimators with injected time (pure): event rates and moving averages.

The queue predicts waits from the rate at which blocks free up, and deadlines net out the
service time a request still needs after it leaves the queue. Both are measured online from
finished requests; until enough observations are in they answer None ("unknown"), and callers
then take the cautious branch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class DecayingRate:
    """Amount per second over an exponentially decaying window of `horizon_s` seconds.

    `add(amount, now)` records an event; `rate(now)` is sum(amount * exp(-age / horizon)) /
    horizon, which for a steady stream converges to the true rate. The answer is None until
    `min_events` events arrived and the first one is at least `warmup_s` old, so a burst of
    early completions cannot be mistaken for a steady flow.
    """

    def __init__(self, horizon_s: float, *, min_events: int = 5, warmup_s: float = 1.0) -> None:
        if horizon_s <= 0:
            raise ValueError("horizon_s must be positive")
        self._horizon_s = horizon_s
        self._min_events = min_events
        self._warmup_s = warmup_s
        self._weighted = 0.0
        self._at: float | None = None
        self._first_at: float | None = None
        self._events = 0

    @property
    def events(self) -> int:
        return self._events

    def _decayed(self, now: float) -> float:
        if self._at is None:
            return 0.0
        age = max(0.0, now - self._at)
        return self._weighted * math.exp(-age / self._horizon_s)

    def add(self, amount: float, now: float) -> None:
        self._weighted = self._decayed(now) + amount
        self._at = now if self._at is None else max(self._at, now)
        if self._first_at is None:
            self._first_at = now
        self._events += 1

    def rate(self, now: float) -> float | None:
        if self._first_at is None or self._events < self._min_events:
            return None
        if now - self._first_at < self._warmup_s:
            return None
        # A steady stream of rate r observed for `span` seconds weighs r * h * (1 - exp(-span/h)):
        # dividing by that (not by h) keeps the early estimate unbiased instead of low, which
        # would make the queue over-predict waits and shed too early.
        span = max(now - self._first_at, 1e-9)
        scale = self._horizon_s * (1.0 - math.exp(-span / self._horizon_s))
        return self._decayed(now) / scale


class BusyClock:
    """Seconds during which something was in flight, as a clock that stops while idle.

    Rates of completion measured against wall time collapse during idle periods, and the
    first burst after a lull would then be predicted to wait forever. Measured against busy
    time they keep what the backend achieved the last time it had work. Call `advance(now,
    busy)` at every change of the in-flight set, with `busy` saying whether anything was in
    flight since the previous call.
    """

    def __init__(self, now: float) -> None:
        self._busy_s = 0.0
        self._mark = now

    def advance(self, now: float, busy: bool) -> float:
        if busy and now > self._mark:
            self._busy_s += now - self._mark
        self._mark = max(self._mark, now)
        return self._busy_s


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted moving average over observations (not time); None when empty."""

    alpha: float
    value: float | None = None
    count: int = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)
        self.count += 1


class VirtualBacklog:
    """The backlog a plain first-come-first-served queue would hold now, in blocks.

    Every request offered to the backend joins it, the ones the gateway shed included, and it
    drains at the rate the backend frees blocks when saturated: a fluid model of what waiting
    in line without any shedding would cost. It tells a burst from an overload the way the
    clients' own patience does. If even a plain queue would serve an arrival before its
    deadline, the backend keeps up with the offered load at that patience (a burst: serve it,
    late if need be); if not, the load is beyond the backend's capacity, and serving requests
    late only pushes others late too.

    An arrival counts as beyond capacity once the plain queue's wait passes `share` of its
    deadline budget: below 1, the gateway turns strict before the overload is certain, betting
    that a burst which already fills most of the clients' patience will go on.

    The backlog is capped at `cap_factor` times the arrival's own deadline budget, so that it
    forgets an overload about a deadline's worth of draining after the load falls back.
    """

    def __init__(self, cap_factor: float = 1.25, share: float = 1.0) -> None:
        if cap_factor < 1.0:
            raise ValueError("cap_factor must be at least 1")
        if not 0.0 < share <= 1.0:
            raise ValueError("share must be in (0, 1]")
        self._cap_factor = cap_factor
        self.share = share
        self.blocks = 0.0
        self._at: float | None = None

    def _drain(self, now: float, rate: float) -> None:
        if self._at is not None and now > self._at:
            self.blocks = max(0.0, self.blocks - rate * (now - self._at))
        self._at = now if self._at is None else max(self._at, now)

    def wait_s(self, now: float, rate: float) -> float:
        """Seconds a request joining now would wait behind the backlog."""
        self._drain(now, rate)
        return self.blocks / rate

    def offer(self, blocks: float, now: float, rate: float, budget_s: float) -> bool:
        """Add an arrival of `blocks` with `budget_s` seconds to its deadline; True when a plain
        queue would keep it waiting past `share` of that."""
        self._drain(now, rate)
        self.blocks += blocks
        beyond = self.blocks / rate > self.share * budget_s
        self.blocks = min(self.blocks, rate * max(0.0, budget_s) * self._cap_factor + blocks)
        return beyond
