"""One backend's admission machinery and the path of a request through it.

`BackendGateway` wires the parts together: the ledger (open loop), the budget with its poller
(closed loop), the output-length model, the backend's measured pace (`gateway.pace`), the
policy and its wait queue, the token counter and the forwarder. The HTTP layer calls three
steps per generation request:

1. `prepare`: validate the body and headers, count prompt tokens in the thread pool, build the
   request's `Demand` and its `Ask` (blocks, priority, queue deadline);
2. `admit`: enter the wait queue and wait (watching for the client leaving) until admitted,
   shed or rejected; admission books the ledger synchronously;
3. `relay`: the ASGI response that forwards it; its `finally` completes the reservation.

Every reservation is completed exactly once (`Reservation.finish`), whatever the path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import httpx
from starlette.types import Receive

from estimator.demand import (
    BlockCost,
    ContextLengthError,
    Demand,
    ServingRules,
    demand_of,
    output_limits,
)
from estimator.kv import ConfigError, ModelShape, kv_cache_layout
from estimator.tokens import ChatTemplateError, PromptCount, RequestBodyError, Route, TokenCounter
from gateway.admission import (
    AdmissionPolicy,
    Ask,
    Decision,
    DecisionKind,
    PolicyConfig,
    Priority,
    Reason,
    RetryAdvice,
)
from gateway.backend import (
    BackendInfo,
    DiscoveryError,
    fetch_models,
    load_model_shape,
    load_token_counter,
    tokenizer_candidates,
)
from gateway.budget import MetricsPoller
from gateway.capacity import BudgetSnapshot, BudgetState, CapacityConfig, KvBudget, Reconciliation
from gateway.client_hints import HintError, parse_hints, queue_deadlines
from gateway.credentials import redact_url
from gateway.errors import (
    ContextTooLongError,
    ExceedsKvPoolError,
    GatewayError,
    InvalidRequestError,
    ModelNotFoundError,
    ShedError,
    UnavailableError,
)
from gateway.ledger import ClosedEntry, InMemoryLedger, Ledger
from gateway.logs import REQUEST_LOGGER, log_request
from gateway.metrics import GatewayMetrics, GaugeReadings
from gateway.outcomes import CLIENT_CLOSED_STATUS, Outcome, outcome_of_refusal
from gateway.output_model import OutputKey, OutputLengthModel, OutputPrediction, PredictionSource
from gateway.pace import BackendPace
from gateway.proxy import RelayResponse, RelayResult, RelayTimeouts, upstream_headers
from gateway.rates import WaitCalibration
from gateway.recent import RecentRequests, RequestSummary
from gateway.render_pool import RenderPoolError
from gateway.request_id import REQUEST_ID_HEADER, new_request_id
from gateway.settings import Settings
from gateway.upstream import Upstream, UpstreamRequest
from gateway.waitqueue import QueueEntry, WaitQueue

log = logging.getLogger(__name__)

# How often /v1/models is read again once known (a restarted vLLM may serve another limit).
DISCOVERY_REFRESH_S = 30.0
# The `code` in the request line of an answer whose token counts were unusable (not learned).
USAGE_INVALID_CODE = "backend_usage_invalid"
_REQUEST_ID_HEADER = REQUEST_ID_HEADER.encode("latin-1")


class ClientGoneError(Exception):
    """The client left while its request was queued."""


def capacity_config(settings: Settings) -> CapacityConfig:
    return CapacityConfig(
        stale_after_s=settings.metrics_stale_after_s,
        settle_s=settings.settle_s,
        unknown_is_saturated=settings.unknown_budget == "saturated",
        down_after_failures=settings.backend_down_after_failures,
        min_fraction=settings.budget_min_fraction,
        max_fraction=settings.budget_max_fraction,
        initial_fraction=settings.budget_initial_fraction,
        decrease_factor=settings.aimd_decrease_factor,
        increase_per_s=settings.aimd_increase_per_s,
        quiet_s=settings.aimd_quiet_s,
        decrease_cooldown_s=settings.aimd_decrease_cooldown_s,
        overcommit=settings.budget_overcommit,
        overcommit_room=settings.budget_overcommit_room,
    )


def relay_timeouts(settings: Settings) -> RelayTimeouts:
    return RelayTimeouts(
        settings.first_byte_timeout_s,
        settings.between_chunk_timeout_s,
        settings.client_write_timeout_s,
    )


def pooling_z(settings: Settings) -> float | None:
    """The normal quantile the ledger pools output lengths at, or None when pooling is off.
    At `output_quantile` 1 every request already reserves the longest length seen: there is
    nothing to pool."""
    if not settings.output_pooling or settings.output_quantile >= 1.0:
        return None
    return NormalDist().inv_cdf(settings.output_quantile)


def policy_config(settings: Settings) -> PolicyConfig:
    return PolicyConfig(
        max_queued=settings.queue_max(),
        max_bypass=settings.hol_max_bypass,
        hol_deadline_share=settings.hol_deadline_share,
        early_shed=settings.early_shed,
        retry=RetryAdvice(settings.retry_after_s, settings.retry_after_min_s, settings.retry_after_max_s),
        arrival_slack=settings.arrival_slack,
    )


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready for admission."""

    route: Route
    body: Mapping[str, Any]
    raw_body: bytes
    model: str | None
    streaming: bool
    prompt: PromptCount
    demand: Demand
    prediction: OutputPrediction
    output_key: OutputKey
    ask: Ask
    request_id: str


class Reservation:
    """An admitted request's claim on the ledger; also the relay's observer."""

    def __init__(self, gateway: BackendGateway, key: int, prepared: Prepared) -> None:
        self._gateway = gateway
        self.key = key
        self.prepared = prepared
        self.queued_at: float | None = None
        # What the queue predicted it would wait, when it had to wait (see QueueEntry).
        self.predicted_queue_s: float | None = None
        self.admitted_at: float | None = None
        self.first_byte_at: float | None = None
        self.finished = False

    @property
    def queue_seconds(self) -> float:
        """Time spent in the wait queue (0 until admitted)."""
        if self.admitted_at is None or self.queued_at is None:
            return 0.0
        return max(0.0, self.admitted_at - self.queued_at)

    # Called by the wait queue, synchronously, at the moment of admission.
    def open(self, now: float) -> None:
        gateway = self._gateway
        gateway.pace.admitting(now)
        # Pooling weighs the request by the lengths its reservation was learned from.
        prediction = self.prepared.prediction
        outlook = (
            gateway.output_model.distribution(prediction.key)
            if gateway.settings.output_pooling and prediction.key is not None
            else None
        )
        gateway.ledger.open(self.key, self.prepared.demand, now, outlook)
        self.admitted_at = now
        gateway._on_admitted(self)

    def on_first_byte(self, now: float) -> None:
        self.first_byte_at = now
        self._gateway._on_first_byte(self, now)

    def on_tokens(self, choice: int, tokens: int) -> None:
        self._gateway.ledger.grow(self.key, choice, tokens)

    def on_finish(self, outcome: Outcome, result: RelayResult, now: float) -> None:
        problem = self._counts_problem(result)
        if problem is not None:
            # The answer went to the client as it was; only the gateway's learning refuses it.
            log.warning(
                "backend %s: unusable token counts in an answer (%s); not learned",
                self._gateway.name,
                problem,
            )
            result = dataclasses.replace(
                result,
                usage=None,
                tokens_by_choice={},
                counts_trusted=False,
                code=result.code or USAGE_INVALID_CODE,
            )
        self.finish(outcome, result, now)

    def _counts_problem(self, result: RelayResult) -> str | None:
        """What makes the token counts of a relayed answer unusable, or None. Every sequence of
        a request fits in the model's context: a count beyond that is no count (negative, bool,
        float and huge ones are caught by the parser, see `gateway.sse`)."""
        demand = self.prepared.demand
        info = self._gateway.info
        served = info.find(self.prepared.model) if info is not None and self.prepared.model else None
        context = served.max_model_len if served is not None else None
        usage = result.usage
        if usage is not None and usage.invalid is not None:
            return usage.invalid
        if context is None:
            return None
        prompts, sequences = len(demand.prompt_tokens), demand.sequences
        if usage is not None and (usage.prompt_tokens or 0) > prompts * context:
            return f"prompt_tokens {usage.prompt_tokens} for {prompts} prompt(s) of {context} at most"
        if usage is not None and (usage.completion_tokens or 0) > sequences * context:
            return f"completion_tokens {usage.completion_tokens} for {sequences} sequence(s) of {context} at most"
        if any(tokens > context for tokens in result.tokens_by_choice.values()):
            return f"a streamed choice counted over {context} tokens"
        return None

    def finish(self, outcome: Outcome, result: RelayResult | None, now: float) -> bool:
        """Complete the reservation; True only for the call that did it."""
        if self.finished:
            return False
        self.finished = True
        self._gateway._on_finished(self, outcome, result, now)
        return True


class BackendGateway:
    """Admission control in front of one backend. Owned by the app's lifespan."""

    def __init__(
        self,
        settings: Settings,
        *,
        client: httpx.AsyncClient,
        upstream: Upstream,
        clock: Callable[[], float],
        metrics: GatewayMetrics,
        executor: ThreadPoolExecutor,
        token_counter: TokenCounter | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.backend_name
        self.clock = clock
        self.client = client  # discovery, /metrics, /v1/models
        self.upstream = upstream  # the generation requests
        self.metrics = metrics
        self._executor = executor
        self.counter = token_counter
        self.counter_source = "injected" if token_counter is not None else None
        self.ledger: Ledger = (
            ledger
            if ledger is not None
            else InMemoryLedger(multiplex=settings.kv_multiplexing, pooling_z=pooling_z(settings))
        )
        self.budget = KvBudget(capacity_config(settings), self.ledger)
        self.output_model = OutputLengthModel(
            quantile=settings.output_quantile,
            min_samples=settings.output_min_samples,
            window=settings.output_window_samples,
        )
        self.pace = BackendPace(
            self.ledger,
            self._has_waiters,
            clock(),
            drain_rate_horizon_s=settings.drain_rate_horizon_s,
            overload_wait_share=settings.overload_wait_share,
            overload_arrival_horizon_s=settings.overload_arrival_horizon_s,
        )
        self.policy = AdmissionPolicy(policy_config(settings))
        self.queue = WaitQueue(
            policy=self.policy,
            budget=self.budget,
            drain_rate=self.pace.capacity_rate,
            clock=clock,
            strict_lookback_s=settings.objective_lookback_s,
            calibration=WaitCalibration() if settings.wait_calibration else None,
        )
        self.info: BackendInfo | None = None
        # The served model's config, read once at discovery (None: not found or not usable).
        self.model_shape: ModelShape | None = None
        self._shape_loaded = False
        self._block_costs: dict[int, BlockCost] = {}
        self._backend_headers: dict[str, str] = {}
        self._authorization: bytes | None = None
        if settings.backend_api_key is not None:
            self._backend_headers["authorization"] = f"Bearer {settings.backend_api_key.get_secret_value()}"
            self._authorization = self._backend_headers["authorization"].encode("latin-1")
        self.poller = MetricsPoller(
            client=client,
            url=f"{settings.backend_url}/metrics",
            budget=self.budget,
            clock=clock,
            interval_s=settings.metrics_poll_interval_s,
            timeout_s=settings.metrics_timeout_s,
            on_update=self._on_scrape,
            headers=self._backend_headers,
            waiting=self._has_waiters,
        )
        self._timeouts = relay_timeouts(settings)
        self._keys = itertools.count(1)
        self._pending_counts = 0
        self.recent = RecentRequests(settings.recent_requests)
        self._request_log = logging.getLogger(REQUEST_LOGGER)
        self._tasks: list[asyncio.Task[None]] = []
        self.inflight: dict[int, Reservation] = {}
        # Set by `begin_drain` (shutdown): nothing new is admitted from then on.
        self.draining = False

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
        self.queue.close(Decision(DecisionKind.SHED, Reason.BACKEND_DOWN, self.settings.retry_after_s))
        if self.counter is not None:
            self.counter.close()  # its template renderers, if it started any

    def begin_drain(self) -> int:
        """Stop admitting, for a shutdown: readiness turns false, everyone queued is answered 503
        with Retry-After at once, and so is every later arrival; requests in flight go on.
        Returns how many queued requests were answered."""
        self.draining = True
        return self.queue.close(
            Decision(DecisionKind.SHED, Reason.SHUTTING_DOWN, self.settings.retry_after_s)
        )

    def reconfigure(self, settings: Settings) -> None:
        """Run with `settings` from now on (a reload: only fields in RELOADABLE_SETTINGS differ,
        see `gateway.settings.reloaded`). Requests in flight keep what they were admitted with;
        queued ones keep their deadlines."""
        self.settings = settings
        self.policy.config = policy_config(settings)
        self.budget.reconfigure(capacity_config(settings))
        self.output_model.quantile = settings.output_quantile
        if isinstance(self.ledger, InMemoryLedger):
            self.ledger.pooling_z = pooling_z(settings)
        self.queue.strict_lookback_s = settings.objective_lookback_s
        self.pace.virtual_backlog.share = settings.overload_wait_share
        self.poller.reconfigure(
            interval_s=settings.metrics_poll_interval_s, timeout_s=settings.metrics_timeout_s
        )
        self._timeouts = relay_timeouts(settings)
        # Limits may have grown (or shrunk): decide for everyone waiting again.
        self.queue.pump()

    def _shutting_down(self) -> UnavailableError:
        return UnavailableError(
            "kvgate is shutting down; retry (another replica may take it)",
            retry_after_s=self.settings.retry_after_s,
            code=Reason.SHUTTING_DOWN.value,
        )

    async def discover(self) -> BackendInfo:
        """Read /v1/models once; load the tokenizer the first time."""
        info = await fetch_models(
            self.client,
            self.settings.backend_url,
            timeout_s=self.settings.discovery_timeout_s,
            headers=self._backend_headers,
        )
        self.info = info
        if self.counter is None:
            candidates = tokenizer_candidates(self.settings.tokenizer, self.settings.model, info)
            served = info.find(self.settings.model) if self.settings.model else None
            limit = (served or info.default).max_model_len
            loop_thread = threading.get_ident()
            counter, source = await asyncio.get_running_loop().run_in_executor(
                self._executor,
                lambda: load_token_counter(
                    candidates,
                    max_model_len=limit,
                    trust_request_chat_template=self.settings.trust_request_chat_template,
                    max_body_bytes=self.settings.max_body_bytes,
                    inline_thread=loop_thread,
                ),
            )
            if self.counter is None:
                self.counter, self.counter_source = counter, source
                log.info("backend %s: tokenizer from %s", self.name, source)
        if not self._shape_loaded:
            candidates = tokenizer_candidates(self.settings.tokenizer, self.settings.model, info)
            shape, config_source = await asyncio.get_running_loop().run_in_executor(
                self._executor, load_model_shape, candidates
            )
            self.model_shape, self._shape_loaded = shape, True
            log.info(
                "backend %s: KV groups from %s",
                self.name,
                config_source or "no config (plain paged attention)",
            )
        return info

    def _block_cost(self, block_size: int) -> BlockCost:
        """What a sequence holds in blocks of the backend's size: through the model's KV groups
        when its config is known (a hybrid model's request holds blocks in every group), else
        plain paged attention."""
        cost = self._block_costs.get(block_size)
        if cost is None:
            layout = None
            if self.model_shape is not None:
                try:
                    layout = kv_cache_layout(self.model_shape, block_size=block_size)
                except (ConfigError, ValueError) as exc:
                    log.warning("backend %s: KV groups unusable, counting plain blocks: %s", self.name, exc)
            cost = self._block_costs[block_size] = BlockCost(block_size, layout)
        return cost

    async def _discover_forever(self) -> None:
        while True:
            try:
                await self.discover()
            except DiscoveryError as exc:
                log.warning("backend %s: %s", self.name, exc)
                await asyncio.sleep(self.settings.discovery_retry_s)
                continue
            await asyncio.sleep(DISCOVERY_REFRESH_S)

    def _on_scrape(self, reconciliation: Reconciliation | None) -> None:
        if reconciliation is None:
            self.metrics.scrape_failures.labels(self.name).inc()
        else:
            if reconciliation.preemptions > 0:
                self.metrics.preemptions.labels(self.name).inc(reconciliation.preemptions)
            # What the backend's answers ran to: the reservation until kvgate has its own.
            reading = self.budget.reading
            buckets = reading.output_length_buckets if reading is not None else ()
            self.output_model.observe_backend(buckets if self.settings.output_backend_prior else ())
        self.queue.pump()

    # -- state ----------------------------------------------------------------------------

    def _has_waiters(self) -> bool:
        """Whether requests wait in the queue for this backend's blocks now."""
        return len(self.queue) > 0

    def snapshot(self) -> BudgetSnapshot:
        return self.budget.snapshot(self.clock())

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "shutting down"
        if self.info is None:
            return False, "backend models not discovered yet"
        if self.counter is None:
            return False, "tokenizer not loaded yet"
        snapshot = self.snapshot()
        if not snapshot.known:
            return False, snapshot.detail
        return True, snapshot.detail

    def gauge_readings(self) -> GaugeReadings:
        now = self.clock()
        snapshot = self.budget.snapshot(now)
        totals = self.ledger.totals()
        return GaugeReadings(
            backend=self.name,
            budget=snapshot,
            queue_depth=self.queue.depth(),
            inflight_requests=totals.entries,
            reserved_blocks=totals.reserved_blocks,
            held_blocks=totals.held_blocks,
            backend_up=snapshot.state is BudgetState.FRESH,
            plain_queue_wait_s=self.pace.plain_queue_wait(now),
        )

    def describe(self) -> dict[str, Any]:
        """Everything /admin/state shows for this backend."""
        now = self.clock()
        snapshot = self.budget.snapshot(now)
        totals = self.ledger.totals()
        reading = self.budget.reading
        pace = self.pace.describe(now)
        return {
            "name": self.name,
            "url": redact_url(self.settings.backend_url),
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
                "reserved_blocks": totals.reserved_blocks,
                "held_blocks": totals.held_blocks,
                "credit_blocks": totals.credit_blocks,
                "multiplex_blocks": totals.multiplex_blocks,
                "pooling_blocks": totals.pooling_blocks,
                "requests": [
                    {
                        "key": entry.key,
                        "age_s": round(now - entry.admitted_at, 3),
                        "prompt_tokens": list(entry.demand.prompt_tokens),
                        "expected_output_tokens": entry.demand.expected_output_tokens,
                        "output_tokens": list(entry.output_tokens),
                        "held_blocks": entry.held_blocks,
                        "reserved_blocks": entry.reserved_blocks,
                        "credit_blocks": entry.credit_blocks,
                    }
                    for entry in itertools.islice(self.ledger.entries(), 100)
                ],
            },
            "queue": {
                "depth": {p.value: n for p, n in self.queue.depth().items()},
                "queued_blocks": self.queue.queued_blocks(),
                "drain_rate_blocks_per_s": pace["drain_rate_blocks_per_s"],
                # None until measured (the queue then predicts at the busy-time rate).
                "saturated_drain_rate_blocks_per_s": pace["saturated_drain_rate_blocks_per_s"],
                "plain_queue_wait_s": pace["plain_queue_wait_s"],
                # None: waits are predicted in queue order, uncorrected.
                "wait_calibration": (
                    self.queue.calibration.factors() if self.queue.calibration is not None else None
                ),
                "stats": {
                    "admitted": self.queue.stats.admitted,
                    "shed": self.queue.stats.shed,
                    "left": self.queue.stats.left,
                },
            },
            "service_time": {
                "first_token_after_admit_s": pace["first_token_after_admit_s"],
                "seconds_per_output_token": pace["seconds_per_output_token"],
            },
            "models": [
                {"id": m.id, "root": m.root, "max_model_len": m.max_model_len}
                for m in (self.info.models if self.info else ())
            ],
            "tokenizer": self.counter_source,
            "output_model": {
                "quantile": self.output_model.quantile,
                "min_samples": self.output_model.min_samples,
                "keys": self.output_model.describe(),
                "backend_prior": (
                    None
                    if self.output_model.backend_prior is None
                    else dict(zip(("tokens", "samples"), self.output_model.backend_prior, strict=True))
                ),
            },
            "recent": self.recent.describe(now),
        }

    # -- the request path -----------------------------------------------------------------

    async def prepare(
        self,
        route: Route,
        body: Any,
        raw_body: bytes,
        headers: Mapping[str, str],
        arrived_at: float,
        request_id: str | None = None,
    ) -> Prepared:
        if self.draining:
            raise self._shutting_down()
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        info, counter = self.info, self.counter
        if info is None or counter is None:
            raise UnavailableError(
                "the backend has not been reached yet", retry_after_s=self.settings.retry_after_s
            )
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequestError("'model' must be a string", param="model")
        served = info.find(model) if model is not None else info.default
        if served is None:
            raise ModelNotFoundError(
                f"the model '{model}' does not exist; this backend serves: {', '.join(info.names())}",
                param="model",
            )
        streaming = body.get("stream", False)
        if streaming is None:
            streaming = False
        if not isinstance(streaming, bool):
            raise InvalidRequestError("'stream' must be a boolean", param="stream")
        try:
            hints = parse_hints(
                headers,
                streaming=streaming,
                priority_token=token.get_secret_value() if (token := self.settings.priority_token) else None,
                body_priority=body.get("priority"),
            )
        except HintError as exc:
            raise InvalidRequestError(exc.message, param=exc.header) from exc

        prompt = await self._count(counter, route, body, len(raw_body))
        reading = self.budget.reading
        if reading is None:
            raise UnavailableError(
                "the backend's KV-cache budget is not known yet", retry_after_s=self.settings.retry_after_s
            )
        rules = ServingRules.for_version(
            info.version,
            served.max_model_len or 1 << 30,
            prefix_caching=reading.prefix_caching is True,
        )
        try:
            limits = output_limits(route, body, prompt, rules)
            key = OutputKey(served.id, route.value)
            prediction = self.output_model.predict(key, limits.cap)
            if limits.floor > prediction.tokens:
                # The request itself guarantees more (min_tokens, ignore_eos): that is what
                # it reserves, deterministically (no learned outlook to pool it by).
                prediction = OutputPrediction(limits.floor, PredictionSource.FLOOR, prediction.samples, None)
            demand = demand_of(
                route,
                body,
                prompt,
                cost=self._block_cost(reading.block_size),
                rules=rules,
                expected_output_tokens=prediction.tokens,
                limits=limits,
            )
        except ContextLengthError as exc:
            raise ContextTooLongError(exc.message, param=exc.param) from exc
        except RequestBodyError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc

        timeout_s = self.settings.queue_timeout_s()[hints.priority]
        deadlines = queue_deadlines(
            arrived_at,
            hints,
            timeout_s,
            self.pace.service_estimate(demand.expected_output_tokens),
            margin=self.settings.service_time_margin,
        )
        ask = Ask(
            reserve_blocks=demand.reserved_blocks,
            max_blocks=demand.max_blocks,
            priority=hints.priority,
            arrived_at=arrived_at,
            deadline_at=deadlines.hard_at,
            objective_at=deadlines.objective_at,
        )
        return Prepared(
            route,
            body,
            raw_body,
            served.id,
            streaming,
            prompt,
            demand,
            prediction,
            key,
            ask,
            request_id if request_id is not None else new_request_id(),
        )

    async def _count(
        self, counter: TokenCounter, route: Route, body: Mapping[str, Any], body_bytes: int
    ) -> PromptCount:
        """Count the prompt: small bodies here (see DEFAULT_TOKENIZER_INLINE_MAX_BYTES), the
        rest in the tokenizer pool, so that the event loop is never held for long. The loop
        never waits for the pool: each thread counts with a tokenizer copy of its own. A body
        with a template of its own is refused here unless trusted, and then counted on the
        template sandbox's threads, which wait for its worker processes without holding a
        tokenizer thread."""
        try:
            sandbox = counter.screen(route, body)
        except RequestBodyError as exc:
            raise _body_error(exc) from exc
        if sandbox is None and body_bytes <= self.settings.tokenizer_inline_max_bytes:
            try:
                return counter.count(route, body)
            except RequestBodyError as exc:
                raise _body_error(exc) from exc
            except (UnicodeError, TypeError) as exc:
                raise _text_error(body) from exc
        if self._pending_counts >= self.settings.tokenizer_max_pending:
            raise UnavailableError(
                "the gateway's tokenizer is saturated", retry_after_s=self.settings.retry_after_s
            )
        self._pending_counts += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                sandbox.executor if sandbox is not None else self._executor, counter.count, route, body
            )
        except RequestBodyError as exc:
            raise _body_error(exc) from exc
        except RenderPoolError as exc:
            raise UnavailableError(
                "kvgate cannot render request chat templates right now",
                retry_after_s=self.settings.retry_after_s,
            ) from exc
        except (UnicodeError, TypeError) as exc:
            raise _text_error(body) from exc
        finally:
            self._pending_counts -= 1

    async def admit(self, prepared: Prepared, receive: Receive | None) -> Reservation:
        """Wait for admission. Raises a GatewayError when shed or rejected, ClientGone when
        the client left while queued. The returned reservation is open in the ledger."""
        if self.draining:  # began while this one was being prepared
            closing = self._shutting_down()
            self.conclude(
                _summary(
                    self.name,
                    prepared,
                    Outcome.SHED_UNAVAILABLE,
                    closing.status,
                    self.clock(),
                    queue_s=0.0,
                    code=closing.code,
                )
            )
            raise closing
        key = next(self._keys)
        reservation = Reservation(self, key, prepared)
        reservation.queued_at = now = self.clock()
        entry = self.queue.enter(
            key, prepared.ask, reservation.open, strict=self.pace.beyond_capacity(prepared.ask, now)
        )
        reservation.predicted_queue_s = entry.predicted_wait_s
        try:
            if not entry.done:
                await self._wait(entry, receive)
        except BaseException:
            # Cancelled, or the client left: withdraw, or complete what was just admitted.
            if not self.queue.leave(entry):
                reservation.finish(Outcome.CLIENT_GONE, None, self.clock())
            else:
                self._record_queue_exit(prepared, entry, Outcome.CLIENT_GONE, CLIENT_CLOSED_STATUS)
            raise
        decision = entry.future.result()
        if decision.kind is DecisionKind.ADMIT:
            return reservation
        refusal = self._refusal(decision, prepared)
        self._record_queue_exit(prepared, entry, outcome_of_refusal(decision), refusal.status, refusal.code)
        raise refusal

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

    def _record_queue_exit(
        self, prepared: Prepared, entry: QueueEntry, outcome: Outcome, status: int, code: str | None = None
    ) -> None:
        now = self.clock()
        waited = max(0.0, (entry.resolved_at or now) - entry.entered_at)
        self.metrics.queue_wait.labels(self.name, prepared.ask.priority.value).observe(waited)
        # Shed or gone after waiting: it would have waited longer still, so this is the least
        # the prediction was short by.
        self._observe_wait_prediction(entry.predicted_wait_s, waited)
        self.conclude(
            _summary(
                self.name,
                prepared,
                outcome,
                status,
                now,
                queue_s=waited,
                predicted_queue_s=entry.predicted_wait_s,
                code=code,
            )
        )

    def _observe_wait_prediction(self, predicted_s: float | None, waited_s: float) -> None:
        if predicted_s is not None:
            self.metrics.queue_wait_prediction_error.labels(self.name).observe(waited_s - predicted_s)

    def conclude(self, summary: RequestSummary) -> None:
        """Record a request's final outcome: the one place it is counted, kept for
        /admin/state and logged. Called exactly once per request."""
        self.metrics.outcome(self.name, summary.outcome, summary.code)
        self.recent.add(summary)
        log_request(self._request_log, summary)

    def refused_early(self, request_id: str, route: Route, error: GatewayError, arrived_at: float) -> None:
        """Conclude a request refused before it was prepared (invalid, or no backend yet)."""
        outcome = Outcome.REJECTED_INVALID if error.status < 500 else Outcome.SHED_UNAVAILABLE
        self.conclude(
            RequestSummary(
                request_id,
                self.name,
                route.value,
                outcome,
                error.status,
                arrived_at,
                self.clock(),
                code=error.code,
            )
        )

    def _refusal(self, decision: Decision, prepared: Prepared) -> GatewayError:
        retry_s = decision.retry_after_s or self.settings.retry_after_s
        reason = decision.reason
        if reason is Reason.EXCEEDS_POOL:
            pool = self.budget.snapshot(self.clock()).pool_limit_blocks
            return ExceedsKvPoolError(
                f"this request may need {prepared.ask.max_blocks} KV-cache blocks but the backend's "
                f"whole pool holds {pool}; lower max_tokens, n or the prompt",
                param="max_tokens",
            )
        if reason is Reason.SHUTTING_DOWN:
            return self._shutting_down()
        if reason in (Reason.BUDGET_UNKNOWN, Reason.BACKEND_DOWN):
            return UnavailableError(
                f"no KV-cache budget is known for the backend ({self.snapshot().detail})",
                retry_after_s=retry_s,
                code=reason.value,
            )
        messages = {
            Reason.QUEUE_FULL: f"the {prepared.ask.priority.value}-priority queue is full",
            Reason.DEADLINE_UNREACHABLE: "the request would not be admitted before its deadline",
            Reason.OBJECTIVE_UNREACHABLE: (
                "the backend is beyond capacity and the request would not get its first token "
                "within its objective (X-Kvgate-TTFT-Ms)"
            ),
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
        prepared = reservation.prepared
        headers = upstream_headers(request_headers, authorization=self._authorization)
        # vLLM logs under this id: the same one as kvgate's log line and response header.
        headers = [pair for pair in headers if pair[0] != _REQUEST_ID_HEADER]
        headers.append((_REQUEST_ID_HEADER, prepared.request_id.encode("latin-1")))
        request = UpstreamRequest(b"POST", path.encode("latin-1"), headers, prepared.raw_body)
        queued_s = reservation.queue_seconds
        return RelayResponse(
            upstream=self.upstream,
            request=request,
            observer=reservation,
            timeouts=self._timeouts,
            extra_headers={
                "x-kvgate-queue-ms": str(round(queued_s * 1000)),
                "x-kvgate-blocks": str(prepared.demand.reserved_blocks),
            },
            clock=self.clock,
        )

    # -- reservation events -----------------------------------------------------------------

    def _on_admitted(self, reservation: Reservation) -> None:
        prepared = reservation.prepared
        assert reservation.admitted_at is not None
        self.inflight[reservation.key] = reservation
        self.metrics.admitted.labels(self.name, prepared.ask.priority.value).inc()
        self.metrics.request_blocks.labels(self.name).observe(prepared.demand.reserved_blocks)
        waited = reservation.queue_seconds
        self.metrics.queue_wait.labels(self.name, prepared.ask.priority.value).observe(max(0.0, waited))
        self._observe_wait_prediction(reservation.predicted_queue_s, waited)

    def _on_first_byte(self, reservation: Reservation, now: float) -> None:
        arrived = reservation.prepared.ask.arrived_at
        self.metrics.first_byte.labels(self.name).observe(max(0.0, now - arrived))

    def _on_finished(
        self, reservation: Reservation, outcome: Outcome, result: RelayResult | None, now: float
    ) -> None:
        self.inflight.pop(reservation.key, None)
        closed = self.ledger.close(reservation.key)
        if closed is not None:
            self.pace.completed(closed.reserved_blocks, now)
        self.conclude(_finished_summary(self.name, reservation, outcome, result, closed, now))
        if result is not None and result.backend_failed:
            # The backend may be gone: hold admissions until a new scrape says otherwise.
            self.budget.suspect(now)
            self.poller.poke()
        if outcome is Outcome.COMPLETED and result is not None:
            self._learn(reservation, result, closed.output_tokens if closed else (), now)
        self.queue.pump()

    def _learn(
        self, reservation: Reservation, result: RelayResult, streamed: tuple[int, ...], now: float
    ) -> None:
        prepared = reservation.prepared
        demand = prepared.demand
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
        for tokens in per_sequence:
            self.output_model.observe(prepared.output_key, tokens)
            self.metrics.prediction_error.labels(self.name).observe(tokens - expected)
            if tokens > expected:
                self.metrics.prediction_underruns.labels(self.name).inc()
        longest = max(per_sequence, default=0)
        self.budget.observe_completion(demand.reserved_blocks, demand.blocks_at(longest))
        admitted_at = reservation.admitted_at
        if admitted_at is None or result.first_byte_at is None:
            return
        # The backend's pace from the relay's timings, less the time the relay spent blocked
        # writing to the client, which is the client's (see BackendPace.observe_stream).
        if not result.streamed:
            # vLLM writes a plain answer once it is generated: its first byte marks the end of
            # the backend's work, and the rest is transfer, paced by the client.
            self.pace.observe_whole(admitted_at, result.first_byte_at, longest)
        else:
            self.pace.observe_stream(
                admitted_at,
                result.first_byte_at,
                now,
                longest,
                wait_before_first_byte_s=result.client_wait_before_first_byte_s,
                wait_after_first_byte_s=result.client_wait_s - result.client_wait_before_first_byte_s,
            )


def _summary(
    backend: str,
    prepared: Prepared,
    outcome: Outcome,
    status: int | None,
    now: float,
    *,
    queue_s: float,
    predicted_queue_s: float | None = None,
    actual_blocks: int | None = None,
    completion_tokens: int | None = None,
    code: str | None = None,
) -> RequestSummary:
    return RequestSummary(
        request_id=prepared.request_id,
        backend=backend,
        route=prepared.route.value,
        outcome=outcome,
        status=status,
        code=code,
        arrived_at=prepared.ask.arrived_at,
        finished_at=now,
        queue_s=queue_s,
        predicted_queue_s=predicted_queue_s,
        priority=prepared.ask.priority.value,
        model=prepared.model,
        stream=prepared.streaming,
        estimated_blocks=prepared.demand.reserved_blocks,
        actual_blocks=actual_blocks,
        prompt_tokens=prepared.prompt.tokens,
        completion_tokens=completion_tokens,
    )


# The status a client was sent when the relay reported none (it never started).
_STATUS_WITHOUT_RELAY = {Outcome.CLIENT_GONE: CLIENT_CLOSED_STATUS, Outcome.REJECTED_INVALID: 400}


def _finished_summary(
    backend: str,
    reservation: Reservation,
    outcome: Outcome,
    result: RelayResult | None,
    closed: ClosedEntry | None,
    now: float,
) -> RequestSummary:
    """The summary of an admitted request. Output tokens come from the backend's usage when
    it sent one, else from the ledger's count of streamed tokens; actual blocks from the
    ledger's count for a stream (exact per sequence), else from usage spread evenly over the
    sequences."""
    demand = reservation.prepared.demand
    status = result.status if result is not None else None
    if status is None:
        status = _STATUS_WITHOUT_RELAY.get(outcome)
    trusted = result is None or result.counts_trusted
    streamed = closed.output_tokens if closed is not None and trusted else ()
    usage = result.usage.completion_tokens if result is not None and result.usage is not None else None
    completion = usage if usage is not None else (sum(streamed) if any(streamed) else None)
    actual = None
    if any(streamed) and closed is not None:
        actual = closed.held_blocks
    elif usage is not None:
        per_sequence = math.ceil(usage / demand.sequences)
        actual = demand.blocks_at(min(per_sequence, demand.max_output_tokens))
    return _summary(
        backend,
        reservation.prepared,
        outcome,
        status,
        now,
        queue_s=reservation.queue_seconds,
        predicted_queue_s=reservation.predicted_queue_s,
        actual_blocks=actual,
        completion_tokens=completion,
        code=result.code if result is not None else None,
    )


def _unencodable(value: Any, path: str) -> str | None:
    """The path of the first string in a parsed body that is not valid Unicode (JSON's \\u
    escapes can spell lone surrogates, which no tokenizer takes), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items: Iterable[tuple[str, Any]] = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        found = _unencodable(item, where)
        if found is not None:
            return found
    return None


def _body_error(exc: RequestBodyError) -> InvalidRequestError:
    code = exc.code if isinstance(exc, ChatTemplateError) else None
    return InvalidRequestError(exc.message, param=exc.param, code=code)


def _text_error(body: Mapping[str, Any]) -> Exception:
    """What a tokenizer's UnicodeError or TypeError means: text that is not valid Unicode (a
    client error), else a fault of kvgate's own, left to surface as one (500)."""
    where = _unencodable(body, "")
    if where is None:
        return RuntimeError("the token counter failed on a body it had accepted")
    return InvalidRequestError(
        f"'{where}' is not valid Unicode text (it holds a lone surrogate)", param=where
    )


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


__all__ = ["BackendGateway", "ClientGoneError", "Prepared", "Priority", "Reservation"]
