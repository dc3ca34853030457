"""The gateway's own Prometheus metrics (`kvgate_` prefix) on an app-owned registry.

Events (outcomes, admissions, waits, estimates, prediction errors, preemptions seen) are
counted as they happen. Levels (queue depth, KV blocks, backend health, staleness) are read
from the live objects when Prometheus scrapes, through `GaugeSource`, so the request path never
updates a gauge. Labels stay small and bounded: `backend` (configured names), `priority` (3),
`outcome` (see `gateway.outcomes.Outcome`), `code` (the codes of kvgate's 429 and 503 errors:
the policy's shedding reasons, `backend_unavailable`; see `SHED_CODES`), `state` (see
`gateway.capacity.BudgetState`).

Every event series of a backend whose label values are known in advance exists from
`add_backend` on, at 0: a panel or an alert over a counter that has not moved yet reads 0
rather than no data, and rate() over it starts from a known 0 instead of missing the first
increment (a series first seen at 1 has no earlier sample to differ from).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admission import Priority, Reason
from gateway.capacity import BudgetSnapshot, BudgetState
from gateway.errors import UnavailableError
from gateway.outcomes import Outcome

QUEUE_WAIT_BUCKETS_S = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
ERROR_BUCKETS_TOKENS = (-1024, -256, -64, -16, -4, 0, 4, 16, 64, 256, 1024)
WAIT_ERROR_BUCKETS_S = (-8.0, -4.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
FIRST_BYTE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# Around /healthz's 100 ms target: a lag of a few ms is the loop's ordinary work.
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Where a good reading of a backend's /metrics came from (kvgate_backend_readings).
READING_SOURCES = ("scraped", "shared")

# The codes a shed request's error carries, by outcome: the `code` values of kvgate_shed_total.
# The policy's refusals carry their Reason (gateway.router names the error after it); a 503
# raised before the policy is asked (no backend reached yet, no budget read yet, tokenizer
# saturated) carries UnavailableError's own code. tests/gateway/test_gw_metrics.py holds this
# to gateway.outcomes, so a new shedding reason cannot be left out.
SHED_CODES: Mapping[Outcome, tuple[str, ...]] = {
    Outcome.SHED_QUEUE_FULL: (Reason.QUEUE_FULL.value,),
    Outcome.SHED_DEADLINE: (Reason.DEADLINE_UNREACHABLE.value,),
    Outcome.SHED_TIMEOUT: (Reason.DEADLINE_EXPIRED.value,),
    Outcome.SHED_UNAVAILABLE: (
        Reason.BUDGET_UNKNOWN.value,
        Reason.BACKEND_DOWN.value,
        Reason.SHUTTING_DOWN.value,
        str(UnavailableError.default_code),
    ),
}


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

    def remove_backend(self, backend: str) -> None:
        """Forget every child whose first label value (`backend`) is `backend`."""
        for values in [values for values in self._children if values[0] == backend]:
            del self._children[values]
            self.metric.remove(*values)


class GatewayMetrics:
    """All kvgate_ metrics of one app, registered on `registry` (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = _Labelled(
            Counter("kvgate_requests", "Requests by final outcome", ["backend", "outcome"], registry=registry)
        )
        # Why requests were shed, finer than the outcome: `code` is the error's code, from a
        # small closed set.
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
        self.failovers = _Labelled(
            Counter(
                "kvgate_failovers",
                "Requests moved to another backend of their model after their connection failed "
                "before any byte was sent (labelled by the backend that failed)",
                ["backend"],
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

        self.readings = _Labelled(
            Counter(
                "kvgate_backend_readings",
                "Good readings of the backend's /metrics, by source: scraped by this process, or "
                "shared (taken from Redis, where the process holding the scrape lease published it)",
                ["backend", "source"],
                registry=registry,
            )
        )
        self.shared_refusals = _Labelled(
            Counter(
                "kvgate_shared_ledger_refusals",
                "Admissions the shared ledger (Redis) refused on the backend because other "
                "processes had booked its budget first (they return to the queue)",
                ["backend"],
                registry=registry,
            )
        )
        # The shared ledger's own series are the process's (one Redis for every backend).
        self.shared_round_trip = Histogram(
            "kvgate_shared_ledger_round_trip_seconds",
            "Time of one round trip to the shared ledger (Redis): a batch of bookings, releases and renewals",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0),
            registry=registry,
        )
        self.shared_reserve_admissions = _Labelled(
            Counter(
                "kvgate_shared_ledger_reserve_admissions",
                "Admissions answered from this process's standing reserve on the backend in the "
                "shared ledger (Redis), without a round trip first (see gateway.reserve)",
                ["backend"],
                registry=registry,
            )
        )
        self.shared_errors = Counter(
            "kvgate_shared_ledger_errors",
            "Round trips to the shared ledger (Redis) that failed (unreachable, timed out, refused)",
            registry=registry,
        )

        # One series for the process (not per backend): every backend shares the loop.
        self.event_loop_lag = Histogram(
            "kvgate_event_loop_lag_seconds",
            "How late the event loop ran a timer due every tick (see gateway.loop_lag): how "
            "long no request could be served",
            buckets=LOOP_LAG_BUCKETS_S,
            registry=registry,
        )

    def add_backend(self, name: str) -> None:
        """Export every event series of backend `name` whose labels are a known set at 0 (see
        the module's docstring): each outcome, each shed code, each priority. Idempotent; the
        levels come from `watch` and need nothing here."""
        for outcome in Outcome:
            self.requests.labels(name, outcome.value)
        for codes in SHED_CODES.values():
            for code in codes:
                self.shed.labels(name, code)
        for priority in Priority:
            self.admitted.labels(name, priority.value)
            self.queue_wait.labels(name, priority.value)
        for source in READING_SOURCES:
            self.readings.labels(name, source)
        for metric in self._per_backend():
            metric.labels(name)

    def remove_backend(self, name: str) -> None:
        """Drop every event series of backend `name` (one that left the fleet, e.g. an address
        a DNS name no longer resolves to), so that label sets stay bounded. Idempotent."""
        every: tuple[_Labelled[Any], ...] = (
            self.requests,
            self.shed,
            self.admitted,
            self.queue_wait,
            self.readings,
            *self._per_backend(),
        )
        for labelled in every:
            labelled.remove_backend(name)

    def _per_backend(self) -> tuple[_Labelled[Any], ...]:
        """The metrics labelled by `backend` alone."""
        return (
            self.queue_wait_prediction_error,
            self.request_blocks,
            self.prediction_error,
            self.prediction_underruns,
            self.preemptions,
            self.first_byte,
            self.scrape_failures,
            self.failovers,
            self.shared_refusals,
            self.shared_reserve_admissions,
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
