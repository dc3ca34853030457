"""The async shell: send a planned workload to one target on schedule and record what happens.

A single dispatcher starts each request at its scheduled offset, every response is read as a
server-sent-event stream, and a sampler scrapes the `/metrics` URLs on a fixed period meanwhile.
Each request's own deadline (`deadline_s` after it actually started) is enforced with
`asyncio.timeout`: the client closes the connection, as a real client that gives up would, and
vLLM aborts the request.

Requests go out through many `httpx.AsyncClient`s in turn, each with an unbounded connection
pool (a pool limit would queue requests inside the client and hide the delay from the
start-lag figure). Many clients rather than one because httpcore's pool scans all of its
connections for every request and every response: with hundreds of open streams in one pool
that scan, not the network, made requests start tens of milliseconds late.

Everything measured uses one injected monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.cookiejar
import json
import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError

from bench.payload import PlannedRequest
from bench.promtext import Reading, parse_reading
from bench.records import MetricPoint, RequestRecord, RunResult

Clock = Callable[[], float]

# The first request is scheduled this far after the run starts, so that it is not late merely
# because the loop was busy creating the client and the sampler.
SCHEDULE_LEAD_S = 0.05
# Clients the connections are spread over (see the module docstring).
CLIENT_SHARDS = 128
CONNECT_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 2.0
# Error bodies are kept for the record, cut to this many characters.
ERROR_TEXT_CHARS = 300


# --------------------------------------------------------------------------------------------
# Pure helpers (tested without a server)


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What one SSE data payload says: tokens it carries, finish reason, usage, error."""

    tokens: int = 0
    finish_reason: str | None = None
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    error: str | None = None


def read_chunk(payload: Mapping[str, Any]) -> ChunkInfo:
    """Interpret one parsed chunk of an OpenAI-style stream (completions or chat).

    A choice carries `len(token_ids)` tokens when vLLM returns token ids; otherwise one token
    when it has text or content or ends the stream (the EOS chunk has empty text), and none for
    chat's opening role-only delta.
    """
    error = payload.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, Mapping) else error
        return ChunkInfo(error=str(message)[:ERROR_TEXT_CHARS])
    tokens = 0
    finish: str | None = None
    for choice in payload.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        ids = choice.get("token_ids")
        reason = choice.get("finish_reason")
        if isinstance(ids, list):
            tokens += len(ids)
        else:
            delta = choice.get("delta")
            text = choice.get("text")
            if text is None and isinstance(delta, Mapping):
                text = delta.get("content") or delta.get("reasoning_content")
            if text or reason is not None:
                tokens += 1
        if reason is not None:
            finish = str(reason)
    usage = payload.get("usage")
    completion = prompt = None
    if isinstance(usage, Mapping):
        if isinstance(usage.get("completion_tokens"), int):
            completion = int(usage["completion_tokens"])
        if isinstance(usage.get("prompt_tokens"), int):
            prompt = int(usage["prompt_tokens"])
    return ChunkInfo(tokens, finish, completion, prompt)


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """The retry delay a shed response asked for: `retry-after-ms` (the OpenAI SDK's
    precise form) when present, else `retry-after` in seconds (HTTP dates are ignored)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) * scale
        except ValueError:
            continue
    return None


# --------------------------------------------------------------------------------------------
# One request


@dataclass(slots=True)
class _Observation:
    """Mutable notes taken while a request is in flight; frozen into a record at the end."""

    status: int | None = None
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    streamed: int = 0
    usage_completion: int | None = None
    usage_prompt: int | None = None
    retry_after_s: float | None = None
    retry_after_header: str | None = None
    retry_after_ms_header: str | None = None
    finish_reason: str | None = None
    error: str | None = None

    def on_tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            self.gaps.append(now - self.last_token_at)
        self.last_token_at = now
        self.streamed += count


async def _exchange(
    client: httpx.AsyncClient, url: str, request: PlannedRequest, obs: _Observation, clock: Clock
) -> None:
    async with client.stream("POST", url, content=request.body, headers=list(request.headers)) as response:
        obs.status = response.status_code
        if response.status_code != 200:
            obs.retry_after_s = retry_after_seconds(response.headers)
            obs.retry_after_header = response.headers.get("retry-after")
            obs.retry_after_ms_header = response.headers.get("retry-after-ms")
            body = await response.aread()
            obs.error = body.decode("utf-8", "replace")[:ERROR_TEXT_CHARS] or response.reason_phrase
            return
        async for event in EventSource(response).aiter_sse():
            data = event.data
            if data == "[DONE]":
                # Keep reading to the end of the body (nothing should follow): a response
                # left unread costs its connection, and a new connection per request costs
                # more CPU than anything else the client does.
                obs.finished = True
                continue
            if not data or obs.finished:
                continue
            try:
                payload = json.loads(data)
            except ValueError:
                obs.error = f"bad chunk: {data[:80]!r}"
                return
            info = read_chunk(payload)
            if info.error is not None:
                obs.error = info.error
                return
            obs.on_tokens(info.tokens, clock())
            if info.finish_reason is not None:
                obs.finish_reason = info.finish_reason
            if info.usage_completion_tokens is not None:
                obs.usage_completion = info.usage_completion_tokens
            if info.usage_prompt_tokens is not None:
                obs.usage_prompt = info.usage_prompt_tokens
        if not obs.finished:
            obs.error = "stream ended without [DONE]"


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    request: PlannedRequest,
    *,
    deadline_s: float | None,
    scheduled_at: float,
    run_start: float,
    clock: Clock,
) -> RequestRecord:
    """Send one planned request now and record what came back (never raises, except for
    cancellation)."""
    started = clock()
    obs = _Observation()
    gave_up = False
    try:
        async with asyncio.timeout(deadline_s):
            await _exchange(client, base_url + request.path, request, obs, clock)
    except TimeoutError:
        gave_up = True
    except (httpx.HTTPError, SSEError) as exc:
        obs.error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS]
    ended = clock()
    spec = request.spec
    return RequestRecord(
        index=request.index,
        tenant=spec.tenant,
        priority=spec.priority,
        scheduled_s=scheduled_at - run_start,
        start_lag_s=started - scheduled_at,
        prompt_tokens_wanted=spec.prompt_tokens,
        output_tokens_wanted=spec.output_tokens,
        status=obs.status,
        finished=obs.finished and not gave_up,
        gave_up=gave_up,
        ttft_s=None if obs.first_token_at is None else obs.first_token_at - started,
        e2e_s=ended - started,
        output_tokens=obs.usage_completion if obs.usage_completion is not None else obs.streamed,
        streamed_tokens=obs.streamed,
        usage_completion_tokens=obs.usage_completion,
        usage_prompt_tokens=obs.usage_prompt,
        gaps_s=tuple(obs.gaps),
        retry_after_s=obs.retry_after_s,
        retry_after_header=obs.retry_after_header,
        retry_after_ms_header=obs.retry_after_ms_header,
        finish_reason=obs.finish_reason,
        error=obs.error,
    )


# --------------------------------------------------------------------------------------------
# Metrics


def metrics_url(base: str) -> str:
    """A /metrics URL from a base URL or a full metrics URL."""
    base = base.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


async def scrape(client: httpx.AsyncClient, url: str) -> Reading | None:
    """One scrape; None when the URL does not answer with parseable metrics."""
    try:
        response = await client.get(url, timeout=METRICS_TIMEOUT_S)
        if response.status_code != 200:
            return None
        return parse_reading(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def scrape_all(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, Reading]:
    readings = await asyncio.gather(*(scrape(client, url) for url in urls))
    return {url: r for url, r in zip(urls, readings, strict=True) if r is not None}


async def wait_idle(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    *,
    timeout_s: float,
    poll_s: float = 0.25,
    clock: Clock = time.monotonic,
) -> dict[str, Reading]:
    """Poll until every URL that reports engine or queue load reports none (no running or
    waiting request, empty kvgate queue), or until `timeout_s`. Returns the last readings."""
    give_up_at = clock() + timeout_s
    while True:
        readings = await scrape_all(client, urls)
        if all(_idle(r) for r in readings.values()) or clock() >= give_up_at:
            return readings
        await asyncio.sleep(poll_s)


def _idle(reading: Reading) -> bool:
    return (reading.busy or 0.0) == 0.0 and (reading.queue_depth or 0.0) == 0.0


class Sampler:
    """Scrapes `urls` every `period_s` until stopped; points carry run-relative times."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Sequence[str],
        period_s: float,
        run_start: float,
        clock: Clock,
    ) -> None:
        self._client = client
        self._urls = list(urls)
        self._period_s = period_s
        self._run_start = run_start
        self._clock = clock
        self.points: list[MetricPoint] = []

    async def run(self) -> None:
        next_at = self._clock()
        while True:
            at = self._clock()
            readings = await scrape_all(self._client, self._urls)
            self.points.extend(MetricPoint(at - self._run_start, url, r) for url, r in readings.items())
            next_at += self._period_s
            await asyncio.sleep(max(0.0, next_at - self._clock()))


# --------------------------------------------------------------------------------------------
# One run


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Knobs of one run. `metrics_urls` are scraped during the run (target and backends);
    `request_timeout_s` bounds a silent connection when no deadline is set."""

    deadline_s: float | None = None
    metrics_urls: tuple[str, ...] = ()
    sample_period_s: float = 0.5
    idle_timeout_s: float = 120.0
    request_timeout_s: float = 600.0


class _NoCookies(http.cookiejar.CookieJar):
    """A jar that keeps nothing: the simulated clients are independent of each other, and
    parsing every response for cookies was a fifth of the client's CPU per request."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None


def make_client(request_timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> httpx.AsyncClient:
    """A client for one shard; pass one `ssl_context` to all shards (building one loads the
    CA bundle, some 20 ms each)."""
    return httpx.AsyncClient(
        cookies=httpx.Cookies(_NoCookies()),
        verify=ssl_context if ssl_context is not None else True,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
        timeout=httpx.Timeout(
            connect=CONNECT_TIMEOUT_S, read=request_timeout_s, write=WRITE_TIMEOUT_S, pool=None
        ),
    )


async def run_target(
    target: str,
    plan: Sequence[PlannedRequest],
    options: RunOptions,
    *,
    clock: Clock = time.monotonic,
    on_record: Callable[[RequestRecord], None] | None = None,
    clients: Sequence[httpx.AsyncClient] = (),
    label: str | None = None,
) -> RunResult:
    """Replay `plan` against `target` (a base URL such as http://host:8000). Requests use
    `clients` in turn when given (the caller closes them), else clients of our own. The
    result is named `label` (default: the target)."""
    base = target.rstrip("/").removesuffix("/v1")
    own_clients = not clients
    if clients:
        shards = list(clients)
    else:
        context = ssl.create_default_context()
        shards = [make_client(options.request_timeout_s, context) for _ in range(CLIENT_SHARDS)]
    metrics_http = httpx.AsyncClient(timeout=METRICS_TIMEOUT_S)
    try:
        urls = list(dict.fromkeys(options.metrics_urls))
        baseline = await wait_idle(metrics_http, urls, timeout_s=options.idle_timeout_s, clock=clock)
        vllm_sources = tuple(url for url, r in baseline.items() if r.is_vllm)

        run_start = clock() + SCHEDULE_LEAD_S
        sampler = Sampler(metrics_http, urls, options.sample_period_s, run_start, clock)
        sampler_task = asyncio.create_task(sampler.run()) if urls else None
        in_flight = 0
        max_in_flight = 0

        async def one(request: PlannedRequest, scheduled_at: float) -> RequestRecord:
            nonlocal in_flight, max_in_flight
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                record = await send_one(
                    shards[request.index % len(shards)],
                    base,
                    request,
                    deadline_s=options.deadline_s,
                    scheduled_at=scheduled_at,
                    run_start=run_start,
                    clock=clock,
                )
            finally:
                in_flight -= 1
            if on_record is not None:
                on_record(record)
            return record

        tasks: list[asyncio.Task[RequestRecord]] = []
        try:
            for request in plan:
                scheduled_at = run_start + request.spec.arrival_s
                delay = scheduled_at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(request, scheduled_at)))
            records = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if sampler_task is not None:
                sampler_task.cancel()
                await asyncio.gather(sampler_task, return_exceptions=True)
        duration = clock() - run_start
        final = await wait_idle(metrics_http, urls, timeout_s=options.idle_timeout_s, clock=clock)
        return RunResult(
            target=label or target,
            records=tuple(sorted(records, key=lambda r: r.index)),
            samples=tuple(sampler.points),
            baseline=baseline,
            final=final,
            vllm_sources=vllm_sources,
            duration_s=duration,
            max_in_flight=max_in_flight,
        )
    finally:
        await metrics_http.aclose()
        if own_clients:
            for shard in shards:
                await shard.aclose()


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Keep the cyclic collector's full (oldest-generation) collections out of a run.

    With hundreds of open streams a full collection walks every live object and stalled the
    event loop for 100-200 ms, which showed up as requests starting late. Long-lived objects
    built before the run (plan, prompts) are frozen out of collection; young generations are
    still collected as usual (cheap, and where the garbage of finished requests is), and a
    full collection runs when the block ends.
    """
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1_000_000_000)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        gc.collect()


def records_from_jsonl(lines: Iterable[str]) -> list[RequestRecord]:
    return [RequestRecord.from_json(json.loads(line)) for line in lines if line.strip()]
