"""A backend's reading shared between the processes of one ledger (pure: no I/O, no clock).

With a shared ledger every process needs a fresh reading of each backend's /metrics, but one
scrape per backend serves them all: the process holding the backend's scrape lease reads it
and publishes the parsed reading in Redis; the others take it from there (see
`gateway.shared_scrape`). This module holds what does not need Redis: the reading's text form,
which a reader checks as strictly as `read_backend` checks a scrape (another version of kvgate,
or damage, must not feed a budget nonsense), and the follower's choice at each turn.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gateway.vllm_metrics import (
    MAX_BLOCK_SIZE_TOKENS,
    MAX_COUNTER,
    BackendReading,
    MetricsFormatError,
)

# Bumped whenever the text form changes: a reading of another version is not read.
FORMAT_VERSION = 1
# The largest text accepted from Redis (a reading with a full output-length histogram is ~2 KB).
MAX_READING_CHARS = 64 << 10


def encode_reading(reading: BackendReading) -> str:
    return json.dumps(
        {
            "v": FORMAT_VERSION,
            "total_blocks": reading.total_blocks,
            "block_size": reading.block_size,
            "used_blocks": reading.used_blocks,
            "running": reading.running,
            "waiting": reading.waiting,
            "preemptions_total": reading.preemptions_total,
            "engines": reading.engines,
            "prefix_caching": reading.prefix_caching,
            "engine_steps_total": reading.engine_steps_total,
            "digest": reading.digest,
            # The last bound is +inf: written as a string, JSON has no infinity.
            "output_length_buckets": [
                [bound if math.isfinite(bound) else "+Inf", count]
                for bound, count in reading.output_length_buckets
            ],
            "waiting_for_capacity": reading.waiting_for_capacity,
        },
        separators=(",", ":"),
    )


def decode_reading(text: str) -> BackendReading:
    """The reading `encode_reading` wrote; MetricsFormatError for anything else."""
    if len(text) > MAX_READING_CHARS:
        raise MetricsFormatError(f"a shared reading is longer than {MAX_READING_CHARS} characters")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise MetricsFormatError(f"a shared reading is not JSON: {exc}"[:200]) from None
    if not isinstance(data, dict) or data.get("v") != FORMAT_VERSION:
        raise MetricsFormatError("a shared reading of another format version")
    total = _count(data, "total_blocks", MAX_COUNTER, least=1)
    used = _number(data, "used_blocks", float(total))
    if used is None:
        raise MetricsFormatError("a shared reading without used_blocks")
    prefix_caching = data.get("prefix_caching")
    if prefix_caching is not None and not isinstance(prefix_caching, bool):
        raise MetricsFormatError("a shared reading's prefix_caching is not a boolean")
    return BackendReading(
        total_blocks=total,
        block_size=_count(data, "block_size", MAX_BLOCK_SIZE_TOKENS, least=1),
        used_blocks=used,
        running=_count(data, "running", MAX_COUNTER),
        waiting=_count(data, "waiting", MAX_COUNTER),
        preemptions_total=_number(data, "preemptions_total", MAX_COUNTER),
        engines=_count(data, "engines", MAX_COUNTER, least=1),
        prefix_caching=prefix_caching,
        engine_steps_total=_number(data, "engine_steps_total", MAX_COUNTER),
        digest=_number(data, "digest", MAX_COUNTER),
        output_length_buckets=_buckets(data.get("output_length_buckets")),
        waiting_for_capacity=(
            None
            if data.get("waiting_for_capacity") is None
            else _count(data, "waiting_for_capacity", MAX_COUNTER)
        ),
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number kvgate writes")


def _count(data: dict[str, Any], key: str, most: float, *, least: int = 0) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
        raise MetricsFormatError(f"a shared reading's {key} is not a count within [{least}, {most:g}]")
    return value


def _number(data: dict[str, Any], key: str, most: float) -> float | None:
    """A finite number within [0, most], or None where the reading has none."""
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= value <= most:
        raise MetricsFormatError(f"a shared reading's {key} is not a number within [0, {most:g}]")
    return float(value)


def _buckets(value: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list) or len(value) > 1024:
        raise MetricsFormatError("a shared reading's output_length_buckets is not a list of at most 1024")
    buckets: list[tuple[float, float]] = []
    for position, entry in enumerate(value):
        if not isinstance(entry, list) or len(entry) != 2:
            raise MetricsFormatError("a shared reading's bucket is not [bound, count]")
        bound, count = entry
        last = position == len(value) - 1
        if last and bound == "+Inf":
            bound = math.inf
        elif not isinstance(bound, int | float) or isinstance(bound, bool) or not 0.0 <= bound <= MAX_COUNTER:
            raise MetricsFormatError("a shared reading's bucket bound is not a number (nor +Inf, last)")
        if not isinstance(count, int | float) or isinstance(count, bool) or not 0.0 <= count <= MAX_COUNTER:
            raise MetricsFormatError("a shared reading's bucket count is not a number within bounds")
        if buckets and (bound <= buckets[-1][0] or count < buckets[-1][1]):
            raise MetricsFormatError("a shared reading's buckets are not cumulative by increasing bound")
        buckets.append((float(bound), float(count)))
    if buckets and not math.isinf(buckets[-1][0]):
        raise MetricsFormatError("a shared reading's last bucket is not +Inf")
    return tuple(buckets)


@dataclass(frozen=True, slots=True)
class Published:
    """What the scrape lease's holder last published for a backend, as a follower got it."""

    stamp: str  # tells one publication from the next (the server's time and a sequence)
    age_s: float  # server time since it was published
    took_s: float  # how long the holder's scrape took, request to parsed reading
    text: str


@dataclass(frozen=True, slots=True)
class Follow:
    """Observe this reading, taken over [started_at, finished_at] of the follower's clock."""

    reading: BackendReading
    started_at: float
    finished_at: float


@dataclass(frozen=True, slots=True)
class AskAgain:
    """Nothing newer than what was already observed: ask again after `pause_s`."""

    pause_s: float


@dataclass(frozen=True, slots=True)
class ScrapeYourself:
    """No usable reading is shared (none, too old, unreadable): scrape the backend directly."""

    why: str


@dataclass(frozen=True, slots=True)
class Lead:
    """This process holds the scrape lease: read the backend, then publish the reading."""


FollowerStep = Follow | AskAgain | ScrapeYourself
Turn = Lead | FollowerStep


def follower_step(
    published: Published | None,
    *,
    last_stamp: str | None,
    asked_at: float,
    interval_s: float,
    max_age_s: float,
) -> FollowerStep:
    """What a process that does not hold the scrape lease does with what it found.

    `asked_at` is the follower's clock when it sent the question: the reading's age is counted
    back from there, so its times are placed no later than they were (a reading placed early
    counts the requests sent just before it as not yet allocated: the safe side). A reading
    older than `max_age_s` (the holder is slow, stuck or gone) is not taken: the follower reads
    the backend itself, so that a lease holder's trouble never makes anyone's budget stale.
    """
    if published is None:
        return ScrapeYourself("no reading is shared")
    if not (math.isfinite(published.age_s) and math.isfinite(published.took_s)) or published.took_s < 0:
        return ScrapeYourself("the shared reading's times are not numbers")
    age_s = max(0.0, published.age_s)
    if age_s > max_age_s:
        return ScrapeYourself(f"the shared reading is {age_s:.2f} s old")
    if published.stamp == last_stamp:
        # The next publication is due about an interval after this one.
        return AskAgain(min(interval_s, max(interval_s / 10, interval_s - age_s + interval_s / 10)))
    try:
        reading = decode_reading(published.text)
    except MetricsFormatError as exc:
        return ScrapeYourself(str(exc))
    finished_at = asked_at - age_s
    return Follow(reading, finished_at - min(published.took_s, max_age_s), finished_at)
