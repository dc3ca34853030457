"""Reading a backend's budget: Prometheus text -> `BackendReading`, and the async poller.

`parse_metrics_text` runs prometheus_client's real text parser over the lines that matter
(the pure arithmetic is `gateway.vllm_metrics`). `MetricsPoller` scrapes `/metrics` every
`interval_s` with an explicit timeout, feeds each good reading to `KvBudget.observe` (the
closed loop) and each failure to `KvBudget.observe_failure` (unknown means saturated), then
calls `on_update` so the wait queue can react at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Callable
from dataclasses import replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.capacity import KvBudget, Reconciliation
from gateway.vllm_metrics import METRIC_NAMES, BackendReading, MetricSample, MetricsFormatError, read_backend

log = logging.getLogger(__name__)

# Only the families kvgate reads go through the parser: vLLM's /metrics is mostly histograms
# it does not need, and parsing them all every 200 ms would cost a noticeable share of a core.
_FAMILY_PREFIXES = tuple(
    sorted({name.removesuffix("_total") for names in METRIC_NAMES.values() for name in names})
)


def _relevant(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return len(parts) >= 3 and parts[2].startswith(_FAMILY_PREFIXES)
    return line.startswith(_FAMILY_PREFIXES)


def parse_metrics_text(text: str) -> BackendReading:
    """Parse a /metrics body; raise MetricsFormatError when it is malformed or incomplete."""
    kept = "\n".join(line for line in text.splitlines() if _relevant(line)) + "\n"
    try:
        samples = [
            MetricSample(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(kept)
            for sample in family.samples
        ]
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsFormatError(f"malformed Prometheus text: {exc}") from exc
    # The digest covers the whole text, not only the lines read: see KvBudget on frozen metrics.
    return replace(read_backend(samples), digest=float(zlib.crc32(text.encode())))


class MetricsPoller:
    """Scrapes one backend's /metrics forever; cancel the task running `run` to stop it."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        url: str,
        budget: KvBudget,
        clock: Callable[[], float],
        interval_s: float,
        timeout_s: float,
        on_update: Callable[[Reconciliation | None], None],
        headers: dict[str, str] | None = None,
        waiting: Callable[[], bool] = lambda: False,
    ) -> None:
        self._client = client
        self._url = url
        self._budget = budget
        self._clock = clock
        self._interval_s = interval_s
        self._timeout = httpx.Timeout(timeout_s)
        self._on_update = on_update
        self._headers = headers or {}
        self._waiting = waiting  # whether requests wait for this backend's blocks now
        self.failures = 0
        self._poked = asyncio.Event()

    def reconfigure(self, *, interval_s: float, timeout_s: float) -> None:
        """New interval and timeout, from the next scrape on (a settings reload)."""
        self._interval_s = interval_s
        self._timeout = httpx.Timeout(timeout_s)
        self.poke()

    def poke(self) -> None:
        """Scrape now instead of at the next tick (a request just failed to reach the backend)."""
        self._poked.set()

    async def poll_once(self) -> Reconciliation | None:
        """One scrape; returns the reconciliation, or None when the scrape failed."""
        started = self._clock()
        result: Reconciliation | None = None
        try:
            response = await self._client.get(self._url, timeout=self._timeout, headers=self._headers)
            response.raise_for_status()
            reading = parse_metrics_text(response.text)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._fail(f"cannot connect: {exc!r}", unreachable=True)
        except (httpx.HTTPError, MetricsFormatError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}", unreachable=False)
        else:
            result = self._budget.observe(reading, started, self._clock(), waiting=self._waiting())
            if result is None:  # refused as frozen; the budget has counted the failure
                self._count_failure(self._budget.last_error)
        self._on_update(result)
        return result

    def _fail(self, message: str, *, unreachable: bool) -> None:
        self._count_failure(message)
        self._budget.observe_failure(message, unreachable=unreachable, now=self._clock())

    def _count_failure(self, message: str) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 50 == 0:
            log.warning("metrics scrape of %s failed (%d so far): %s", self._url, self.failures, message)

    async def run(self) -> None:
        while True:
            started = self._clock()
            # A poke that arrives during this scrape asks for another one that starts after it.
            self._poked.clear()
            await self.poll_once()
            elapsed = self._clock() - started
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self._interval_s - elapsed)):
                    await self._poked.wait()
