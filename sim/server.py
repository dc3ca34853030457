"""The emulator's async shell: an ASGI app that drives `sim.engine.Engine` in real time.

`create_sim_app(config)` returns the app. Its lifespan owns one `SimRuntime`: the engine, the
loop task that steps it (sleeping each step's modelled duration), the Prometheus registries,
the fault settings and the tokenizer thread pool. Nothing is global, so several emulators can
run in one process.

HTTP surface, shaped like vLLM 0.32's OpenAI server:
  POST /v1/completions, /v1/chat/completions   streaming (SSE) or not; `n`, several prompts
  GET  /v1/models (with max_model_len), /health, /metrics
  GET|POST|DELETE /sim/faults                  read, change (partial JSON), clear the faults
  POST /sim/restart                            a vLLM restart with a new pool, e.g. {"num_blocks": 40}
  GET  /sim/state                              the engine's counters (for tests and debugging)

Each generation request becomes one engine request per sequence. Its response object submits
them and, in a `finally`, aborts whatever is still unfinished, so a client that disconnects
frees its blocks at once, exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import random
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from enum import Enum
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute
from starlette.types import Receive, Scope, Send

from estimator.tokens import PromptCount, Route, TokenCounter
from sim.api import (
    ApiError,
    ChoiceResult,
    ChunkEncoder,
    GenerationRequest,
    check_model,
    count_prompts,
    full_response,
    parse_generation_request,
    token_text,
)
from sim.config import SimConfig
from sim.engine import Engine, EngineConfig, FinishReason, RequestSpec, TokenEvent
from sim.faults import Faults, MetricsMode
from sim.lengths import eos_position
from sim.metrics import VllmMetrics

logger = logging.getLogger(__name__)

# Where the outermost layer keeps the server's own `send`, whose owner holds the transport
# that the crash and reset faults cut.
RAW_SEND_KEY = "kvgate.sim.raw_send"
TOKENIZER_THREADS = 2
# How far the engine's nominal timeline may trail the clock and still catch up (sleep
# overshoot is about a millisecond); beyond it the emulator is overloaded and restarts the
# timeline at the present.
CATCH_UP_LIMIT_S = 0.05
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
# Text that no Prometheus parser accepts (an unterminated label set).
MALFORMED_METRICS = (
    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="sim" 3.0\n'
)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Signal(Enum):
    """Non-token items on a job's queue."""

    DISCONNECTED = "disconnected"  # the client went away
    RESTARTED = "restarted"  # the engine was replaced: in-flight requests die with it
    SHUTDOWN = "shutdown"  # the server is stopping


class SimulatedDropError(ConnectionError):
    """Raised in place of cutting the connection when no transport is reachable (in-process)."""


class Job:
    """The sequences of one HTTP request and the queue their tokens arrive on."""

    __slots__ = ("index_of", "live", "queue")

    def __init__(self, request_ids: list[str]) -> None:
        self.queue: asyncio.Queue[TokenEvent | Signal] = asyncio.Queue()
        self.index_of = {request_id: i for i, request_id in enumerate(request_ids)}
        # Sequences not yet finished: what `release` must abort.
        self.live = set(request_ids)


class SimRuntime:
    """Engine, loop, metrics and faults of one emulator instance. Lives on one event loop."""

    def __init__(self, config: SimConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config.validated()
        self.faults = config.faults
        self._clock = clock
        self.engine = Engine(config.engine)
        self.metrics = VllmMetrics(config.engine, config.model_name)
        self._jobs: dict[str, Job] = {}
        self._all_jobs: set[Job] = set()
        self._wake = asyncio.Event()
        self.closing = asyncio.Event()
        self._length_rng = random.Random(config.seed)
        self._fault_rng = random.Random(config.seed + 1)
        self._stale_metrics: bytes | None = None
        self._ids = itertools.count()
        self._counter = TokenCounter.approximate()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self.loop_error: BaseException | None = None
        # How well the loop keeps the model's timeline: steps run, how far it trailed the
        # clock while catching up, and how often it fell too far behind and reset.
        self.steps = 0
        self.max_lag_s = 0.0
        self.overruns = 0

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.tokenizer is not None:
            self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="sim-tok")
            loop = asyncio.get_running_loop()
            path = self.config.tokenizer
            max_len = self.config.engine.max_model_len
            self._counter = await loop.run_in_executor(
                self._executor, lambda: TokenCounter.from_pretrained(path, max_model_len=max_len)
            )
        self._task = asyncio.create_task(self._run(), name="sim-engine-loop")
        self._task.add_done_callback(self._loop_done)

    async def stop(self) -> None:
        self.begin_shutdown()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def begin_shutdown(self) -> None:
        """Let every open response end now (hung ones included); call on the runtime's loop."""
        self.closing.set()
        for job in list(self._all_jobs):
            job.queue.put_nowait(Signal.SHUTDOWN)

    def _loop_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.loop_error = task.exception()
            logger.error("emulator engine loop died", exc_info=self.loop_error)

    # -- the engine loop --------------------------------------------------------------------

    async def _run(self) -> None:
        # Steps run back to back on a nominal timeline: each starts when the previous one
        # ended (or now, after idling), so sleep overshoot does not accumulate into a slower
        # engine than the model describes.
        last_end = -math.inf
        while True:
            engine = self.engine
            now = self._clock()
            lag = now - last_end
            if lag < CATCH_UP_LIMIT_S:
                start = last_end
                self.max_lag_s = max(self.max_lag_s, lag)
            else:
                start = now
                if last_end > -math.inf:
                    self.overruns += 1  # busy, yet further behind than a sleep overshoot
            batch = engine.begin_step(start)
            if batch is None:
                self._wake.clear()
                await self._wake.wait()
                last_end = -math.inf
                continue
            end = start + batch.duration_s
            remaining = end - self._clock()
            # Even a zero-cost step yields, so that HTTP handlers run between steps.
            await asyncio.sleep(remaining if remaining > 0 else 0)
            if engine is not self.engine:
                continue  # restarted while the step ran: its output died with the old engine
            last_end = end
            self.steps += 1
            out = engine.end_step(batch, end)
            self.metrics.record_step(batch, out)
            jobs = self._jobs
            for event in out.tokens:
                job = jobs.get(event.request_id)
                if job is None:
                    continue
                job.queue.put_nowait(event)
                if event.finish_reason is not None:
                    del jobs[event.request_id]
                    job.live.discard(event.request_id)

    # -- jobs -------------------------------------------------------------------------------

    def open_job(self, request_ids: list[str]) -> Job:
        """A tracked job: it gets the restart and shutdown signals until `release`."""
        job = Job(request_ids)
        self._all_jobs.add(job)
        return job

    def submit(self, specs: list[RequestSpec]) -> Job:
        now = self._clock()
        job = self.open_job([spec.request_id for spec in specs])
        for spec in specs:
            self.engine.add(spec, now)
            self._jobs[spec.request_id] = job
        self._wake.set()
        return job

    def release(self, job: Job) -> None:
        """Abort the job's unfinished sequences and forget it. Idempotent."""
        for request_id in job.live:
            if self._jobs.get(request_id) is job:
                del self._jobs[request_id]
                self.engine.abort(request_id)
        job.live.clear()
        self._all_jobs.discard(job)
        self._wake.set()

    def restart(self, engine_config: EngineConfig) -> None:
        """Replace the engine and its metrics, as a vLLM restart would; open requests die."""
        problems = engine_config.errors()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = replace(self.config, engine=engine_config)
        self.engine = Engine(engine_config)
        self.metrics = VllmMetrics(engine_config, self.config.model_name)
        self._stale_metrics = None
        self._jobs = {}
        for job in list(self._all_jobs):
            job.live.clear()
            job.queue.put_nowait(Signal.RESTARTED)
        self._wake.set()

    def set_faults(self, faults: Faults) -> None:
        if faults.metrics_mode is MetricsMode.STALE and self.faults.metrics_mode is not MetricsMode.STALE:
            self._stale_metrics = self._render_metrics(faults)
        self.faults = faults

    # -- requests ---------------------------------------------------------------------------

    async def count(self, route: Route, body: Mapping[str, Any]) -> PromptCount:
        if self._executor is None:
            return count_prompts(self._counter, route, body)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, count_prompts, self._counter, route, body)

    def should_fail(self) -> bool:
        rate = self.faults.error_rate
        return rate > 0 and self._fault_rng.random() < rate

    def admission_error(self, request: GenerationRequest) -> ApiError | None:
        """vLLM 0.32's frontend queue limits (503), when configured."""
        limit = self.config.max_num_queued_reqs
        if limit is not None and self.engine.num_unfinished + request.num_sequences > limit:
            self.metrics.record_rejection("max_num_queued_reqs")
            return ApiError(
                503,
                "The engine is currently busy and cannot accept new requests. "
                "Please try again later or on a different instance.",
            )
        token_limit = self.config.max_num_queued_tokens
        if token_limit is not None and self.engine.snapshot().prefill_backlog_tokens >= token_limit:
            self.metrics.record_rejection("max_num_queued_tokens")
            return ApiError(
                503,
                "The engine has reached its prefill token backlog limit. "
                "Please try again later or on a different instance.",
            )
        return None

    def specs_for(self, request: GenerationRequest, response_id: str) -> list[RequestSpec]:
        specs: list[RequestSpec] = []
        for index in range(request.num_sequences):
            prompt = request.sequence_prompt(index)
            natural = self.config.output_len.draw(self._length_rng)
            specs.append(
                RequestSpec(
                    request_id=f"{response_id}-{index}",
                    prompt_tokens=request.prompt_tokens[prompt],
                    max_tokens=request.max_tokens[prompt],
                    eos_at=eos_position(
                        min_tokens=request.min_tokens,
                        ignore_eos=request.ignore_eos,
                        eos_bias=request.eos_bias,
                        natural_length=natural,
                        forced_length=request.forced_length,
                    ),
                    prompt_key=request.prompt_keys[prompt],
                )
            )
        return specs

    def new_response_id(self, route: Route) -> str:
        prefix = "chatcmpl" if route is Route.CHAT else "cmpl"
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._ids):x}"

    # -- metrics ----------------------------------------------------------------------------

    def _render_metrics(self, faults: Faults) -> bytes:
        return self.metrics.render(
            self.engine.snapshot(), include_cache_config=not faults.omit_cache_config_info
        )

    def metrics_text(self) -> bytes:
        if self.faults.metrics_mode is MetricsMode.STALE:
            if self._stale_metrics is None:
                self._stale_metrics = self._render_metrics(self.faults)
            return self._stale_metrics
        return self._render_metrics(self.faults)

    def state(self) -> dict[str, Any]:
        snapshot = self.engine.snapshot()
        return {
            **asdict(snapshot),
            "engine": {k: v for k, v in asdict(self.config.engine).items() if k != "step_cost"},
            "step_cost": asdict(self.config.engine.step_cost),
            "open_responses": len(self._all_jobs),
            "loop": {"steps": self.steps, "max_lag_s": self.max_lag_s, "overruns": self.overruns},
            "loop_alive": self.loop_error is None,
        }


# -- connection faults -----------------------------------------------------------------------


async def drop_connection(scope: Scope, *, reset: bool) -> None:
    """Cut the client's connection mid-response, as a crashed server would.

    With a real server (uvicorn) this closes the transport without finishing the response;
    `reset` sets SO_LINGER 0 first so the peer gets a TCP RST. In-process (no transport)
    it raises SimulatedDropError, which httpx's ASGI transport passes to the client.
    """
    raw_send = scope.get(RAW_SEND_KEY)
    transport = getattr(getattr(raw_send, "__self__", None), "transport", None)
    if transport is None:
        raise SimulatedDropError("the emulator dropped the connection")
    if reset:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    # One loop turn lets the server see the connection lost, so it does not report an
    # application that "returned without completing response".
    await asyncio.sleep(0)


async def _watch_disconnect(receive: Receive, job: Job) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.queue.put_nowait(Signal.DISCONNECTED)
            return


class JobResponse(Response):
    """Runs one generation request in the engine and streams or returns its result."""

    def __init__(
        self,
        runtime: SimRuntime,
        request: GenerationRequest,
        specs: list[RequestSpec],
        response_id: str,
    ) -> None:
        self._runtime = runtime
        self._request = request
        self._specs = specs
        self._response_id = response_id
        self._faults = runtime.faults
        self._model = runtime.config.model_name
        self._created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime = self._runtime
        job = runtime.submit(self._specs)
        watcher = asyncio.create_task(_watch_disconnect(receive, job))
        try:
            if self._request.stream:
                await self._stream(scope, send, job)
            else:
                await self._collect(scope, send, job)
        finally:
            watcher.cancel()
            runtime.release(job)

    def _drop_after(self) -> tuple[int | None, bool]:
        crash = self._faults.crash_after_tokens
        reset = self._faults.reset_after_tokens
        if reset is not None and (crash is None or reset <= crash):
            return reset, True
        return crash, False

    async def _stream(self, scope: Scope, send: Send, job: Job) -> None:
        request = self._request
        encoder = ChunkEncoder(request.route, self._response_id, self._created, self._model)
        drop_after, reset = self._drop_after()
        stall_after = self._faults.stall_after_tokens
        # Headers go out at once (as Starlette's StreamingResponse sends them); the first
        # bytes of the body come with the first token, as in vLLM, where even the chat
        # stream's opening role chunks wait for the engine's first output.
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if drop_after == 0:
            await drop_connection(scope, reset=reset)
            return
        if stall_after == 0:
            await self._stall(scope, job)
            return
        outputs = [0] * request.num_sequences
        unfinished = request.num_sequences
        sent = 0
        opened = request.route is not Route.CHAT
        while unfinished:
            items = [await job.queue.get()]
            # Coalesce whatever else is ready into one write.
            while not job.queue.empty():
                items.append(job.queue.get_nowait())
            frames: list[bytes] = []
            if not opened and not isinstance(items[0], Signal):
                frames.extend(encoder.role(i) for i in range(request.num_sequences))
                opened = True
            for item in items:
                if isinstance(item, Signal):
                    if item is Signal.DISCONNECTED:
                        return
                    if frames:
                        await send(
                            {"type": "http.response.body", "body": b"".join(frames), "more_body": True}
                        )
                    await drop_connection(scope, reset=False)
                    return
                index = job.index_of[item.request_id]
                outputs[index] = item.num_output
                reason = item.finish_reason
                text = token_text(item.num_output, reason is FinishReason.STOP)
                frames.append(encoder.token(index, text, None if reason is None else reason.value))
                sent += 1
                if reason is not None:
                    unfinished -= 1
                if drop_after is not None and sent >= drop_after:
                    await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
                    await drop_connection(scope, reset=reset)
                    return
                if stall_after is not None and sent >= stall_after:
                    await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
                    await self._stall(scope, job)
                    return
            await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
        tail = b""
        if request.include_usage:
            tail = encoder.usage(sum(request.prompt_tokens), sum(outputs))
        await send({"type": "http.response.body", "body": tail + ChunkEncoder.DONE, "more_body": False})
        self._runtime.metrics.record_completed_request(request.n, max(outputs))

    async def _stall(self, scope: Scope, job: Job) -> None:
        """Send nothing more (the `stall_after_tokens` fault): wait, ignoring whatever the
        engine still produces, until the client leaves or the server stops or restarts."""
        while True:
            item = await job.queue.get()
            if isinstance(item, Signal):
                if item is not Signal.DISCONNECTED:
                    await drop_connection(scope, reset=False)
                return

    async def _collect(self, scope: Scope, send: Send, job: Job) -> None:
        request = self._request
        drop_after, reset = self._drop_after()
        stall_after = self._faults.stall_after_tokens
        if stall_after == 0:
            await self._stall(scope, job)
            return
        outputs = [0] * request.num_sequences
        reasons: list[str | None] = [None] * request.num_sequences
        unfinished = request.num_sequences
        sent = 0
        while unfinished:
            item = await job.queue.get()
            if isinstance(item, Signal):
                if item is not Signal.DISCONNECTED:
                    await drop_connection(scope, reset=False)
                return
            index = job.index_of[item.request_id]
            outputs[index] = item.num_output
            sent += 1
            if item.finish_reason is not None:
                reasons[index] = item.finish_reason.value
                unfinished -= 1
            if drop_after is not None and sent >= drop_after:
                await drop_connection(scope, reset=reset)
                return
            if stall_after is not None and sent >= stall_after:
                await self._stall(scope, job)
                return
        choices = [
            ChoiceResult(
                index=i,
                text="".join(
                    token_text(k, reasons[i] == FinishReason.STOP and k == outputs[i])
                    for k in range(1, outputs[i] + 1)
                ),
                finish_reason=reasons[i],
                completion_tokens=outputs[i],
            )
            for i in range(request.num_sequences)
        ]
        body = full_response(
            request.route,
            self._response_id,
            self._created,
            self._model,
            choices,
            sum(request.prompt_tokens),
        )
        payload = json.dumps(body, separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})
        self._runtime.metrics.record_completed_request(request.n, max(outputs))


class HangResponse(Response):
    """Never answers: waits until the client leaves or the server stops."""

    def __init__(self, runtime: SimRuntime) -> None:
        self._runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job = self._runtime.open_job([])
        watcher = asyncio.create_task(_watch_disconnect(receive, job))
        try:
            if (await job.queue.get()) is not Signal.DISCONNECTED:
                await drop_connection(scope, reset=False)
        finally:
            watcher.cancel()
            self._runtime.release(job)


# -- routes ----------------------------------------------------------------------------------


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _json_body(request: Request) -> Mapping[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _routes(runtime_of: Callable[[], SimRuntime]) -> list[HttpRoute]:
    async def generate(request: Request, route: Route) -> Response:
        runtime = runtime_of()
        faults = runtime.faults
        if faults.first_byte_delay_s > 0:
            await asyncio.sleep(faults.first_byte_delay_s)
        if faults.hang:
            return HangResponse(runtime)
        if runtime.should_fail():
            status = faults.error_status
            return _error(ApiError(status, f"injected fault: HTTP {status}"))
        try:
            body = await _json_body(request)
            check_model(body, runtime.config.model_name)
            prompts = await runtime.count(route, body)
            parsed = parse_generation_request(
                route,
                body,
                prompts,
                max_model_len=runtime.config.engine.max_model_len,
                eos_token_id=runtime.config.eos_token_id,
            )
        except ApiError as exc:
            return _error(exc)
        rejection = runtime.admission_error(parsed)
        if rejection is not None:
            return _error(rejection)
        response_id = runtime.new_response_id(route)
        return JobResponse(runtime, parsed, runtime.specs_for(parsed, response_id), response_id)

    async def completions(request: Request) -> Response:
        return await generate(request, Route.COMPLETIONS)

    async def chat(request: Request) -> Response:
        return await generate(request, Route.CHAT)

    async def models(request: Request) -> Response:
        runtime = runtime_of()
        name = runtime.config.model_name
        created = int(time.time())
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "vllm",
                        "root": name,
                        "parent": None,
                        "max_model_len": runtime.config.engine.max_model_len,
                        "permission": [],
                    }
                ],
            }
        )

    async def health(request: Request) -> Response:
        if runtime_of().loop_error is not None:
            return Response(status_code=500)
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        runtime = runtime_of()
        faults = runtime.faults
        if faults.metrics_delay_s > 0:
            await asyncio.sleep(faults.metrics_delay_s)
        if faults.metrics_mode is MetricsMode.MISSING:
            status = faults.metrics_status
            return Response(f"HTTP {status}\n", status_code=status, media_type="text/plain")
        if faults.metrics_mode is MetricsMode.MALFORMED:
            return Response(MALFORMED_METRICS, media_type=PROMETHEUS_CONTENT_TYPE)
        return Response(runtime.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def faults_endpoint(request: Request) -> Response:
        runtime = runtime_of()
        if request.method == "DELETE":
            runtime.set_faults(Faults())
        elif request.method == "POST":
            try:
                changes = await _json_body(request)
                runtime.set_faults(runtime.faults.updated(changes))
            except ApiError as exc:
                return _error(exc)
            except ValueError as exc:
                return _error(ApiError(400, str(exc)))
        return JSONResponse(runtime.faults.to_json())

    async def restart(request: Request) -> Response:
        runtime = runtime_of()
        allowed = {"num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"}
        try:
            changes = await _json_body(request)
            unknown = set(changes) - allowed
            if unknown:
                raise ApiError(400, f"cannot change {sorted(unknown)}; allowed: {sorted(allowed)}")
            if any(isinstance(v, bool) or not isinstance(v, int) for v in changes.values()):
                raise ApiError(400, "restart parameters must be integers")
            runtime.restart(replace(runtime.config.engine, **changes))
        except ApiError as exc:
            return _error(exc)
        except ValueError as exc:
            return _error(ApiError(400, str(exc)))
        return JSONResponse(runtime.state())

    async def state(request: Request) -> Response:
        return JSONResponse(runtime_of().state())

    return [
        HttpRoute("/v1/completions", completions, methods=["POST"]),
        HttpRoute("/v1/chat/completions", chat, methods=["POST"]),
        HttpRoute("/v1/models", models, methods=["GET"]),
        HttpRoute("/health", health, methods=["GET"]),
        HttpRoute("/metrics", metrics, methods=["GET"]),
        HttpRoute("/sim/faults", faults_endpoint, methods=["GET", "POST", "DELETE"]),
        HttpRoute("/sim/restart", restart, methods=["POST"]),
        HttpRoute("/sim/state", state, methods=["GET"]),
    ]


class SimApp:
    """The ASGI app of one emulator. `runtime` exists while the app's lifespan runs."""

    def __init__(self, config: SimConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config.validated()
        self._clock = clock
        self._runtime: SimRuntime | None = None
        self._app = Starlette(routes=_routes(lambda: self.runtime), lifespan=self._lifespan)

    @property
    def runtime(self) -> SimRuntime:
        if self._runtime is None:
            raise RuntimeError("the emulator is not running (lifespan not started)")
        return self._runtime

    def begin_shutdown(self) -> None:
        """Release every open response (from the server's loop); no-op when not running."""
        if self._runtime is not None:
            self._runtime.begin_shutdown()

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[SimRuntime]:
        """Start the engine loop on the current event loop and stop it on exit. The ASGI
        lifespan uses it; in-process tests (httpx.ASGITransport runs no lifespan) enter it."""
        runtime = SimRuntime(self.config, clock=self._clock)
        await runtime.start()
        self._runtime = runtime
        try:
            yield runtime
        finally:
            await runtime.stop()
            self._runtime = None

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with self.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND_KEY] = send
        await self._app(scope, receive, send)


def create_sim_app(config: SimConfig, *, clock: Callable[[], float] = time.monotonic) -> SimApp:
    """An emulator as an ASGI app: serve it with uvicorn (see `sim.testing.running_sim`), or
    in-process through httpx.ASGITransport inside `async with app.run():`. httpx's ASGI
    transport buffers whole responses, so streaming and disconnect tests need a real server."""
    return SimApp(config, clock=clock)
