"""One backend of the fleet: what it serves, its live KV budget, its pace, its ledger, its health.

A `Backend` knows nothing about the other backends nor about requests before they are
admitted onto it. It reads `/v1/models` (discovery, refreshed) and `/metrics` (the poller,
which keeps the budget fresh, stale or down: its health), keeps the ledger of what was
admitted onto it, measures how fast its blocks drain (`gateway.pace`), remembers the prompt
blocks recently sent to it (`gateway.routing.PrefixIndex`, bounded by its pool) and holds the
connection pool its generation requests go through. The router (`gateway.router`) chooses
among backends and tells the chosen one what it admitted, what streamed and what ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpx

from estimator.demand import Demand
from gateway.admission import Target
from gateway.budget import MetricsPoller, ScrapeTurns
from gateway.capacity import BudgetSnapshot, BudgetState, CapacityConfig, KvBudget, Reconciliation, Standing
from gateway.credentials import redact_url
from gateway.discovery import BackendInfo, DiscoveryError, fetch_models
from gateway.ledger import ClosedEntry, InMemoryLedger, Ledger
from gateway.metrics import GatewayMetrics, GaugeReadings
from gateway.pace import BackendPace
from gateway.proxy import upstream_headers
from gateway.request_id import REQUEST_ID_HEADER
from gateway.routing import PrefixIndex
from gateway.settings import BackendSpec, Settings
from gateway.shared_view import SharedLedger
from gateway.upstream import Upstream, UpstreamRequest

log = logging.getLogger(__name__)

# How often /v1/models is read again once known (a restarted vLLM may serve another limit).
DISCOVERY_REFRESH_S = 30.0
# Prompt blocks remembered per backend before its pool size is known.
PREFIX_INDEX_INITIAL_BLOCKS = 4096
_REQUEST_ID_HEADER = REQUEST_ID_HEADER.encode("latin-1")


def capacity_config(settings: Settings) -> CapacityConfig:
    return CapacityConfig(
        stale_after_s=settings.metrics_stale_after_s,
        scrape_interval_s=settings.metrics_poll_interval_s,
        scrape_timeout_s=settings.metrics_timeout_s,
        settle_s=settings.settle_s,
        unknown_is_saturated=settings.unknown_budget == "saturated",
        down_after_failures=settings.backend_down_after_failures,
        max_fraction=settings.budget_max_fraction,
        decrease_factor=settings.aimd_decrease_factor,
        overcommit=settings.budget_overcommit,
    )


class Backend:
    def __init__(
        self,
        spec: BackendSpec,
        settings: Settings,
        *,
        client: httpx.AsyncClient,
        upstream: Upstream,
        clock: Callable[[], float],
        metrics: GatewayMetrics,
        has_waiters: Callable[[], bool],
        on_discovered: Callable[[Backend, BackendInfo], Awaitable[None]],
        on_scrape: Callable[[Backend, Reconciliation | None], None],
        ledger: Ledger | None = None,
        standing: Callable[[], Standing] | None = None,
        scrape_share: ScrapeTurns | None = None,
    ) -> None:
        self.name = spec.name
        self.url = spec.url
        self.settings = settings
        self.clock = clock
        self.client = client  # discovery, /metrics, /v1/models
        self.upstream = upstream  # the generation requests
        self.metrics = metrics
        self.ledger: Ledger = ledger if ledger is not None else InMemoryLedger()
        self.budget = KvBudget(capacity_config(settings), self.ledger, standing)
        self.pace = BackendPace(self.ledger, has_waiters, clock())
        self.prefixes = PrefixIndex(PREFIX_INDEX_INITIAL_BLOCKS)
        self.info: BackendInfo | None = None
        self._on_discovered = on_discovered
        self._on_scrape = on_scrape
        # Set once the first discovery attempt and the first scrape have each ended, either way.
        self._first_discovery = asyncio.Event()
        self._first_scrape = asyncio.Event()
        self.headers: dict[str, str] = {}
        self._authorization: bytes | None = None
        if settings.backend_api_key is not None:
            self.headers["authorization"] = f"Bearer {settings.backend_api_key.get_secret_value()}"
            self._authorization = self.headers["authorization"].encode("latin-1")
        self.poller = MetricsPoller(
            client=client,
            url=f"{spec.url}/metrics",
            budget=self.budget,
            clock=clock,
            interval_s=settings.metrics_poll_interval_s,
            timeout_s=settings.metrics_timeout_s,
            on_update=self._scraped,
            headers=self.headers,
            waiting=has_waiters,
            share=scrape_share,
        )
        self._tasks: list[asyncio.Task[None]] = []
        # The `dns+` entry it was found by (None: named in the settings), and whether that
        # name no longer resolves to it: then it gets nothing new and stops once idle.
        self.resolved_from: str | None = None
        self.retired = False
        self.chosen_at = 0.0  # when a request was last admitted onto it

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._discover_forever(), name=f"kvgate-discovery-{self.name}"),
            asyncio.create_task(self.poller.run(), name=f"kvgate-metrics-{self.name}"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.upstream.aclose()

    def reconfigure(self, settings: Settings) -> None:
        self.settings = settings
        self.budget.reconfigure(capacity_config(settings))
        self.poller.reconfigure(
            interval_s=settings.metrics_poll_interval_s, timeout_s=settings.metrics_timeout_s
        )
        if self.poller.share is not None:
            self.poller.share.reconfigure(
                interval_s=settings.metrics_poll_interval_s,
                timeout_s=settings.metrics_timeout_s,
                stale_after_s=settings.metrics_stale_after_s,
            )

    async def discover(self) -> BackendInfo:
        """Read /v1/models once. The router loads the tokenizers and model configs its models
        need before the backend says it serves them (`info`): none is routed there before
        its requests can be counted and sized."""
        info = await fetch_models(
            self.client, self.url, timeout_s=self.settings.discovery_timeout_s, headers=self.headers
        )
        await self._on_discovered(self, info)
        self.info = info
        return info

    async def looked_at(self) -> None:
        """Return once the first discovery attempt and the first scrape have each ended, whether
        they reached the backend or not."""
        await self._first_discovery.wait()
        await self._first_scrape.wait()

    async def _discover_forever(self) -> None:
        while True:
            pause = DISCOVERY_REFRESH_S
            try:
                await self.discover()
            except DiscoveryError as exc:
                log.warning("backend %s: %s", self.name, exc)
                pause = self.settings.discovery_retry_s
            finally:
                self._first_discovery.set()
            await asyncio.sleep(pause)

    def _scraped(self, reconciliation: Reconciliation | None) -> None:
        self._first_scrape.set()
        if reconciliation is None:
            self.metrics.scrape_failures.labels(self.name).inc()
        else:
            self.metrics.readings.labels(self.name, self.poller.last_source).inc()
            if reconciliation.preemptions > 0:
                self.metrics.preemptions.labels(self.name).inc(reconciliation.preemptions)
        snapshot = self.budget.snapshot(self.clock())
        if snapshot.total_blocks > 0:
            # vLLM's cache holds at most its pool: remembering more would predict hits it evicted.
            self.prefixes.resize(snapshot.total_blocks)
        self._on_scrape(self, reconciliation)

    # -- what it serves and how it stands -------------------------------------------------

    def block_size(self) -> int | None:
        reading = self.budget.reading
        return reading.block_size if reading is not None else None

    def serves(self, model: str) -> bool:
        return not self.retired and self.info is not None and self.info.find(model) is not None

    def snapshot(self) -> BudgetSnapshot:
        return self.budget.snapshot(self.clock())

    def target(self, now: float) -> Target:
        # Every request admitted onto it holds one connection until it ends.
        connections = self.settings.max_connections - self.ledger.totals().entries
        return Target(
            self.name, self.budget.snapshot(now), self.pace.capacity_rate(now), connections, self.chosen_at
        )

    @property
    def up(self) -> bool:
        """Whether it may be given new requests: its budget is not down."""
        return self.budget.snapshot(self.clock()).state is not BudgetState.DOWN

    def readiness(self) -> tuple[bool, str]:
        if self.info is None:
            return False, "backend models not discovered yet"
        snapshot = self.snapshot()
        # A stale budget that the scrape in flight may renew queues arrivals rather than refusing
        # them: the gateway serves, a moment late, so a load balancer should keep sending.
        return snapshot.known or snapshot.renewing, snapshot.detail

    def gauge_readings(self, queue_depth: Any) -> GaugeReadings:
        snapshot = self.snapshot()
        totals = self.ledger.totals()
        return GaugeReadings(
            backend=self.name,
            budget=snapshot,
            queue_depth=queue_depth,
            inflight_requests=totals.entries,
            reserved_blocks=totals.reserved_blocks,
            held_blocks=totals.held_blocks,
            backend_up=snapshot.state is BudgetState.FRESH,
        )

    # -- what the router tells it ---------------------------------------------------------

    def open(
        self, key: int, demand: Demand, now: float, *, streamed: bool, block_hashes: Sequence[int]
    ) -> None:
        self.chosen_at = now
        self.pace.admitting(now)
        self.ledger.open(key, demand, now, streamed=streamed)
        if block_hashes:
            self.prefixes.add(block_hashes)

    def close(self, key: int, now: float) -> ClosedEntry | None:
        closed = self.ledger.close(key)
        if closed is not None:
            self.pace.completed(closed.reserved_blocks, now, reached_blocks=closed.reached_blocks)
        return closed

    def failed(self, now: float) -> None:
        """A request to it failed as if it were gone: hold admissions until a scrape says otherwise."""
        self.budget.suspect(now)
        self.poller.poke()

    def request(
        self, request_headers: Iterable[tuple[bytes, bytes]], path: str, body: bytes, request_id: str
    ) -> UpstreamRequest:
        """The generation request as this backend gets it: the client's headers less hop-by-hop
        ones and credentials, the backend's own key, kvgate's request id (vLLM logs under it).
        Raises ValueError when a header cannot be forwarded."""
        headers = upstream_headers(request_headers, authorization=self._authorization)
        headers = [pair for pair in headers if pair[0] != _REQUEST_ID_HEADER]
        headers.append((_REQUEST_ID_HEADER, request_id.encode("latin-1")))
        return UpstreamRequest(b"POST", path.encode("latin-1"), headers, body)

    # -- /admin/state ---------------------------------------------------------------------

    def describe(self, inflight_source: Callable[[int], str | None]) -> dict[str, Any]:
        now = self.clock()
        snapshot = self.budget.snapshot(now)
        totals = self.ledger.totals()
        own = self.ledger.own_totals() if isinstance(self.ledger, SharedLedger) else totals
        reading = self.budget.reading
        pace = self.pace.describe(now)
        return {
            "name": self.name,
            "url": redact_url(self.url),
            "ready": self.readiness()[0],
            "budget": {
                "state": snapshot.state.value,
                "known": snapshot.known,
                "detail": snapshot.detail,
                "total_blocks": snapshot.total_blocks,
                "pool_limit_blocks": snapshot.pool_limit_blocks,
                "admissible_blocks": snapshot.admissible_blocks,
                "committed_blocks": snapshot.committed_blocks,
                "free_blocks": snapshot.free_blocks,
                "used_reported_blocks": round(snapshot.used_reported_blocks, 3),
                "external_blocks": snapshot.external_blocks,
                "aimd_fraction": round(snapshot.fraction, 4),
                "reservation_overstatement": round(self.budget.overstatement, 4),
                "preemptions_seen": self.budget.limit.preemptions_seen,
                "age_s": None if snapshot.age_s is None else round(snapshot.age_s, 3),
                "block_size": reading.block_size if reading else None,
                "running": reading.running if reading else None,
                "waiting": reading.waiting if reading else None,
            },
            "ledger": {
                "entries": totals.entries,
                # With a shared ledger: everyone's on the backend; own_*: this process's part.
                "reserved_blocks": totals.reserved_blocks,
                "own_reserved_blocks": own.reserved_blocks,
                "own_held_blocks": own.held_blocks,
                "held_blocks": totals.held_blocks,
                "credit_blocks": totals.credit_blocks,
                "requests": [
                    {
                        "key": entry.key,
                        "age_s": round(now - entry.admitted_at, 3),
                        "prompt_tokens": list(entry.demand.prompt_tokens),
                        "expected_output_tokens": entry.demand.expected_output_tokens,
                        # learned, backend, cold, floor or client (told in its header)
                        "expected_output_source": inflight_source(entry.key),
                        "output_tokens": list(entry.output_tokens),
                        "held_blocks": entry.held_blocks,
                        "reserved_blocks": entry.reserved_blocks,
                        "credit_blocks": entry.credit_blocks,
                    }
                    for entry in itertools.islice(self.ledger.entries(), 100)
                ],
            },
            "pace": {
                "drain_rate_blocks_per_s": pace["drain_rate_blocks_per_s"],
                # None until measured (the queue then predicts at the busy-time rate).
                "saturated_drain_rate_blocks_per_s": pace["saturated_drain_rate_blocks_per_s"],
            },
            "service_time": {
                "first_token_after_admit_s": pace["first_token_after_admit_s"],
                "seconds_per_output_token": pace["seconds_per_output_token"],
            },
            "metrics_readings": {
                **self.poller.readings,
                # With a shared ledger: whether this process reads the backend for all of them.
                "shared_scrape": self.poller.share.describe() if self.poller.share is not None else None,
            },
            "prefix_index_blocks": len(self.prefixes),
            "models": [
                {"id": m.id, "root": m.root, "max_model_len": m.max_model_len}
                for m in (self.info.models if self.info else ())
            ],
        }
