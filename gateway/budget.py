"""Reading a backend's budget: Prometheus text -> `BackendReading`, and the async poller.

`MetricsBody` reads one /metrics body as it arrives and keeps only the lines kvgate reads,
within bounds on the body's size and on those lines' length (a hostile or broken exporter can
neither fill the memory nor make the parse cost seconds of the event loop). prometheus_client's
real text parser then runs over the kept lines (the pure arithmetic is `gateway.vllm_metrics`).
`MetricsPoller` scrapes `/metrics` every `interval_s`, each scrape bounded in total time
(connect, headers and body together: a backend that trickles a byte now and then never
trips a per-read timeout), feeds each good reading to `KvBudget.observe` (the closed loop)
and each failure, whatever raised it, to `KvBudget.observe_failure` (unknown means
saturated), then calls `on_update` so the wait queue can react at once. The poller does not
die of a failure: it logs it (rate-limited), counts it and goes on; if its task ends anyway,
the budget is told and stays unknown, with the reason in /readyz.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.capacity import KvBudget, Reconciliation
from gateway.shared_reading import AskAgain, Follow, Lead, Turn
from gateway.vllm_metrics import METRIC_NAMES, BackendReading, MetricSample, MetricsFormatError, read_backend

log = logging.getLogger(__name__)

# Only the families kvgate reads go through the parser: vLLM's /metrics is mostly histograms
# it does not need, and parsing them all every 200 ms would cost a noticeable share of a core.
_FAMILY_PREFIXES = tuple(
    sorted({name.removesuffix("_total") for names in METRIC_NAMES.values() for name in names})
)
# A line kvgate reads: a sample of one of those families, or a comment (`# TYPE name ...`,
# `# HELP name ...`) about one. Matched in C over whole chunks of the body: at most a couple of
# milliseconds per 64 KiB whatever the bytes are, where a Python loop over lines cost 25 ms.
_RELEVANT = re.compile(
    rb"^(?:#[^ \n]* [^ \n]* )?(?:" + b"|".join(re.escape(p.encode()) for p in _FAMILY_PREFIXES) + rb")[^\n]*",
    re.MULTILINE,
)
_NAME = re.compile(rb"(?:#[^ \n]* [^ \n]* )?([^{ \n]{1,80})")

# The largest body read. vLLM 0.32's /metrics is 54 KB per engine (the testbed has one): 3.5 MB
# for a data-parallel server of 64 engines. Filtering costs at most 1.6 ms of the loop per
# 64 KiB chunk (all newlines, the worst case), 0.4 s of CPU for a whole body at this bound.
MAX_METRICS_BODY_BYTES = 16 << 20
# The longest line kvgate reads (its labels are parsed char by char in Python: 16 KiB cost
# about 2 ms). vLLM 0.32's cache_config_info line, the longest, is 1.2 KB.
MAX_METRICS_LINE_BYTES = 16 << 10
# All the lines kvgate reads together: 3.7 KB on the testbed, 3.4 KB more per extra engine
# (220 KB for 64). Their parse costs about 0.3 ms per KiB.
MAX_METRICS_KEPT_BYTES = 1 << 20
# Kept text up to this size is parsed on the event loop (5 ms at most); a larger one in a
# worker thread, where the interpreter hands the loop back every 5 ms.
INLINE_PARSE_BYTES = 16 << 10


def _metric_name(line: bytes) -> str:
    match = _NAME.match(line)
    return match.group(1).decode("ascii", "replace") if match else "a metric"


class MetricsBody:
    """One /metrics body, fed chunk by chunk as it arrives (pure: no I/O, no clock).

    `feed` raises MetricsFormatError as soon as the body exceeds `max_bytes`, a line kvgate
    reads exceeds MAX_METRICS_LINE_BYTES, or those lines together exceed
    MAX_METRICS_KEPT_BYTES; other lines are skipped unread however long they are. The work per
    chunk is linear in its size and done in C but for the kept lines.
    """

    def __init__(self, max_bytes: int = MAX_METRICS_BODY_BYTES) -> None:
        self._max_bytes = max_bytes
        self.size = 0
        self._crc = 0
        self._carry = bytearray()  # the start of a line whose end has not arrived yet
        self._skipping = False  # inside an over-long line kvgate does not read
        self._kept: list[bytes] = []
        self.kept_bytes = 0

    @property
    def digest(self) -> float:
        """CRC-32 of every byte fed so far (see KvBudget on frozen metrics)."""
        return float(self._crc)

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self._max_bytes:
            raise MetricsFormatError(f"the /metrics body is larger than {self._max_bytes} bytes")
        self._crc = zlib.crc32(chunk, self._crc)
        if self._skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return
            chunk = chunk[end + 1 :]
            self._skipping = False
        end = chunk.rfind(b"\n")
        if end < 0:
            self._carry += chunk
        else:
            lines = bytes(self._carry) + chunk[: end + 1] if self._carry else chunk[: end + 1]
            self._carry = bytearray(chunk[end + 1 :])
            self._keep(lines)
        if len(self._carry) > MAX_METRICS_LINE_BYTES:
            if _RELEVANT.match(self._carry):
                raise self._too_long(bytes(self._carry))
            self._carry.clear()
            self._skipping = True

    def text(self) -> str:
        """The kept lines, once the whole body has been fed."""
        if self._carry and not self._skipping:
            self._keep(bytes(self._carry))
        self._carry.clear()
        try:
            return (b"\n".join(self._kept) + b"\n").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MetricsFormatError(
                f"a line of a metric kvgate reads is not UTF-8 text: {exc.reason}"
            ) from None

    def reading(self) -> BackendReading:
        """Parse the kept lines (the whole body must have been fed)."""
        return replace(read_backend(_samples(self.text())), digest=self.digest)

    def _keep(self, lines: bytes) -> None:
        for match in _RELEVANT.finditer(lines):
            line = match.group()
            if len(line) > MAX_METRICS_LINE_BYTES:
                raise self._too_long(line)
            self.kept_bytes += len(line) + 1
            if self.kept_bytes > MAX_METRICS_KEPT_BYTES:
                raise MetricsFormatError(
                    f"the lines of the metrics kvgate reads exceed {MAX_METRICS_KEPT_BYTES} bytes "
                    f"(at {_metric_name(line)})"
                )
            self._kept.append(line)

    @staticmethod
    def _too_long(line: bytes) -> MetricsFormatError:
        return MetricsFormatError(
            f"a line of {_metric_name(line)} is longer than {MAX_METRICS_LINE_BYTES} bytes"
        )


def _samples(kept: str) -> list[MetricSample]:
    try:
        return [
            MetricSample(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(kept)
            for sample in family.samples
        ]
    except Exception as exc:  # a foreign parser: whatever it raises means malformed text
        raise MetricsFormatError(f"malformed Prometheus text: {type(exc).__name__}: {exc}"[:300]) from exc


def parse_metrics_text(text: str) -> BackendReading:
    """Parse a whole /metrics body; raise MetricsFormatError when it is malformed, incomplete
    or out of bounds (see MetricsBody)."""
    body = MetricsBody()
    body.feed(text.encode("utf-8", "surrogateescape"))
    return body.reading()


class ScrapeTurns(Protocol):
    """Whose turn it is to read a backend shared with other processes (gateway.shared_scrape)."""

    async def turn(self, asked_at: float) -> Turn: ...

    def publish(self, reading: BackendReading, took_s: float) -> None: ...

    def reconfigure(
        self, *, interval_s: float, timeout_s: float, stale_after_s: float | None = None
    ) -> None: ...

    def describe(self) -> dict[str, Any]: ...


_CONNECTING = "connecting"
_AWAITING_HEADERS = "waiting for the response headers"


class MetricsPoller:
    """Scrapes one backend's /metrics forever; cancel the task running `run` to stop it.

    Every failure of a scrape (connection, status, time limit, size, parse, absurd values, or
    an exception nobody foresaw, in the budget included) is counted in `failures`, told to the
    budget and reported through `on_update(None)`; the loop goes on. Its messages never carry
    the backend's address: they end up in /readyz.
    """

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
        max_body_bytes: int = MAX_METRICS_BODY_BYTES,
        share: ScrapeTurns | None = None,
    ) -> None:
        self._client = client
        self._url = url
        self._budget = budget
        self._clock = clock
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._on_update = on_update
        # vLLM does not compress /metrics; asking for the body as is keeps a compressed bomb
        # (a few KB that inflate to GBs) out of the question.
        self._headers = {**(headers or {}), "accept-encoding": "identity"}
        self._waiting = waiting  # whether requests wait for this backend's blocks now
        self._max_body_bytes = max_body_bytes
        self.failures = 0
        self.update_failures = 0  # on_update raised (not a failed scrape)
        self._streak = 0  # failures since the last good scrape
        self._parse_s = 0.0  # how long the last scrape's parse took in a thread (0: on the loop)
        self._poked = asyncio.Event()
        self.share = share  # the scrape shared with other processes (gateway.shared_scrape)
        self.readings = {"scraped": 0, "shared": 0}  # good readings by where they came from
        self.last_source = "scraped"  # where the newest good reading came from
        self._observed_until = -math.inf  # when the newest reading observed was taken

    def reconfigure(self, *, interval_s: float, timeout_s: float) -> None:
        """New interval and timeout, from the next scrape on (a settings reload)."""
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self.poke()

    def poke(self) -> None:
        """Scrape now instead of at the next tick (a request just failed to reach the backend)."""
        self._poked.set()

    async def poll_once(self, turn: Turn | None = None) -> Reconciliation | None:
        """One reading: the shared one when `turn` says to follow, else a scrape (published
        when `turn` says to lead); returns the reconciliation, or None when the scrape failed.
        Every failure is counted and told to the budget here, not raised (`run` takes whatever
        a broken clock might still raise)."""
        result: Reconciliation | None = None
        published: tuple[BackendReading, float] | None = None  # the reading to share, and its time
        try:
            if isinstance(turn, Follow):
                started, reading, taken = turn.started_at, turn.reading, turn.finished_at
                source = "shared"
            else:
                started = self._clock()
                reading = await self._scrape()
                taken, source = self._clock(), "scraped"
            result = self._budget.observe(reading, started, taken, waiting=self._waiting())
            self._observed_until = max(self._observed_until, taken)
            if result is None:  # refused as frozen; the budget has counted the failure
                self._count_failure(self._budget.last_error)
            else:
                self.readings[source] += 1
                self.last_source = source
                if isinstance(turn, Lead):
                    published = (reading, taken - started)
        except _UnreachableError as exc:
            self._fail(str(exc), unreachable=True)
        except TimeoutError as exc:
            self._fail(_describe(exc), unreachable=False, slow=True)
        except (httpx.HTTPError, MetricsFormatError) as exc:
            self._fail(_describe(exc), unreachable=False)
        except Exception as exc:  # a case nobody foresaw: still only a failed scrape
            self._fail(f"unexpected {type(exc).__name__}: {exc}", unreachable=False, exc=exc)
        else:
            if result is not None and self._streak:
                log.info("metrics scrape of %s recovered after %d failures", self._url, self._streak)
                self._streak = 0
        try:
            self._on_update(result)
        except Exception as exc:  # the consumer's bug: the scrape itself stands
            self.update_failures += 1
            if self.update_failures == 1 or self.update_failures % 50 == 0:
                log.error(
                    "metrics poller of %s: on_update failed (%d so far)",
                    self._url,
                    self.update_failures,
                    exc_info=exc,
                )
        # After the budget has taken the reading: its publication rides with the round trip
        # that tells Redis this process's view of the same reading.
        if published is not None and self.share is not None:
            self.share.publish(*published)
        return result

    async def _scrape(self) -> BackendReading:
        """GET /metrics within `timeout_s` in all, reading at most `max_body_bytes`."""
        phase = [_CONNECTING]

        async def trace(event: str, info: dict[str, Any]) -> None:
            # httpcore's events tell a connection that cannot be made (the backend is gone)
            # from one that is made and then answers too slowly.
            if event.startswith(("http11.", "http2.")) and phase[0] == _CONNECTING:
                phase[0] = _AWAITING_HEADERS

        body = MetricsBody(self._max_body_bytes)
        timeout_s = self._timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                request = self._client.build_request(
                    "GET",
                    self._url,
                    headers=self._headers,
                    timeout=httpx.Timeout(timeout_s),
                    extensions={"trace": trace},
                )
                response = await self._client.send(request, stream=True)
                try:
                    _check_response(response, self._max_body_bytes)
                    phase[0] = "reading the body"
                    async for chunk in response.aiter_raw():
                        body.feed(chunk)
                finally:
                    await response.aclose()
        except (TimeoutError, httpx.TimeoutException) as exc:
            if phase[0] == _CONNECTING or isinstance(exc, httpx.ConnectTimeout):
                raise _UnreachableError(f"cannot connect within {timeout_s:g} s") from exc
            received = f" ({body.size} bytes received)" if body.size else ""
            raise TimeoutError(
                f"no complete answer within metrics_timeout_s ({timeout_s:g} s): timed out "
                f"{phase[0]}{received}"
            ) from exc
        except httpx.ConnectError as exc:
            raise _UnreachableError(f"cannot connect: {_describe(exc)}") from exc
        if body.kept_bytes <= INLINE_PARSE_BYTES:
            return body.reading()
        parse_started = self._clock()
        try:
            return await asyncio.to_thread(body.reading)
        finally:
            self._parse_s = self._clock() - parse_started

    def _fail(
        self, message: str, *, unreachable: bool, slow: bool = False, exc: BaseException | None = None
    ) -> None:
        message = self._scrub(message)
        self._count_failure(message, exc)
        self._budget.observe_failure(message, unreachable=unreachable, slow=slow, now=self._clock())

    def _scrub(self, message: str) -> str:
        """/readyz shows the message: whatever a foreign library put in it, not the address."""
        return message.replace(self._url, "/metrics")

    def _count_failure(self, message: str, exc: BaseException | None = None) -> None:
        self.failures += 1
        self._streak += 1
        if self._streak == 1 or self.failures % 50 == 0:
            log.warning(
                "metrics scrape of %s failed (%d so far): %s",
                self._url,
                self.failures,
                message,
                exc_info=exc,
            )

    async def run(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(self._ended)
        while True:
            try:
                await self._poll_forever()
            except Exception as exc:  # not a scrape's failure (poll_once takes those): a bug
                message = self._scrub(f"the metrics poller failed: {type(exc).__name__}: {exc}")
                self._count_failure(message, exc)
                with contextlib.suppress(Exception):  # the clock may be what failed
                    self._budget.observe_failure(message, unreachable=False, now=self._clock())
                # Start over after a pause: a bug that repeats must not spin the loop.
                await asyncio.sleep(self._interval_s)

    async def _poll_forever(self) -> None:
        while True:
            started = self._clock()
            # A poke (a request could not reach the backend) asks for a scrape of this
            # process's own, not someone's reading; one that arrives during this scrape asks
            # for another that starts after it.
            poked = self._poked.is_set()
            self._poked.clear()
            self._parse_s = 0.0
            turn = await self.share.turn(started) if self.share is not None and not poked else None
            if isinstance(turn, Follow) and turn.finished_at <= self._observed_until:
                # Older than a reading of this process's own: nothing new.
                turn = AskAgain(self._interval_s)
            if isinstance(turn, AskAgain):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(turn.pause_s):
                        await self._poked.wait()
                continue
            ok = await self.poll_once(turn) is not None
            elapsed = self._clock() - started
            # A failing scrape takes at most half the poller's time, and so does a parse in a
            # thread: one that costs a lot (a body at the size bound, a trickle up to the time
            # limit, kept lines near their bound) is not repeated at once. A good scrape that
            # is merely slow to arrive is, or the budget would go stale.
            floor = self._parse_s if ok else elapsed
            pause = max(self._interval_s - elapsed, floor)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, pause)):
                    await self._poked.wait()

    def _ended(self, task: asyncio.Task[Any]) -> None:
        """The task running `run` is done: stopped (cancelled) or killed by something that is
        not an Exception. Either way no reading will come any more: the budget must say so."""
        if task.cancelled():
            reason = "the metrics poller was stopped"
        else:
            exc = task.exception()
            reason = f"the metrics poller died: {type(exc).__name__}: {exc}"
            log.error("metrics poller of %s died; its budget stays unknown", self._url, exc_info=exc)
        self._budget.halt(reason)


class _UnreachableError(Exception):
    """No connection to the backend could be made (it counts towards `down`)."""


def _check_response(response: httpx.Response, max_bytes: int) -> None:
    if response.status_code != 200:
        raise MetricsFormatError(f"HTTP {response.status_code} {response.reason_phrase}"[:200])
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type in ("text/html", "application/xhtml+xml", "application/json"):
        raise MetricsFormatError(f"the answer is {media_type}, not Prometheus text")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MetricsFormatError(f"the answer is compressed ({encoding[:40]}) though kvgate asked for none")
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise MetricsFormatError(f"the /metrics body is larger than {max_bytes} bytes ({int(length)})")


def _describe(exc: BaseException) -> str:
    """A failure as /readyz shows it: its type and message, never the URL (httpx's status
    errors name it, credentials included)."""
    if isinstance(exc, MetricsFormatError | TimeoutError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
