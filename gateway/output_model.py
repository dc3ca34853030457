"""How many output tokens to reserve for a request, learned online (pure).

`max_tokens` is only a cap and most answers stop far below it; reserving the cap is the
over-reservation PagedAttention removed. The model keeps a sliding window of the completion
lengths (per sequence) of finished requests under a hierarchy of keys, most specific first:
(model, route, tenant), (model, route), (model). A prediction uses the most specific key that
has `min_samples` observations and answers the configured quantile of its window, capped by
the request's own cap. With too few samples anywhere it answers the backend's own figure when
there is one (below), else the cap itself: conservative until it knows better.

A gateway that restarts in front of a vLLM that has been serving need not start from the cap:
vLLM exports the histogram of the output lengths it has produced
(`vllm:request_generation_tokens`). `quantile_from_buckets` reads the quantile off it, rounded
up to the bound of its bucket (the buckets are coarse: 1, 2, 5, 10, 20, 50, 100, ...), and the
model answers that, capped, for any key that has not seen `min_samples` answers of its own.

Quantiles come from a sorted copy of the window kept alongside it (bisect insert and remove,
O(window) per observation, O(1) per prediction): predictions are on every request's path,
observations only on completions. The number of keys is bounded (least recently used go).

`distribution(key)` hands out the window as an immutable `OutputDistribution`, for the
ledger's pooled reservation (see `gateway.ledger`): the mean and variance of what a request
still has to produce, given how far it already is. It is rebuilt (O(window)) only once the
window has changed by a sixty-fourth since the last build, so that its cost per completion
stays constant.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class PredictionSource(StrEnum):
    LEARNED = "learned"
    BACKEND = "backend"  # too few samples here: the backend's histogram
    COLD = "cold"  # too few samples anywhere: the cap
    FLOOR = "floor"  # the request's own guaranteed length (min_tokens, ignore_eos), above the rest


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


class OutputDistribution:
    """Completion lengths (per sequence) of finished requests, frozen: sorted, with prefix sums
    of the lengths and of their squares, so that conditional moments cost O(log n)."""

    __slots__ = ("_ordered", "_squares", "_sums")

    def __init__(self, lengths: Iterable[int]) -> None:
        self._ordered = tuple(sorted(lengths))
        self._sums = (0, *itertools.accumulate(self._ordered))
        self._squares = (0, *itertools.accumulate(value * value for value in self._ordered))

    def __len__(self) -> int:
        return len(self._ordered)

    def remaining(self, produced: int, cap: int) -> tuple[float, float] | None:
        """Mean and variance of the tokens still to come for a sequence that has produced
        `produced` tokens and stops at `cap` at the latest: over the observed lengths beyond
        `produced`, each cut at `cap`. None when no observed length lies beyond it (the
        distribution says nothing about such a request) or the cap is reached."""
        if produced >= cap:
            return None
        ordered = self._ordered
        beyond = bisect.bisect_right(ordered, produced)
        count = len(ordered) - beyond
        if count == 0:
            return None
        # Lengths in (produced, cap) count as they are, those at or past the cap as the cap.
        capped_from = max(beyond, bisect.bisect_left(ordered, cap))
        at_cap = len(ordered) - capped_from
        total = self._sums[capped_from] - self._sums[beyond] + at_cap * cap
        squares = self._squares[capped_from] - self._squares[beyond] + at_cap * cap * cap
        mean = total / count
        variance = max(0.0, squares / count - mean * mean)
        return mean - produced, variance


class _Window:
    __slots__ = ("arrival", "changes", "frozen", "frozen_at", "ordered", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.arrival: deque[int] = deque()
        self.ordered: list[int] = []
        self.changes = 0  # observations ever added
        self.frozen: OutputDistribution | None = None
        self.frozen_at = 0  # `changes` when `frozen` was built

    def add(self, value: int) -> None:
        if len(self.arrival) == self.size:
            oldest = self.arrival.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, oldest)]
        self.arrival.append(value)
        bisect.insort(self.ordered, value)
        self.changes += 1

    def distribution(self) -> OutputDistribution:
        if self.frozen is None or self.changes - self.frozen_at >= max(1, len(self.ordered) // 64):
            self.frozen = OutputDistribution(self.ordered)
            self.frozen_at = self.changes
        return self.frozen

    def quantile(self, q: float) -> int:
        # Nearest-rank quantile: an observed value, never an interpolation below it.
        rank = max(1, math.ceil(q * len(self.ordered)))
        return self.ordered[rank - 1]


def quantile_from_buckets(
    buckets: Sequence[tuple[float, float]], quantile: float, min_samples: int
) -> tuple[int, int] | None:
    """The `quantile` of a Prometheus histogram given as (upper bound, cumulative count) by
    increasing bound, rounded up to its bucket's bound, with the number of observations: None
    with fewer than `min_samples` of them or when the quantile lies in the +inf bucket."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total < min_samples:
        return None
    rank = max(1.0, math.ceil(quantile * total))
    for bound, cumulative in buckets:
        if cumulative >= rank:
            return (math.ceil(bound), int(total)) if math.isfinite(bound) else None
    return None


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
        # (tokens, observations) from the backend's histogram; None: none usable.
        self.backend_prior: tuple[int, int] | None = None

    def predict(self, key: OutputKey, cap: int) -> OutputPrediction:
        """Output tokens to reserve per sequence, at most `cap`."""
        for candidate in key.fallbacks():
            window = self._windows.get(candidate)
            if window is not None and len(window.arrival) >= self.min_samples:
                tokens = min(cap, window.quantile(self.quantile))
                return OutputPrediction(tokens, PredictionSource.LEARNED, len(window.arrival), candidate)
        if self.backend_prior is not None:
            tokens, samples = self.backend_prior
            return OutputPrediction(min(cap, tokens), PredictionSource.BACKEND, samples, None)
        return OutputPrediction(cap, PredictionSource.COLD, 0, None)

    def observe_backend(self, buckets: Sequence[tuple[float, float]]) -> None:
        """Take the backend's output-length histogram (see `quantile_from_buckets`); one that
        is too thin or whose quantile is unbounded leaves no prior."""
        self.backend_prior = quantile_from_buckets(buckets, self.quantile, self.min_samples)

    def distribution(self, key: OutputKey) -> OutputDistribution | None:
        """The learned lengths behind `predict(key, ...)`, or None while too few are learned."""
        for candidate in key.fallbacks():
            window = self._windows.get(candidate)
            if window is not None and len(window.arrival) >= self.min_samples:
                return window.distribution()
        return None

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
