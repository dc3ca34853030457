"""Loads defined by measurement (pure): the arrival rate the backend itself sustains.

Issue 20 defines the loads of a campaign on the machine at hand, on the very slice replayed:
1x is a rate at which vLLM straight finishes at least 98% of the slice within the deadline,
with a margin, because the testbed's speed drifts between machines by 2x and between runs by
20%; 3x and 0.5x are multiples of that. `find_rate` searches that rate with a measurement it is
given (the campaign runs the bench against vLLM straight): it doubles (or halves) the rate
until the share finished changes side, then bisects between the last rate that passed and the
first that failed, geometrically since the first bracket spans a factor of two. The
measurement is noisy, so the answer is a rate that passed, not a fitted boundary.

A slice is finite, and a deadline lets a backend finish late what arrived faster than it
keeps up: `n` requests arriving at `r` per second to a backend that serves `C < r` leave a
backlog whose last request waits `n / C - n / r`. The slice is finished within the deadline
`d` while that stays under `d`, so the highest rate that passes, `r*`, says the backend keeps
up with `C = 1 / (1 / r* + d / n)`, not `r*`: a slice that arrives within one deadline can pass
at any rate. When the search knows the slice (`slice_requests`, `deadline_s`), 1x is that `C`
times the margin; the rate that passed stays in `sustained`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_FINISHED_SHARE = 0.98
DEFAULT_MARGIN = 0.8
# Start high: a run at a high rate is short (n / rate seconds of arrivals), so the failures
# the search needs cost little, while each halving toward 1x doubles a run's length.
DEFAULT_START_RATE = 8.0
DEFAULT_MAX_DOUBLINGS = 6
DEFAULT_BISECTIONS = 3
# The loads the issue names, as multiples of 1x.
LOAD_MULTIPLES: Mapping[str, float] = {"0.5x": 0.5, "1x": 1.0, "3x": 3.0}


@dataclass(frozen=True, slots=True)
class Step:
    """One measurement: the rate tried (requests/s) and the share of the slice finished."""

    rate: float
    finished_share: float

    def passed(self, target: float) -> bool:
        return self.finished_share >= target


@dataclass(frozen=True, slots=True)
class RateSearch:
    """The outcome: `sustained` is the highest rate that passed (None when even the lowest
    tried failed); `bounded` is False when no rate tried failed (the backend may sustain more
    than `sustained`); `capacity` the rate the backend keeps up with, from `sustained` and the
    slice (see the module docstring; `sustained` itself when the slice is not given); `one_x`
    is `capacity` times the margin."""

    steps: tuple[Step, ...]
    target_share: float
    margin: float
    sustained: float | None
    bounded: bool
    slice_requests: int | None = None
    deadline_s: float | None = None

    @property
    def capacity(self) -> float | None:
        if self.sustained is None or self.slice_requests is None or self.deadline_s is None:
            return self.sustained
        return 1.0 / (1.0 / self.sustained + self.deadline_s / self.slice_requests)

    @property
    def one_x(self) -> float | None:
        capacity = self.capacity
        return None if capacity is None else capacity * self.margin

    def loads(self) -> dict[str, float]:
        """The rates of the issue's loads (empty when nothing passed)."""
        one_x = self.one_x
        return {} if one_x is None else {name: one_x * k for name, k in LOAD_MULTIPLES.items()}

    def to_json(self) -> dict[str, Any]:
        """What a benchmark records of the search (its find-1x.json, beside what it replayed)."""
        return {
            "target_share": self.target_share,
            "margin": self.margin,
            "steps": [{"rate": s.rate, "finished_share": s.finished_share} for s in self.steps],
            "sustained_rate": self.sustained,
            "keeps_up_with": self.capacity,
            "bounded": self.bounded,
            "one_x": self.one_x,
            "loads": self.loads(),
        }


def finished_share_of(target: Mapping[str, Any]) -> float:
    """The share of a burst finished within the deadline, from one target's row of a `kvgate
    bench` summary (`ok` of `sent`; 0 when nothing was sent): what the search measures."""
    sent = target["sent"]
    return float(target["ok"]) / sent if sent else 0.0


def find_rate(
    finished_share: Callable[[float], float],
    *,
    start_rate: float = DEFAULT_START_RATE,
    target_share: float = DEFAULT_FINISHED_SHARE,
    margin: float = DEFAULT_MARGIN,
    max_doublings: int = DEFAULT_MAX_DOUBLINGS,
    bisections: int = DEFAULT_BISECTIONS,
    slice_requests: int | None = None,
    deadline_s: float | None = None,
) -> RateSearch:
    """Search the highest rate at which `finished_share(rate)` (0..1) reaches `target_share`:
    at most 1 + `max_doublings` + `bisections` measurements. With the slice's length and the
    deadline, 1x is what the backend keeps up with (see the module docstring)."""
    if start_rate <= 0 or not 0 < target_share <= 1 or not 0 < margin <= 1:
        raise ValueError("start_rate must be > 0, target_share and margin in (0, 1]")
    if (slice_requests is not None and slice_requests <= 0) or (deadline_s is not None and deadline_s <= 0):
        raise ValueError("slice_requests and deadline_s must be > 0")
    steps: list[Step] = []

    def measure(rate: float) -> bool:
        step = Step(rate, finished_share(rate))
        steps.append(step)
        return step.passed(target_share)

    good: float | None = None
    bad: float | None = None
    rate = start_rate
    if measure(rate):
        good = rate
        for _ in range(max_doublings):
            rate *= 2
            if not measure(rate):
                bad = rate
                break
            good = rate
    else:
        bad = rate
        for _ in range(max_doublings):
            rate /= 2
            if measure(rate):
                good = rate
                break
            bad = rate
    if good is not None and bad is not None:
        for _ in range(bisections):
            middle = math.sqrt(good * bad)
            if measure(middle):
                good = middle
            else:
                bad = middle
    return RateSearch(
        steps=tuple(steps),
        target_share=target_share,
        margin=margin,
        sustained=good,
        bounded=bad is not None,
        slice_requests=slice_requests,
        deadline_s=deadline_s,
    )


def parse_rates(text: str, one_x: float | None) -> list[float]:
    """Comma-separated rates in requests/s, or multiples of 1x such as `0.5x,3x` (which need
    `one_x`); ValueError for anything else."""
    rates = []
    for part in (p.strip() for p in text.split(",")):
        if part.endswith("x"):
            if one_x is None:
                raise ValueError(f"rate {part!r} is a multiple of 1x: measure it (--find-1x) or give --one-x")
            rate = float(part[:-1]) * one_x
        else:
            rate = float(part)
        if not rate > 0:
            raise ValueError(f"rate {part!r} must be > 0")
        rates.append(rate)
    return rates


def describe(search: RateSearch) -> str:
    """A few lines for a person: what was tried, and the rates to use."""
    lines = [
        f"rate {step.rate:.3g}/s: {100 * step.finished_share:.1f}% finished within the deadline"
        + ("" if step.passed(search.target_share) else " (below target)")
        for step in search.steps
    ]
    if search.sustained is None:
        lines.append(f"no rate tried reached {100 * search.target_share:g}%: try a lower --start-rate")
        return "\n".join(lines)
    lines.append(
        f"sustained: {search.sustained:.3g}/s"
        + ("" if search.bounded else " (no rate tried failed: the backend may sustain more)")
    )
    basis = "sustained"
    if search.capacity != search.sustained and search.capacity is not None:
        lines.append(
            f"keeps up with: {search.capacity:.3g}/s (what finishes {search.slice_requests} requests"
            f" arriving at {search.sustained:.3g}/s within {search.deadline_s:g} s)"
        )
        basis = "keeps up with"
    loads = ", ".join(f"{name} = {rate:.3g}/s" for name, rate in search.loads().items())
    lines.append(f"1x = {basis} x {search.margin:g}: {loads}")
    return "\n".join(lines)
