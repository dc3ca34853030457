"""Step 4 of a request's path: its conclusion, counted once, and what kvgate learns from it.

`Concluder.conclude` is the one place a request's outcome is counted (metrics, the recent
requests of /admin/state, the request log), whatever the path ended it: refused before it was
prepared, shed from the queue, or finished after its relay. A reservation reports here when it
is admitted, at its first byte and when it ends (`finished`, exactly once): the backend's
ledger entry closes, a backend that failed or said it is saturated is held until its next
scrape, and a completed answer teaches the output-length model, the prediction metrics, the
backend's reservation overstatement and its measured pace. Then the queues of that backend's
models are pumped: the blocks it freed may admit someone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from estimator.tokens import Route
from gateway.backend import Backend
from gateway.errors import GatewayError
from gateway.fleet import Fleet
from gateway.logs import REQUEST_LOGGER, log_request
from gateway.metrics import GatewayMetrics
from gateway.outcomes import Outcome
from gateway.output_model import OutputLengthModel, PredictionSource
from gateway.proxy import RelayResult
from gateway.recent import RecentRequests, RequestSummary
from gateway.reservation import Reservation, SizedRequest, finished_summary, summary
from gateway.waitqueue import QueueEntry

# A backend answering these itself is saturated until its next scrape.
BACKEND_SATURATED_STATUSES = frozenset({429, 503})


class Concluder:
    def __init__(
        self,
        *,
        fleet: Fleet,
        metrics: GatewayMetrics,
        output_model: OutputLengthModel,
        recent: RecentRequests,
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self.metrics = metrics
        self.output_model = output_model
        self.recent = recent
        self.clock = clock
        self._request_log = logging.getLogger(REQUEST_LOGGER)
        self.inflight: dict[int, Reservation] = {}

    def output_source(self, key: int) -> str | None:
        """Where the reservation of the request in flight under `key` came from."""
        reservation = self.inflight.get(key)
        return reservation.sizing.prediction.source.value if reservation is not None else None

    def queue_exit(
        self, request: SizedRequest, entry: QueueEntry, outcome: Outcome, status: int, code: str | None = None
    ) -> None:
        now = self.clock()
        waited = max(0.0, (entry.resolved_at or now) - entry.entered_at)
        label = self._fleet.label(None)
        self.metrics.queue_wait.labels(label, request.ask.priority.value).observe(waited)
        # Shed or gone after waiting: it would have waited longer still, so this is the least
        # the prediction was short by.
        self._observe_wait_prediction(label, entry.predicted_wait_s, waited)
        self.conclude(
            summary(
                label,
                request,
                outcome,
                status,
                now,
                queue_s=waited,
                predicted_queue_s=entry.predicted_wait_s,
                code=code,
            )
        )

    def _observe_wait_prediction(self, label: str, predicted_s: float | None, waited_s: float) -> None:
        if predicted_s is not None:
            self.metrics.queue_wait_prediction_error.labels(label).observe(waited_s - predicted_s)

    def conclude(self, request_summary: RequestSummary) -> None:
        """Record a request's final outcome: the one place it is counted, kept for
        /admin/state and logged. Called exactly once per request."""
        self.metrics.outcome(request_summary.backend, request_summary.outcome, request_summary.code)
        self.recent.add(request_summary)
        log_request(self._request_log, request_summary)

    def refused_early(self, request_id: str, route: Route, error: GatewayError, arrived_at: float) -> None:
        """Conclude a request refused before it was prepared (invalid, or no backend yet)."""
        outcome = Outcome.REJECTED_INVALID if error.status < 500 else Outcome.SHED_UNAVAILABLE
        self.conclude(
            RequestSummary(
                request_id,
                self._fleet.label(None),
                route.value,
                outcome,
                error.status,
                arrived_at,
                self.clock(),
                code=error.code,
            )
        )

    def admitted(self, reservation: Reservation) -> None:
        assert reservation.admitted_at is not None
        label = reservation.backend_name
        priority = reservation.sizing.ask.priority.value
        self.inflight[reservation.key] = reservation
        self.metrics.admitted.labels(label, priority).inc()
        self.metrics.request_blocks.labels(label).observe(reservation.sizing.demand.reserved_blocks)
        waited = reservation.queue_seconds
        self.metrics.queue_wait.labels(label, priority).observe(max(0.0, waited))
        self._observe_wait_prediction(label, reservation.predicted_queue_s, waited)

    def first_byte(self, reservation: Reservation, now: float) -> None:
        arrived = reservation.prepared.arrived_at
        self.metrics.first_byte.labels(reservation.backend_name).observe(max(0.0, now - arrived))

    def finished(
        self, reservation: Reservation, outcome: Outcome, result: RelayResult | None, now: float
    ) -> None:
        self.inflight.pop(reservation.key, None)
        backend = reservation.backend
        closed = backend.close(reservation.key, now) if backend is not None else None
        self.conclude(finished_summary(reservation, outcome, result, closed, now))
        if backend is not None and result is not None and result.backend_failed:
            # The backend may be gone: hold admissions until a new scrape says otherwise.
            backend.failed(now)
        elif backend is not None and result is not None and result.status in BACKEND_SATURATED_STATUSES:
            # vLLM refused it for its own limits (--max-num-queued-reqs): saturated for a moment.
            backend.failed(now)
        if backend is not None and outcome is Outcome.COMPLETED and result is not None:
            self._learn(reservation, backend, result, closed.output_tokens if closed else (), now)
        self._fleet.pump(backend)

    def _learn(
        self,
        reservation: Reservation,
        backend: Backend,
        result: RelayResult,
        streamed: tuple[int, ...],
        now: float,
    ) -> None:
        prepared = reservation.prepared
        sizing = reservation.sizing
        demand = sizing.demand
        sequences = demand.sequences
        if result.usage is not None and result.usage.completion_tokens is not None:
            per_sequence = [round(result.usage.completion_tokens / sequences)] * sequences
        elif result.streamed and result.counts_trusted:
            per_sequence = [result.tokens_by_choice.get(i, 0) for i in range(sequences)]
        else:
            return
        # No sequence runs past its cap: a count beyond it (a backend's context is longer than
        # kvgate's estimate of what fits) is learned as the cap.
        per_sequence = [min(tokens, demand.max_output_tokens) for tokens in per_sequence]
        expected = demand.expected_output_tokens
        # Answers whose length the client told are learned too: the header set only their
        # reservation (vLLM never sees it), so they are true samples of this traffic, and a
        # client that stops telling, or one beside it that never does, finds the model warm.
        told = sizing.prediction.tokens if sizing.prediction.source is PredictionSource.CLIENT else None
        for tokens in per_sequence:
            self.output_model.observe(prepared.output_key, tokens)
            if told is not None:
                self.output_model.observe_told(prepared.output_key, told, tokens)
            self.metrics.prediction_error.labels(backend.name).observe(tokens - expected)
            if tokens > expected:
                self.metrics.prediction_underruns.labels(backend.name).inc()
        longest = max(per_sequence, default=0)
        backend.budget.observe_completion(demand.reserved_blocks, demand.blocks_at(longest))
        admitted_at = reservation.admitted_at
        if admitted_at is None or result.first_byte_at is None:
            return
        # The backend's pace from the relay's timings, less the time the relay spent blocked
        # writing to the client, which is the client's (see BackendPace.observe_stream).
        if not result.streamed:
            # vLLM writes a plain answer once it is generated: its first byte marks the end of
            # the backend's work, and the rest is transfer, paced by the client.
            backend.pace.observe_whole(admitted_at, result.first_byte_at, longest)
        else:
            backend.pace.observe_stream(
                admitted_at,
                result.first_byte_at,
                now,
                longest,
                wait_before_first_byte_s=result.client_wait_before_first_byte_s,
                wait_after_first_byte_s=result.client_wait_s - result.client_wait_before_first_byte_s,
            )
