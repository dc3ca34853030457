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

    With `arrival_horizon_s` > 0 it also looks ahead. It measures the rate at which blocks are
    offered over that horizon, and the load factor: offered over drained. While an arrival
    waits its turn, more requests arrive behind it. If the load keeps up, the backlog behind it
    will be its wait times the load factor by the time it is served. The arrival counts as beyond
    capacity when that projected wait passes the deadline budget: serving it late would then push
    later requests past theirs. Under three times the load the backend drains, the gateway turns
    strict once the plain wait reaches a third of the budget. Below one the backlog shrinks, and
    the plain wait decides alone. It is a bet that the load goes on: when a burst ends instead,
    the requests refused would have been served in time (on the testbed's Azure slice, 11-23% of
    the useful tokens at 1x; see docs/measurements.md), so it is off by default.

    The backlog is capped at `cap_factor` times the arrival's own deadline budget, so that it
    forgets an overload about a deadline's worth of draining after the load falls back.
    """

    def __init__(self, cap_factor: float = 1.25, share: float = 1.0, arrival_horizon_s: float = 0.0) -> None:
        if cap_factor < 1.0:
            raise ValueError("cap_factor must be at least 1")
        if not 0.0 < share <= 1.0:
            raise ValueError("share must be in (0, 1]")
        if arrival_horizon_s < 0.0:
            raise ValueError("arrival_horizon_s must not be negative")
        self._cap_factor = cap_factor
        self.share = share
        self.blocks = 0.0
        self._at: float | None = None
        # Blocks offered per second; None: no look ahead.
        self._offered = (
            DecayingRate(arrival_horizon_s, warmup_s=arrival_horizon_s) if arrival_horizon_s > 0 else None
        )

    def _drain(self, now: float, rate: float) -> None:
        if self._at is not None and now > self._at:
            self.blocks = max(0.0, self.blocks - rate * (now - self._at))
        self._at = now if self._at is None else max(self._at, now)

    def wait_s(self, now: float, rate: float) -> float:
        """Seconds a request joining now would wait behind the backlog."""
        self._drain(now, rate)
        return self.blocks / rate

    def load(self, now: float, rate: float) -> float:
        """Blocks offered per block drained, over the arrival horizon; 0 until measured or
        without look ahead."""
        offered = self._offered.rate(now) if self._offered is not None else None
        return offered / rate if offered is not None else 0.0

    def offer(self, blocks: float, now: float, rate: float, budget_s: float) -> bool:
        """Add an arrival of `blocks` with `budget_s` seconds to its deadline; True when a plain
        queue would keep it waiting past `share` of that, its wait projected by the load factor
        when there is one (see the class docstring)."""
        self._drain(now, rate)
        self.blocks += blocks
        if self._offered is not None:
            self._offered.add(blocks, now)
        beyond = self.blocks / rate * max(1.0, self.load(now, rate)) > self.share * budget_s
        self.blocks = min(self.blocks, rate * max(0.0, budget_s) * self._cap_factor + blocks)
        return beyond


class WaitCalibration:
    """How far real queue waits stray from the policy's predictions, by request size (pure).

    The policy predicts an arrival's wait as if the queue were served in order: the blocks of
    everyone ahead over the drain rate. But a request that does not fit lets smaller ones
    overtake it (see `gateway.admission`), so small requests wait less than that and large ones
    more. On the CPU testbed at three times capacity, requests reserving at most 5 blocks of
    the 63 waited a fifth of their predictions (median), those above 20 blocks 1.8 times theirs.
    Large requests let in on such a prediction were refused at their deadlines, late; small
    ones were refused for an objective they would have met.

    Requests are sorted into classes by the share of the pool they reserve (`bounds`, upper
    ends; the last class is open). Per class it keeps exponentially weighted sums, over
    observations, of predicted and real waits, and the factor is their ratio: a ratio of sums
    is not thrown by tiny predictions. A class answers 1 until `min_samples` are in. The real
    waits are those of requests admitted from the queue, and of requests still queued at their
    deadlines (a lower bound of what they would have waited): leaving these out would teach
    that large requests always make it.
    """

    def __init__(
        self,
        bounds: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4),
        *,
        weight: float = 0.05,
        min_samples: int = 20,
        limits: tuple[float, float] = (0.1, 10.0),
    ) -> None:
        if list(bounds) != sorted(bounds) or any(b <= 0 for b in bounds):
            raise ValueError("bounds must be positive and increasing")
        if not 0.0 < weight <= 1.0:
            raise ValueError("weight must be in (0, 1]")
        self._bounds = bounds
        self._weight = weight
        self._min_samples = min_samples
        self._limits = limits
        classes = len(bounds) + 1
        self._predicted = [0.0] * classes
        self._waited = [0.0] * classes
        self._counts = [0] * classes

    def _class(self, blocks: int, pool_blocks: int) -> int:
        share = blocks / pool_blocks if pool_blocks > 0 else 1.0
        for index, bound in enumerate(self._bounds):
            if share <= bound:
                return index
        return len(self._bounds)

    def observe(self, blocks: int, pool_blocks: int, predicted_s: float, waited_s: float) -> None:
        """A request of `blocks` left the queue after `waited_s`, predicted at `predicted_s`."""
        index = self._class(blocks, pool_blocks)
        keep = 1.0 - self._weight
        self._predicted[index] = keep * self._predicted[index] + self._weight * max(0.0, predicted_s)
        self._waited[index] = keep * self._waited[index] + self._weight * max(0.0, waited_s)
        self._counts[index] += 1

    def factor(self, blocks: int, pool_blocks: int) -> float:
        """What to multiply an in-order prediction by for a request of `blocks`."""
        return self._factor(self._class(blocks, pool_blocks))

    def _factor(self, index: int) -> float:
        if self._counts[index] < self._min_samples or self._predicted[index] <= 0.0:
            return 1.0
        low, high = self._limits
        return min(high, max(low, self._waited[index] / self._predicted[index]))

    def factors(self) -> list[dict[str, float | int | None]]:
        """Per class: its upper share of the pool (None: open), samples, factor."""
        uppers: list[float | None] = [*self._bounds, None]
        return [
            {
                "max_share_of_pool": upper,
                "samples": self._counts[index],
                "factor": round(self._factor(index), 3),
            }
            for index, upper in enumerate(uppers)
        ]
