"""One scrape of a backend's /metrics for every process of a shared ledger.

Without sharing, N processes in front of a backend read its /metrics N times per interval:
N times the load on vLLM's API server, and each process pays the HTTP exchange and the parse
(half of an idle process's CPU). With a shared ledger, the processes take turns through Redis:
at each poll a process asks (`scrape_turn.lua`, one round trip); the one holding the backend's
scrape lease, or taking it because nobody holds it, reads /metrics and publishes the parsed
reading with the server's time (`scrape_publish.lua`); the others observe that reading, placed
at its age on their own clock (`gateway.shared_reading.follower_step`). A reading already
observed is not observed twice (a budget would take it for frozen metrics); a follower asks
again when the next one is due.

The holder's round trips are few: its publication rides with the shared ledger's next round
trip (the one that publishes its view of the same reading, `gateway.redis_store`), and renews
its lease, so while its last publication left the lease long enough for another scrape it
leads without asking.

Whatever goes wrong falls back to reading the backend directly, for that poll: Redis away or
slow, nothing published, a reading older than `max_age_s` (the holder is slow, stuck or dead:
its lease expires after `lease_ttl_s` and another process takes it), or a text that does not
decode. A scrape that fails is not published: followers see the shared reading age and read
the backend themselves, so each process learns of a failure first-hand, as without sharing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.shared_reading import Lead, Published, ScrapeYourself, Turn, encode_reading, follower_step
from gateway.vllm_metrics import BackendReading

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A reading the holder took, waiting for the shared ledger's next round trip."""

    text: str
    took_ms: int
    handed_at: float  # this share's clock when the poller handed it over
    led_at: float  # the poller's clock when its poll began: the lease lasted from then on
    lease_ttl_ms: int


class ScrapeShare:
    """One backend's side of the shared scrape, for one process (one event loop)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Sequence[str],
        owner: str,
        turn_source: str,
        *,
        processes: Callable[[], int],
        wake: Callable[[], None],
        interval_s: float,
        timeout_s: float,
        stale_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._turn = redis.register_script(turn_source)
        self.keys = list(keys)
        self._owner = owner
        self._processes = processes
        self._wake = wake
        self._clock = clock
        self._stale_after_s = stale_after_s
        self.reconfigure(interval_s=interval_s, timeout_s=timeout_s)
        self._last_stamp: str | None = None
        # By the poller's clock: until when this process surely holds the scrape lease, and
        # when the poll that leads now began.
        self._leads_until = -math.inf
        self._led_at = -math.inf
        self._pending: _Pending | None = None
        self._sent: _Pending | None = None
        self.role = "starting"  # leads, follows, or reads itself (why, for /admin/state)
        self.errors = 0
        self.turns_asked = 0  # of Redis: a holder that renews its lease by publishing asks rarely
        self.stopped = False  # the shared ledger stopped: its client is not to be used again

    def reconfigure(self, *, interval_s: float, timeout_s: float, stale_after_s: float | None = None) -> None:
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        if stale_after_s is not None:
            self._stale_after_s = stale_after_s
        # The holder renews its lease at every poll: it keeps it through a slow scrape or two.
        self.lease_ttl_s = max(1.0, 2 * (interval_s + timeout_s))
        # Older than this, a shared reading would leave a follower less than half its margin
        # before its budget goes stale.
        self.max_age_s = max(interval_s, self._stale_after_s / 2)

    async def turn(self, asked_at: float) -> Turn:
        """Lead, follow with a reading, ask again later, or read the backend directly."""
        if self.stopped:
            return self._reads_itself("the shared ledger stopped")
        if self._processes() <= 1:
            # Nobody to share with: no round trips. A process that joins finds nothing
            # published, reads for itself, and both share once their renewals count two.
            return self._reads_itself("no other process")
        if asked_at + self._interval_s + self._timeout_s < self._leads_until:
            # The lease outlasts another scrape and the publication that renews it: no need
            # to ask (a publication that finds the lease lost says so, and this one asks again).
            return self._leads(asked_at)
        self._leads_until = -math.inf
        # Bounded by the client's socket timeout (redis_timeout_s), not by a cancellation: one
        # in the middle of a call can leave its connection half-read.
        self.turns_asked += 1
        try:
            answer = await self._turn(keys=self.keys, args=[self._owner, int(self.lease_ttl_s * 1000)])
            published = _published(answer)
        except (RedisError, OSError, TimeoutError, ValueError, IndexError, TypeError) as exc:
            _raise_if_cancelled()
            self._error("asking for its turn", exc)
            return self._reads_itself(f"Redis: {type(exc).__name__}")
        _raise_if_cancelled()
        if isinstance(published, Lead):
            # Set on the server after `asked_at`: it lasts at least this long.
            self._leads_until = asked_at + self.lease_ttl_s
            return self._leads(asked_at)
        step = follower_step(
            published,
            last_stamp=self._last_stamp,
            asked_at=asked_at,
            interval_s=self._interval_s,
            max_age_s=self.max_age_s,
        )
        if isinstance(step, ScrapeYourself):
            return self._reads_itself(step.why)
        if published is not None:
            self._last_stamp = published.stamp
        self.role = "follows"
        return step

    def publish(self, reading: BackendReading, took_s: float) -> None:
        """Hand over a reading this process took as the lease's holder (best effort): it goes
        to Redis with the shared ledger's next round trip, and a newer one replaces it there."""
        if self.stopped:
            return
        self._pending = _Pending(
            encode_reading(reading),
            max(0, round(took_s * 1000)),
            self._clock(),
            self._led_at,
            int(self.lease_ttl_s * 1000),
        )
        self._wake()

    def publication(self) -> list[str | int] | None:
        """scrape_publish.lua's arguments for the reading waiting to go (None: none waits)."""
        pending, self._pending = self._pending, None
        if pending is None or self.stopped:
            return None
        age_ms = max(0, round((self._clock() - pending.handed_at) * 1000))
        self._sent = pending
        return [
            self._owner,
            pending.took_ms,
            pending.text,
            pending.lease_ttl_ms,
            pending.lease_ttl_ms,
            age_ms,
        ]

    def published(self, answer: Any, exc: BaseException | None = None) -> None:
        """The answer to the last `publication` (1: published, 0: the lease was lost), or the
        round trip's failure."""
        sent, self._sent = self._sent, None
        if exc is not None or sent is None:
            self._leads_until = -math.inf
            if exc is not None:
                self._error("publishing a reading", exc)
            return
        if int(answer) == 1:
            # The server renewed the lease after the poll began, for the ttl sent.
            self._leads_until = max(self._leads_until, sent.led_at + sent.lease_ttl_ms / 1000)
        else:
            self._leads_until = -math.inf

    def describe(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "lease_ttl_s": self.lease_ttl_s,
            "max_age_s": self.max_age_s,
            "errors": self.errors,
            "turns_asked": self.turns_asked,
        }

    def _leads(self, asked_at: float) -> Lead:
        self.role = "leads"
        self._led_at = asked_at
        return Lead()

    def _reads_itself(self, why: str) -> ScrapeYourself:
        self.role = f"reads itself ({why})"
        self._leads_until = -math.inf
        return ScrapeYourself(why)

    def _error(self, doing: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning(
                "shared scrape: %s failed (%d so far): %r; reading the backend directly",
                doing,
                self.errors,
                exc,
            )


def _raise_if_cancelled() -> None:
    """redis-py can absorb a cancellation that arrives in the middle of a call (its clean-up
    catches it): the poller being stopped must stop all the same."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _published(answer: Any) -> Lead | Published | None:
    """scrape_turn.lua's answer: Lead, None for nothing published, else what was."""
    kind = int(answer[0])
    if kind == 1:
        return Lead()
    if kind == 0:
        return None
    stamp, age_ms, took_ms, text = (redis_text(part) for part in answer[1:5])
    return Published(stamp=stamp, age_s=int(age_ms) / 1000, took_s=float(took_ms) / 1000, text=text)


def redis_text(value: Any) -> str:
    """A value from Redis (bytes, or str when the client decodes) as text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
