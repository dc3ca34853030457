"""How many output tokens to reserve for a request, learned online (pure).

`max_tokens` is only a cap and most answers stop far below it; reserving the cap is the
over-reservation PagedAttention removed. The model keeps a sliding window of the completion
lengths (per sequence) of finished requests under a hierarchy of keys, most specific first:
(model, route, tenant), (model, route), (model). A prediction uses the most specific key that
has `min_samples` observations and answers the configured quantile of its window, capped by
the request's own cap. With too few samples anywhere it answers the cap itself: conservative
until it knows better.

Quantiles come from a sorted copy of the window kept alongside it (bisect insert and remove,
O(window) per observation, O(1) per prediction): predictions are on every request's path,
observations only on completions. The number of keys is bounded (least recently used go).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import StrEnum


class PredictionSource(StrEnum):
    LEARNED = "learned"
    COLD = "cold"  # too few samples: the cap


@dataclass(frozen=True, slots=True)
class OutputKey:
    """Where a request's output length is learned. `tenant` is None until tenants exist."""

    model: str
    route: str
    tenant: str | None = None

    def fallbacks(self) -> tuple[OutputKey, ...]:
        """This key and its coarser parents, most specific first."""
        keys = [self]
        if self.tenant is not None:
            keys.append(OutputKey(self.model, self.route))
        if self.route:
            keys.append(OutputKey(self.model, ""))
        return tuple(keys)

    def label(self) -> str:
        return "/".join(part for part in (self.model, self.route, self.tenant or "") if part)


@dataclass(frozen=True, slots=True)
class OutputPrediction:
    tokens: int
    source: PredictionSource
    samples: int
    key: OutputKey | None


class _Window:
    __slots__ = ("arrival", "ordered", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.arrival: deque[int] = deque()
        self.ordered: list[int] = []

    def add(self, value: int) -> None:
        if len(self.arrival) == self.size:
            oldest = self.arrival.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, oldest)]
        self.arrival.append(value)
        bisect.insort(self.ordered, value)

    def quantile(self, q: float) -> int:
        # Nearest-rank quantile: an observed value, never an interpolation below it.
        rank = max(1, math.ceil(q * len(self.ordered)))
        return self.ordered[rank - 1]


class OutputLengthModel:
    """Online completion-length distribution. Not thread-safe: one event loop owns it."""

    def __init__(self, *, quantile: float, min_samples: int, window: int, max_keys: int = 1024) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError("quantile must lie in (0, 1]")
        if min_samples < 1 or window < min_samples:
            raise ValueError("need 1 <= min_samples <= window")
        self.quantile = quantile
        self.min_samples = min_samples
        self._window = window
        self._max_keys = max_keys
        self._windows: OrderedDict[OutputKey, _Window] = OrderedDict()

    def predict(self, key: OutputKey, cap: int) -> OutputPrediction:
        """Output tokens to reserve per sequence, at most `cap`."""
        for candidate in key.fallbacks():
            window = self._windows.get(candidate)
            if window is not None and len(window.arrival) >= self.min_samples:
                tokens = min(cap, window.quantile(self.quantile))
                return OutputPrediction(tokens, PredictionSource.LEARNED, len(window.arrival), candidate)
        return OutputPrediction(cap, PredictionSource.COLD, 0, None)

    def observe(self, key: OutputKey, tokens: int) -> None:
        """Record one finished sequence's completion length under the key and its parents."""
        if tokens < 0:
            raise ValueError("completion length must not be negative")
        for candidate in key.fallbacks():
            window = self._windows.get(candidate)
            if window is None:
                window = self._windows[candidate] = _Window(self._window)
                while len(self._windows) > self._max_keys:
                    self._windows.popitem(last=False)
            else:
                self._windows.move_to_end(candidate)
            window.add(tokens)

    def describe(self) -> dict[str, dict[str, int]]:
        """Per key: samples and the current reserved quantile (for /admin/state)."""
        return {
            key.label() or "(all)": {
                "samples": len(window.arrival),
                "quantile_tokens": window.quantile(self.quantile) if window.ordered else 0,
            }
            for key, window in self._windows.items()
        }
