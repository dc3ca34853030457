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

`output_reservation` is where a request's reservation is chosen: the length the client said it
expects (`X-Kvgate-Expected-Output-Tokens`, see `gateway.client_hints`) when it did, else the
model's prediction, lifted to what the request itself guarantees. A told length is a claim:
one below the real answer is admitted sooner and leaves the difference to vLLM's preemption.
So the model also keeps, per key, whether the recent told answers outgrew what was told
(`observe_told`); where more than TOLD_MAX_OUTGROWN_SHARE of them did, a told length no longer
lowers a reservation below the learned one (it may still raise it). Honest clients (batch jobs,
classifiers, the bench's oracle) lose nothing; one that under-tells gains nothing for long.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

# The answers a key's window keeps: enough for a p99 to rest on ten of them, few enough to
# follow a change of the traffic within minutes.
OUTPUT_WINDOW_SAMPLES = 1000


# What `typical` answers: the median, an unbiased guess of when an answer ends, where the
# reservation takes a high quantile, a bound on the blocks it holds.
TYPICAL_QUANTILE = 0.5
# Told answers remembered per key, how many must be in before they are judged, and the share of
# them that may outgrow what was told before told lengths stop lowering reservations.
TOLD_WINDOW = 50
TOLD_MIN_SAMPLES = 5
TOLD_MAX_OUTGROWN_SHARE = 0.2


class PredictionSource(StrEnum):
    LEARNED = "learned"
    BACKEND = "backend"  # too few samples here: the backend's histogram
    COLD = "cold"  # too few samples anywhere: the cap
    FLOOR = "floor"  # the request's own guaranteed length (min_tokens, ignore_eos), above the rest
    CLIENT = "client"  # the length the client said it expects (X-Kvgate-Expected-Output-Tokens)


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

    def __init__(
        self, *, quantile: float, min_samples: int, window: int = OUTPUT_WINDOW_SAMPLES, max_keys: int = 1024
    ) -> None:
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
        # The median of the same histogram (what a typical answer runs to), or None.
        self.backend_median: int | None = None
        # Per key: whether each recent told answer outgrew what was told.
        self._told: OrderedDict[OutputKey, deque[bool]] = OrderedDict()

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
        median = quantile_from_buckets(buckets, TYPICAL_QUANTILE, self.min_samples)
        self.backend_median = median[0] if median is not None else None

    def typical(self, prediction: OutputPrediction, key: OutputKey, cap: int) -> int:
        """Output tokens a request's answer typically runs to, for predicting when it ends
        (not for reserving its blocks): the reservation's own length when it is known (told by
        the client, or the request's floor); the median of what the reservation was learned
        from; 0 when nothing is known yet (the cap says nothing of when an answer ends)."""
        if prediction.source in (PredictionSource.CLIENT, PredictionSource.FLOOR):
            return prediction.tokens
        if prediction.source is PredictionSource.LEARNED and prediction.key is not None:
            window = self._windows.get(prediction.key)
            if window is not None and window.ordered:
                return min(cap, window.quantile(TYPICAL_QUANTILE))
        if prediction.source is PredictionSource.BACKEND and self.backend_median is not None:
            return min(cap, self.backend_median)
        return 0

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

    def observe_told(self, key: OutputKey, told: int, tokens: int) -> None:
        """A sequence whose client told `told` output tokens ran to `tokens`."""
        window = self._told.get(key)
        if window is None:
            window = self._told[key] = deque(maxlen=TOLD_WINDOW)
            while len(self._told) > self._max_keys:
                self._told.popitem(last=False)
        else:
            self._told.move_to_end(key)
        window.append(tokens > told)

    def trusts_told(self, key: OutputKey) -> bool:
        """Whether told lengths may lower this key's reservations (see the module docstring)."""
        window = self._told.get(key)
        if window is None or len(window) < TOLD_MIN_SAMPLES:
            return True
        return sum(window) <= TOLD_MAX_OUTGROWN_SHARE * len(window)

    def describe(self) -> dict[str, dict[str, int]]:
        """Per key: samples and the current reserved quantile (for /admin/state)."""
        return {
            key.label() or "(all)": {
                "samples": len(window.arrival),
                "quantile_tokens": window.quantile(self.quantile) if window.ordered else 0,
            }
            for key, window in self._windows.items()
        }


def output_reservation(
    model: OutputLengthModel, key: OutputKey, *, cap: int, floor: int, told: int | None
) -> OutputPrediction:
    """Output tokens to reserve per sequence of a request whose output may run to `cap` and is
    guaranteed to reach `floor` (<= cap: `min_tokens`, or the cap with `ignore_eos`): what the
    client `told` kvgate to expect when it did, else the model's prediction; never above the
    cap, never below the floor.

    A told length may lie below what the model would reserve: that is its point (the client
    knows), and an answer that outgrows it is covered as any other that outgrows its
    reservation. Where told answers have often outgrown what was told, it is taken only where
    it lies above the model's prediction (see the module docstring)."""
    if told is not None and (model.trusts_told(key) or told > model.predict(key, cap).tokens):
        prediction = OutputPrediction(min(cap, told), PredictionSource.CLIENT, 0, None)
    else:
        prediction = model.predict(key, cap)
    if floor > prediction.tokens:
        # The request itself guarantees more: that is what it reserves.
        prediction = OutputPrediction(floor, PredictionSource.FLOOR, prediction.samples, None)
    return prediction
