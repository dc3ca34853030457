"""The gateway's own Prometheus metrics (`kvgate_` prefix) on an app-owned registry.

Events (outcomes, admissions, waits, estimates, prediction errors, preemptions seen) are
counted as they happen. Levels (queue depth, KV blocks, backend health, staleness) are read
from the live objects when Prometheus scrapes, through `GaugeSource`, so the request path never
updates a gauge. Labels stay small and bounded: `backend` (configured names), `priority` (3),
`outcome` (see `gateway.outcomes.Outcome`), `code` (the codes of kvgate's 429 and 503 errors:
the policy's shedding reasons, `backend_unavailable`), `state` (see
`gateway.capacity.BudgetState`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admission import Priority
from gateway.capacity import BudgetSnapshot, BudgetState
from gateway.outcomes import Outcome

QUEUE_WAIT_BUCKETS_S = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
ERROR_BUCKETS_TOKENS = (-1024, -256, -64, -16, -4, 0, 4, 16, 64, 256, 1024)
WAIT_ERROR_BUCKETS_S = (-8.0, -4.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
FIRST_BYTE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class GaugeReadings:
    """Levels of one backend at scrape time."""

    backend: str
    budget: BudgetSnapshot
    queue_depth: Mapping[Priority, int]
    inflight_requests: int
    reserved_blocks: int
    held_blocks: int
    backend_up: bool
    plain_queue_wait_s: float | None = None


class GaugeSource(Protocol):
    def gauge_readings(self) -> Iterable[GaugeReadings]:
        """Current levels, one item per backend; called from the scrape, must not block."""
        ...


class _LevelCollector(Collector):
    def __init__(self, source: GaugeSource) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily(
            "kvgate_queue_depth", "Requests waiting in the gateway's queue", labels=["backend", "priority"]
        )
        inflight = GaugeMetricFamily(
            "kvgate_inflight_requests", "Admitted requests not yet complete", labels=["backend"]
        )
        total = GaugeMetricFamily(
            "kvgate_kv_blocks_total", "KV-cache blocks in the backend's pool", labels=["backend"]
        )
        used = GaugeMetricFamily(
            "kvgate_kv_blocks_used", "KV-cache blocks in use as the backend last reported", labels=["backend"]
        )
        reserved = GaugeMetricFamily(
            "kvgate_kv_blocks_reserved",
            "Blocks the gateway's ledger reserves for requests in flight",
            labels=["backend"],
        )
        held = GaugeMetricFamily(
            "kvgate_kv_blocks_held",
            "Blocks the ledger counts as held now (prompt + streamed tokens)",
            labels=["backend"],
        )
        committed = GaugeMetricFamily(
            "kvgate_kv_blocks_committed",
            "Projected peak blocks: reservations net of credit plus unexplained backend usage",
            labels=["backend"],
        )
        admissible = GaugeMetricFamily(
            "kvgate_kv_blocks_admissible",
            "Blocks the gateway may commit now (pool times the AIMD fraction)",
            labels=["backend"],
        )
        fraction = GaugeMetricFamily(
            "kvgate_budget_fraction", "AIMD admissible fraction of the pool", labels=["backend"]
        )
        up = GaugeMetricFamily(
            "kvgate_backend_up", "1 when the backend's metrics are fresh", labels=["backend"]
        )
        stale = GaugeMetricFamily(
            "kvgate_backend_metrics_stale",
            "1 when the budget is not known from a fresh scrape",
            labels=["backend"],
        )
        age = GaugeMetricFamily(
            "kvgate_backend_metrics_age_seconds", "Age of the last good metrics scrape", labels=["backend"]
        )
        plain_wait = GaugeMetricFamily(
            "kvgate_plain_queue_wait_seconds",
            "Wait an arrival would face in a plain queue that shed nothing (the offered load's "
            "backlog at the backend's saturated drain rate); NaN until a rate is known",
            labels=["backend"],
        )
        state = GaugeMetricFamily(
            "kvgate_budget_state",
            "Budget freshness state (1 for the current state)",
            labels=["backend", "state"],
        )
        for reading in self._source.gauge_readings():
            b = reading.backend
            budget = reading.budget
            for priority in Priority:
                depth.add_metric([b, priority.value], reading.queue_depth.get(priority, 0))
            inflight.add_metric([b], reading.inflight_requests)
            total.add_metric([b], budget.total_blocks)
            used.add_metric([b], budget.used_reported_blocks)
            reserved.add_metric([b], reading.reserved_blocks)
            held.add_metric([b], reading.held_blocks)
            committed.add_metric([b], budget.committed_blocks)
            admissible.add_metric([b], budget.admissible_blocks)
            fraction.add_metric([b], budget.fraction)
            up.add_metric([b], 1.0 if reading.backend_up else 0.0)
            stale.add_metric([b], 0.0 if budget.state is BudgetState.FRESH else 1.0)
            age.add_metric([b], budget.age_s if budget.age_s is not None else float("nan"))
            plain_wait.add_metric(
                [b], reading.plain_queue_wait_s if reading.plain_queue_wait_s is not None else float("nan")
            )
            for candidate in BudgetState:
                state.add_metric([b, candidate.value], 1.0 if candidate is budget.state else 0.0)
        return [
            depth,
            inflight,
            total,
            used,
            reserved,
            held,
            committed,
            admissible,
            fraction,
            up,
            stale,
            age,
            plain_wait,
            state,
        ]


_Child = TypeVar("_Child", Counter, Histogram)


class _Labelled(Generic[_Child]):
    """A labelled metric whose children are looked up once per label set. prometheus_client's
    own `labels()` takes a lock and rebuilds its key on every call, and several run on every
    request; label sets are few and bounded here, so the cache is too."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: _Child) -> None:
        self.metric: _Child = metric
        self._children: dict[tuple[str, ...], _Child] = {}

    def labels(self, *values: str) -> _Child:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class GatewayMetrics:
    """All kvgate_ metrics of one app, registered on `registry` (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = _Labelled(
            Counter("kvgate_requests", "Requests by final outcome", ["backend", "outcome"], registry=registry)
        )
        # Why requests were shed: the outcome shed_deadline alone covers both a deadline and a
        # first-token objective out of reach. `code` is the error's code, from a small closed set.
        self.shed = _Labelled(
            Counter(
                "kvgate_shed",
                "Requests shed with 429 or 503, by the code of the error sent",
                ["backend", "code"],
                registry=registry,
            )
        )
        self.admitted = _Labelled(
            Counter(
                "kvgate_admitted",
                "Requests admitted to a backend",
                ["backend", "priority"],
                registry=registry,
            )
        )
        self.queue_wait = _Labelled(
            Histogram(
                "kvgate_queue_wait_seconds",
                "Time from arrival to admission or shedding",
                ["backend", "priority"],
                buckets=QUEUE_WAIT_BUCKETS_S,
                registry=registry,
            )
        )
        self.queue_wait_prediction_error = _Labelled(
            Histogram(
                "kvgate_queue_wait_prediction_error_seconds",
                "Queue wait minus the wait predicted at arrival, per request that had to wait "
                "(for one shed or gone while queued, the least the prediction was short by)",
                ["backend"],
                buckets=WAIT_ERROR_BUCKETS_S,
                registry=registry,
            )
        )
        self.request_blocks = _Labelled(
            Histogram(
                "kvgate_request_estimated_blocks",
                "KV blocks reserved per admitted request (estimate)",
                ["backend"],
                buckets=BLOCK_BUCKETS,
                registry=registry,
            )
        )
        self.prediction_error = _Labelled(
            Histogram(
                "kvgate_output_prediction_error_tokens",
                "Completion tokens minus reserved tokens, per finished sequence",
                ["backend"],
                buckets=ERROR_BUCKETS_TOKENS,
                registry=registry,
            )
        )
        self.prediction_underruns = _Labelled(
            Counter(
                "kvgate_output_reservation_exceeded",
                "Finished sequences that outgrew their reserved output tokens",
                ["backend"],
                registry=registry,
            )
        )
        self.preemptions = _Labelled(
            Counter(
                "kvgate_backend_preemptions",
                "Preemptions the backend reported while kvgate watched",
                ["backend"],
                registry=registry,
            )
        )
        self.first_byte = _Labelled(
            Histogram(
                "kvgate_time_to_first_byte_seconds",
                "From arrival at the gateway to the first response byte from the backend",
                ["backend"],
                buckets=FIRST_BYTE_BUCKETS_S,
                registry=registry,
            )
        )
        self.scrape_failures = _Labelled(
            Counter(
                "kvgate_backend_scrape_failures",
                "Failed scrapes of the backend's /metrics",
                ["backend"],
                registry=registry,
            )
        )

    def watch(self, source: GaugeSource) -> Collector:
        """Expose `source`'s levels; returns the collector, to unregister on shutdown."""
        collector = _LevelCollector(source)
        self.registry.register(collector)
        return collector

    def outcome(self, backend: str, outcome: Outcome, code: str | None = None) -> None:
        """Count a request's final outcome, and for a shed one the code of its error."""
        self.requests.labels(backend, outcome.value).inc()
        if outcome.shed:
            self.shed.labels(backend, code or outcome.value).inc()
