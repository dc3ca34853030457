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
