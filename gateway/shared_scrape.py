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

Whatever goes wrong falls back to reading the backend directly, for that poll: Redis away or
slow, nothing published, a reading older than `max_age_s` (the holder is slow, stuck or dead:
its lease expires after `lease_ttl_s` and another process takes it), or a text that does not
decode. A scrape that fails is not published: followers see the shared reading age and read
the backend themselves, so each process learns of a failure first-hand, as without sharing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.shared_reading import Lead, Published, ScrapeYourself, Turn, encode_reading, follower_step
from gateway.vllm_metrics import BackendReading

log = logging.getLogger(__name__)


class ScrapeShare:
    """One backend's side of the shared scrape, for one process (one event loop)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Sequence[str],
        owner: str,
        sources: dict[str, str],
        *,
        processes: Callable[[], int],
        interval_s: float,
        timeout_s: float,
        stale_after_s: float,
    ) -> None:
        self._turn = redis.register_script(sources["scrape_turn"])
        self._publish = redis.register_script(sources["scrape_publish"])
        self._keys = list(keys)
        self._owner = owner
        self._processes = processes
        self._stale_after_s = stale_after_s
        self.reconfigure(interval_s=interval_s, timeout_s=timeout_s)
        self._last_stamp: str | None = None
        self.role = "starting"  # leads, follows, or reads itself (why, for /admin/state)
        self.errors = 0
        self.stopped = False  # the shared ledger stopped: its client is not to be used again

    def reconfigure(self, *, interval_s: float, timeout_s: float, stale_after_s: float | None = None) -> None:
        self._interval_s = interval_s
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
        # Bounded by the client's socket timeout (redis_timeout_s), not by a cancellation: one
        # in the middle of a call can leave its connection half-read.
        try:
            answer = await self._turn(keys=self._keys, args=[self._owner, int(self.lease_ttl_s * 1000)])
            published = _published(answer)
        except (RedisError, OSError, TimeoutError, ValueError, IndexError, TypeError) as exc:
            _raise_if_cancelled()
            self._error("asking for its turn", exc)
            return self._reads_itself(f"Redis: {type(exc).__name__}")
        _raise_if_cancelled()
        if isinstance(published, Lead):
            self.role = "leads"
            return published
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

    async def publish(self, reading: BackendReading, took_s: float) -> None:
        """Publish a reading this process took as the lease's holder (best effort)."""
        if self.stopped:
            return
        try:
            await self._publish(
                keys=self._keys,
                args=[
                    self._owner,
                    max(0, round(took_s * 1000)),
                    encode_reading(reading),
                    int(self.lease_ttl_s * 1000),
                ],
            )
        except (RedisError, OSError, TimeoutError) as exc:
            _raise_if_cancelled()
            self._error("publishing a reading", exc)
        _raise_if_cancelled()

    def describe(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "lease_ttl_s": self.lease_ttl_s,
            "max_age_s": self.max_age_s,
            "errors": self.errors,
        }

    def _reads_itself(self, why: str) -> ScrapeYourself:
        self.role = f"reads itself ({why})"
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
