"""The fleet's front: choose a backend, admit there, relay, fail over, conclude.

A request's path reads in one direction through the `Router`:

1. `prepare`: the request prepared once (`gateway.prepare`: body, hints, exact token count,
   prompt block hashes), then sized for the backends of its model;
2. `admit`: it enters its model's wait queue, one queue over every backend of the model. The
   queue's plan admits it onto whichever backend can take it first, choosing among those by
   prefix match and headroom (`gateway.routing.choose`), and books that backend's ledger
   synchronously (`Reservation.open`), so two admissions never spend the same free blocks;
3. `relay`: the ASGI response forwarding it to that backend. A connection that fails before
   any byte was sent is moved once to another backend of the model that has room now;
4. `finished`: called exactly once per reservation (`Reservation.finish`): closes the ledger
   entry, concludes the request (its one outcome: metrics, /admin/state, the request log) and
   learns from the answer (output lengths, the backend's pace, its reservation overstatement).

A single backend is the fleet of one: the same path, the same decisions as before there was a
fleet.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from starlette.types import Receive

from estimator.tokens import Route, TokenCounter
from gateway.admission import (
    RETRY_AFTER_DEFAULT_S,
    AdmissionPolicy,
    BlocksOn,
    Decision,
    DecisionKind,
    PolicyConfig,
    Reason,
)
from gateway.backend import Backend
from gateway.conclude import Concluder
from gateway.errors import ExceedsKvPoolError, GatewayError, ShedError, UnavailableError, UpstreamConnectError
from gateway.fleet import Fleet, Resolver
from gateway.metrics import GatewayMetrics, GaugeReadings
from gateway.models import ModelCatalog
from gateway.outcomes import CLIENT_CLOSED_STATUS, Outcome, outcome_of_refusal
from gateway.output_model import OutputLengthModel
from gateway.prepare import Prepared, RequestPreparer, Sizing, SizingKey
from gateway.proxy import RelayResponse, RelayTimeouts
from gateway.recent import RecentRequests, RequestSummary
from gateway.redis_store import RedisLedgerStore
from gateway.reservation import Reservation, SizedRequest, summary
from gateway.routing import Candidate, choose
from gateway.settings import BackendSpec, Settings
from gateway.upstream import Upstream, UpstreamRequest
from gateway.waitqueue import QueueEntry, WaitQueue

log = logging.getLogger(__name__)

# The blocks a backend is given for a request it cannot take at all (its vLLM would refuse it:
# another context limit or version): more than any pool, so no plan places it there.
NOT_HERE_BLOCKS = sys.maxsize


class ClientGoneError(Exception):
    """The client left while its request was queued."""


def relay_timeouts(settings: Settings) -> RelayTimeouts:
    return RelayTimeouts(
        settings.first_byte_timeout_s,
        settings.between_chunk_timeout_s,
        settings.client_write_timeout_s,
    )


def policy_config(settings: Settings) -> PolicyConfig:
    return PolicyConfig(
        max_queued=settings.queue_max(),
        hol_deadline_share=settings.hol_deadline_share,
        arrival_slack=settings.arrival_slack,
    )


class Router:
    """Admission control in front of a fleet of backends. Owned by the app's lifespan."""

    def __init__(
        self,
        settings: Settings,
        *,
        specs: Iterable[BackendSpec],
        client: httpx.AsyncClient,
        upstream_for: Callable[[BackendSpec], Upstream],
        clock: Callable[[], float],
        metrics: GatewayMetrics,
        executor: ThreadPoolExecutor,
        token_counter: TokenCounter | None = None,
        resolve: Resolver | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.client = client
        self.metrics = metrics
        self.catalog = ModelCatalog(settings, executor, token_counter)
        self.output_model = OutputLengthModel(
            quantile=settings.output_quantile, min_samples=settings.output_min_samples
        )
        self.preparer = RequestPreparer(settings, self.catalog, self.output_model, executor)
        self.policy = AdmissionPolicy(policy_config(settings))
        # With Redis, the budget is shared with every other kvgate process in front of the same
        # backends (gateway.redis_store); without, this process's ledger is the only one.
        self.shared = RedisLedgerStore(settings, metrics, clock=clock) if settings.redis_url else None
        self.fleet = Fleet(
            settings,
            specs=specs,
            client=client,
            upstream_for=upstream_for,
            clock=clock,
            metrics=metrics,
            catalog=self.catalog,
            output_model=self.output_model,
            policy=self.policy,
            resolve=resolve,
            shared=self.shared,
        )
        self.concluder = Concluder(
            fleet=self.fleet,
            metrics=metrics,
            output_model=self.output_model,
            recent=RecentRequests(settings.recent_requests),
            clock=clock,
        )
        self._timeouts = relay_timeouts(settings)
        self._keys = itertools.count(1)
        # Set by `begin_drain` (shutdown): nothing new is admitted from then on.
        self.draining = False

    # What tests and /admin/state read of the parts.
    @property
    def backends(self) -> list[Backend]:
        return self.fleet.backends

    @property
    def queues(self) -> dict[str, WaitQueue]:
        return self.fleet.queues

    @property
    def recent(self) -> RecentRequests:
        return self.concluder.recent

    @property
    def inflight(self) -> dict[int, Reservation]:
        return self.concluder.inflight

    def backend(self, name: str) -> Backend:
        return self.fleet.backend(name)

    async def resolve_once(self) -> None:
        await self.fleet.resolve_once()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self.shared is not None:
            await self.shared.start()
        await self.fleet.start()

    async def stop(self) -> None:
        await self.fleet.stop()
        for queue in self.fleet.queues.values():
            queue.close(Decision(DecisionKind.SHED, Reason.BACKEND_DOWN, RETRY_AFTER_DEFAULT_S))
        if self.shared is not None:
            await self.shared.stop()
        self.catalog.close()

    def begin_drain(self) -> int:
        """Stop admitting, for a shutdown: readiness turns false, everyone queued is answered 503
        with Retry-After at once, and so is every later arrival; requests in flight go on.
        Returns how many queued requests were answered."""
        self.draining = True
        closing = Decision(DecisionKind.SHED, Reason.SHUTTING_DOWN, RETRY_AFTER_DEFAULT_S)
        return sum(queue.close(closing) for queue in self.fleet.queues.values())

    def reconfigure(self, settings: Settings) -> None:
        """Run with `settings` from now on (a reload: only fields in RELOADABLE_SETTINGS differ,
        see `gateway.settings.reloaded`). Requests in flight keep what they were admitted with;
        queued ones keep their deadlines."""
        self.settings = settings
        self.preparer.settings = settings
        self.policy.config = policy_config(settings)
        self.output_model.quantile = settings.output_quantile
        self.fleet.reconfigure(settings)
        self._timeouts = relay_timeouts(settings)
        self.fleet.pump()  # limits may have grown (or shrunk): decide for everyone waiting again

    def _shutting_down(self) -> UnavailableError:
        return UnavailableError(
            "kvgate is shutting down; retry (another replica may take it)",
            retry_after_s=RETRY_AFTER_DEFAULT_S,
            code=Reason.SHUTTING_DOWN.value,
        )

    # -- state ----------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "shutting down"
        return self.fleet.readiness()

    def gauge_readings(self) -> list[GaugeReadings]:
        return self.fleet.gauge_readings()

    def describe(self) -> dict[str, Any]:
        """Everything /admin/state shows for the fleet: one entry per backend."""
        now = self.clock()
        output_model = {
            "quantile": self.output_model.quantile,
            "min_samples": self.output_model.min_samples,
            "keys": self.output_model.describe(),
            "backend_prior": (
                None
                if self.output_model.backend_prior is None
                else dict(zip(("tokens", "samples"), self.output_model.backend_prior, strict=True))
            ),
        }
        recent = self.recent.describe(now)
        backends = self.fleet.describe(self.concluder.output_source)
        for state in backends:  # shared by the fleet, shown with each backend as before
            state["output_model"] = output_model
            state["recent"] = recent
        described: dict[str, Any] = {"backends": backends, "models": self.catalog.names()}
        if self.shared is not None:
            described["shared_ledger"] = self.shared.describe()
        return described

    def conclude(self, request_summary: RequestSummary) -> None:
        self.concluder.conclude(request_summary)

    def refused_early(self, request_id: str, route: Route, error: GatewayError, arrived_at: float) -> None:
        self.concluder.refused_early(request_id, route, error, arrived_at)

    # -- the request path -----------------------------------------------------------------

    async def prepare(
        self,
        route: Route,
        body: Any,
        raw_body: bytes,
        headers: Mapping[str, str],
        arrived_at: float,
        request_id: str | None = None,
    ) -> SizedRequest:
        if self.draining:
            raise self._shutting_down()
        model = body.get("model") if isinstance(body, dict) else None
        prepared = await self.preparer.prepare(
            route,
            body,
            raw_body,
            headers,
            arrived_at,
            request_id,
            hash_block_size=self._hash_block_size(model if isinstance(model, str) else None),
        )
        return self._size(prepared)

    def _hash_block_size(self, model: str | None) -> int | None:
        profile = self.catalog.get(model) if model is not None else self.catalog.default()
        if profile is None:
            return None
        for backend in self.backends:
            if backend.serves(profile.id) and (size := backend.block_size()) is not None:
                return size
        return None

    def _size(self, prepared: Prepared) -> SizedRequest:
        profile = self.catalog.get(prepared.model)
        assert profile is not None
        keyed: dict[SizingKey, list[Backend]] = {}
        for backend in self.backends:
            reading = backend.budget.reading
            served = backend.info.find(prepared.model) if backend.info is not None else None
            if reading is None or served is None or backend.info is None:
                continue
            key = SizingKey(
                reading.block_size,
                backend.info.version,
                served.max_model_len or 1 << 30,
                reading.prefix_caching is True,
            )
            keyed.setdefault(key, []).append(backend)
        if not keyed:
            raise UnavailableError(
                "the backend's KV-cache budget is not known yet", retry_after_s=RETRY_AFTER_DEFAULT_S
            )
        sizings: dict[str, Sizing] = {}
        reference: Sizing | None = None
        refusal: GatewayError | None = None
        for key, backends in keyed.items():
            try:
                # Its deadline is netted of the service time of the first of these backends.
                sizing = self.preparer.size(prepared, profile, key, backends[0].pace.service_estimate)
            except GatewayError as exc:  # these backends' vLLM would refuse it; others may not
                refusal = refusal or exc
                continue
            reference = reference or sizing
            for backend in backends:
                sizings[backend.name] = sizing
        if reference is None:
            assert refusal is not None
            try:
                raise refusal
            finally:
                # Its traceback holds this frame: kept here, it would make a cycle that keeps
                # the request's body alive until the garbage collector runs.
                del refusal
        return SizedRequest(prepared, reference, sizings)

    async def admit(self, request: SizedRequest, receive: Receive | None) -> Reservation:
        """Wait for admission. Raises a GatewayError when shed or rejected, ClientGone when
        the client left while queued. The returned reservation is open in a backend's ledger."""
        if self.draining:  # began while this one was being prepared
            raise self._shed_while_closing(request)
        key = next(self._keys)
        reservation = Reservation(self.concluder, self.fleet.backend, key, request)
        reservation.queued_at = self.clock()
        queue = self.fleet.queue(request.prepared.model)
        entry = queue.enter(
            key, request.ask, reservation.open, self._blocks_on(request), self._prefix_on(request)
        )
        reservation.predicted_queue_s = entry.predicted_wait_s
        try:
            if not entry.done:
                await self._wait(entry, receive)
        except BaseException:
            # Cancelled, or the client left: withdraw, or complete what was just admitted.
            if not queue.leave(entry):
                reservation.finish(Outcome.CLIENT_GONE, None, self.clock())
            else:
                self.concluder.queue_exit(request, entry, Outcome.CLIENT_GONE, CLIENT_CLOSED_STATUS)
            raise
        decision = entry.future.result()
        if decision.kind is DecisionKind.ADMIT:
            return reservation
        raise self._refused(decision, request, entry)

    # The errors of the two methods below are raised where they are made, never kept in a
    # local of the frame that raises them: their tracebacks hold that frame, and the cycle
    # would keep the request's body alive until the garbage collector runs.

    def _shed_while_closing(self, request: SizedRequest) -> GatewayError:
        """The error that sheds `request` because the gateway is closing, concluded."""
        closing = self._shutting_down()
        self.conclude(
            summary(
                self.fleet.label(None),
                request,
                Outcome.SHED_UNAVAILABLE,
                closing.status,
                self.clock(),
                queue_s=0.0,
                code=closing.code,
            )
        )
        return closing

    def _refused(self, decision: Decision, request: SizedRequest, entry: QueueEntry) -> GatewayError:
        """The error that refuses `request` as the queue's `decision` says, its exit concluded."""
        refusal = self._refusal(decision, request)
        self.concluder.queue_exit(request, entry, outcome_of_refusal(decision), refusal.status, refusal.code)
        return refusal

    def _blocks_on(self, request: SizedRequest) -> BlocksOn | None:
        reference = request.reference.demand
        blocks: dict[str, tuple[int, int]] = {}
        for backend in self.backends:
            if not backend.serves(request.prepared.model):
                continue
            sizing = request.sizings.get(backend.name)
            if sizing is None:
                blocks[backend.name] = (NOT_HERE_BLOCKS, NOT_HERE_BLOCKS)
            elif sizing.demand is not reference:
                blocks[backend.name] = (sizing.demand.reserved_blocks, sizing.demand.max_blocks)
        return blocks or None

    def _prefix_on(self, request: SizedRequest) -> dict[str, int] | None:
        prepared = request.prepared
        # vLLM reads no cache for a request that wants its prompt's logprobs: no match counts.
        wants_prompt_logprobs = prepared.body.get("prompt_logprobs") is not None
        if len(self.backends) == 1 or not prepared.prompt.block_hashes or wants_prompt_logprobs:
            return None
        return {
            backend.name: backend.prefixes.match(prepared.prompt.block_hashes)
            for backend in self.backends
            if backend.block_size() == prepared.hash_block_size and backend.name in request.sizings
        }

    async def _wait(self, entry: QueueEntry, receive: Receive | None) -> None:
        if receive is None:
            await asyncio.shield(entry.future)
            return
        watcher: asyncio.Future[None] = asyncio.ensure_future(_wait_for_disconnect(receive))
        waiting: set[asyncio.Future[Any]] = {entry.future, watcher}
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not entry.future.done():
            raise ClientGoneError()

    def label_before_placing(self) -> str:
        return self.fleet.label(None)

    def _refusal(self, decision: Decision, request: SizedRequest) -> GatewayError:
        retry_s = decision.retry_after_s or RETRY_AFTER_DEFAULT_S
        reason = decision.reason
        model = request.prepared.model
        if reason is Reason.EXCEEDS_POOL:
            pools = [b.snapshot().pool_limit_blocks for b in self.backends if b.serves(model)]
            return ExceedsKvPoolError(
                f"this request may need {request.ask.max_blocks} KV-cache blocks but the backend's "
                f"whole pool holds {max(pools, default=0)}; lower max_tokens, n or the prompt",
                param="max_tokens",
            )
        if reason is Reason.SHUTTING_DOWN:
            return self._shutting_down()
        if reason in (Reason.BUDGET_UNKNOWN, Reason.BACKEND_DOWN):
            details = "; ".join(b.snapshot().detail for b in self.backends if b.serves(model))
            return UnavailableError(
                f"no KV-cache budget is known for the backend ({details})",
                retry_after_s=retry_s,
                code=reason.value,
            )
        messages = {
            Reason.QUEUE_FULL: f"the {request.ask.priority.value}-priority queue is full",
            Reason.DEADLINE_UNREACHABLE: "the request would not be admitted before its deadline",
            Reason.DEADLINE_EXPIRED: "the request's deadline passed while it was queued",
        }
        return ShedError(
            f"{messages.get(reason, 'the backend is saturated')}; retry after {retry_s:.2f} s",
            retry_after_s=retry_s,
            code=reason.value,
        )

    def relay(
        self, reservation: Reservation, request_headers: Iterable[tuple[bytes, bytes]], path: str
    ) -> RelayResponse:
        """The response that forwards an admitted request; `request_headers` are the client's
        raw ASGI header pairs. Raises ValueError when a header cannot be forwarded."""
        backend = reservation.backend
        assert backend is not None
        prepared = reservation.prepared
        headers = list(request_headers)
        request = backend.request(headers, path, prepared.raw_body, prepared.request_id)

        def reroute(error: UpstreamConnectError) -> tuple[Upstream, UpstreamRequest] | None:
            moved_to = self._reroute(reservation, error)
            if moved_to is None:
                return None
            return moved_to.upstream, moved_to.request(headers, path, prepared.raw_body, prepared.request_id)

        return RelayResponse(
            upstream=backend.upstream,
            request=request,
            observer=reservation,
            timeouts=self._timeouts,
            extra_headers={
                "x-kvgate-queue-ms": str(round(reservation.queue_seconds * 1000)),
                "x-kvgate-blocks": str(reservation.sizing.demand.reserved_blocks),
            },
            clock=self.clock,
            reroute=reroute,
        )

    def _reroute(self, reservation: Reservation, error: UpstreamConnectError) -> Backend | None:
        """Where a request whose connection failed before any byte was sent goes instead:
        another backend of its model with room for it now (once), else nowhere."""
        failed = reservation.backend
        if failed is None or reservation.moved:
            return None
        now = self.clock()
        failed.failed(now)
        log.warning("backend %s: %s; trying another backend", failed.name, error.message)
        request = reservation.request
        candidates: list[Candidate] = []
        reserve: dict[str, int] = {}
        for backend in self.backends:
            sizing = request.sizings.get(backend.name)
            if backend is failed or sizing is None or not backend.serves(reservation.prepared.model):
                continue
            snapshot = backend.budget.snapshot(now)
            if not snapshot.known or sizing.demand.max_blocks > snapshot.pool_limit_blocks:
                continue
            reserve[backend.name] = sizing.demand.reserved_blocks
            candidates.append(
                Candidate(
                    backend.name,
                    free_blocks=snapshot.free_blocks,
                    admissible_blocks=snapshot.admissible_blocks,
                    pool_blocks=snapshot.pool_limit_blocks,
                    committed_blocks=snapshot.committed_blocks,
                    prefix_blocks=0,
                )
            )
        chosen = choose(candidates, reserve)
        if chosen is None:
            return None
        target = self.fleet.backend(chosen)
        reservation.move(target, now)
        self.metrics.failovers.labels(failed.name).inc()
        self.fleet.pump(failed)
        return target

    # -- reservation events -----------------------------------------------------------------


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


__all__ = ["ClientGoneError", "Reservation", "Router"]
