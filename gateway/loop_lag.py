"""How late the event loop runs: a timer that measures its own lateness.

Everything kvgate serves shares one event loop, so anything that holds it (a long parse, a
callback that runs on, the process not being given a CPU) delays every request, `/healthz`
included. `LoopLagProbe` asks to be woken every `interval_s` and records how long past that
it woke: a lag of L means no callback could start for about L. Each lag is observed into
`kvgate_event_loop_lag_seconds`; the worst ones are kept, with when they happened and where
the time went, for `/admin/state` (`event_loop`) and a WARNING line.

Where the time went tells the causes apart: while the loop was late, did the loop's own
thread run (the loop was busy: its code is the cause), did it wait runnable for a CPU (the
machine is the cause, not kvgate), did other threads of the process run (a tokenizer or render
thread held the interpreter or the CPU), did the garbage collector run (gc.callbacks time it),
or did it sleep (waiting for the interpreter lock, a
kernel lock or a page)? The split is read from the thread's and the process's CPU clocks and,
on Linux, the thread's run-queue wait in /proc/thread-self/schedstat: cheap calls, a few
microseconds a tick.

The accounting (`LagRecorder`) is pure and takes its readings as arguments; the probe is the
async shell that reads the clocks. It uses real monotonic time, never the app's injected
clock: it measures the real loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

# A tick every 50 ms: 20 wake-ups a second, a few microseconds each. A hold longer than the
# interval is always seen (a tick falls due inside it), shorter ones partly.
DEFAULT_LOOP_LAG_INTERVAL_S = 0.05
# Lags from here on are kept and logged: /healthz's target is an answer within 100 ms, and a
# loop held for half of that is already a large share of it.
DEFAULT_LOOP_LAG_WARN_S = 0.05
# At most one WARNING line per this many seconds (the rest are counted in it): a loop held
# again and again must not also flood the log.
DEFAULT_LOOP_LAG_LOG_EVERY_S = 10.0
# The worst lags kept for /admin/state: the latest this many at or over the warning level.
DEFAULT_LOOP_LAG_KEEP = 20


@dataclass(frozen=True, slots=True)
class Stall:
    """One tick that woke `lag_s` late, `at_s` (monotonic seconds) being when it woke.

    Over the tick's whole span (`span_s` = interval + lag), `loop_cpu_s` is the CPU the event
    loop's thread used, `other_cpu_s` the CPU of the process's other threads (tokenizer and
    render threads) and `runqueue_s` the time the loop's thread waited, runnable, for a CPU
    (None where the kernel does not say)."""

    at_s: float
    lag_s: float
    span_s: float
    loop_cpu_s: float
    other_cpu_s: float
    runqueue_s: float | None = None
    gc_s: float = 0.0  # time in the cyclic garbage collector, in any thread

    def cause(self) -> str:
        """The likeliest cause, from where the time of the lag went: `gc` when the garbage
        collector ran for half of it or more, else `loop` when the loop's thread ran that long, else `scheduling` when it waited for a CPU that
        long, else `threads` when other threads of the process ran that long, else `blocked`
        (the thread slept: the interpreter lock, a kernel lock, a page). Without a run-queue
        reading, time off a CPU that no thread of the process used is called `scheduling`."""
        half = self.lag_s / 2
        if self.gc_s >= half:
            return "gc"
        if self.loop_cpu_s >= half:
            return "loop"
        if self.runqueue_s is not None and self.runqueue_s >= half:
            return "scheduling"
        if self.other_cpu_s >= half:
            return "threads"
        return "blocked" if self.runqueue_s is not None else "scheduling"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cause": self.cause()}


@dataclass(frozen=True, slots=True)
class LagSummary:
    ticks: int
    worst_lag_s: float
    stalls: int  # ticks at or over the warning level
    recent_stalls: tuple[Stall, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "ticks": self.ticks,
            "worst_lag_s": self.worst_lag_s,
            "stalls": self.stalls,
            "recent_stalls": [stall.to_json() for stall in self.recent_stalls],
        }


class LagRecorder:
    """The probe's accounting: counts ticks, keeps the worst lag and the latest stalls, and
    says when a stall is to be logged (the first, then at most one per `log_every_s`).
    Not thread-safe: one probe, on the loop, feeds it."""

    def __init__(
        self,
        *,
        warn_s: float = DEFAULT_LOOP_LAG_WARN_S,
        log_every_s: float = DEFAULT_LOOP_LAG_LOG_EVERY_S,
        keep: int = DEFAULT_LOOP_LAG_KEEP,
    ) -> None:
        self.warn_s = warn_s
        self.log_every_s = log_every_s
        self._ticks = 0
        self._worst_s = 0.0
        self._stalls = 0
        self._recent: deque[Stall] = deque(maxlen=keep)
        self._logged_at: float | None = None
        self._unlogged = 0

    def record(self, stall: Stall) -> tuple[Stall, int] | None:
        """Account for one tick. Returns (the stall, how many earlier ones went unlogged)
        when this one is to be logged, else None."""
        self._ticks += 1
        self._worst_s = max(self._worst_s, stall.lag_s)
        if stall.lag_s < self.warn_s:
            return None
        self._stalls += 1
        self._recent.append(stall)
        if self._logged_at is not None and stall.at_s - self._logged_at < self.log_every_s:
            self._unlogged += 1
            return None
        unlogged, self._unlogged, self._logged_at = self._unlogged, 0, stall.at_s
        return stall, unlogged

    def summary(self) -> LagSummary:
        return LagSummary(self._ticks, self._worst_s, self._stalls, tuple(self._recent))


_SCHEDSTAT = "/proc/thread-self/schedstat"


@contextlib.contextmanager
def runqueue_clock() -> Iterator[Callable[[], float | None]]:
    """A clock of the calling thread's run-queue wait in seconds (the second field of
    schedstat, in ns), or one that says None where /proc has no such file. Open it on the
    thread to measure: the file is that thread's."""
    try:
        stat = open(_SCHEDSTAT, "rb", buffering=0)  # noqa: SIM115 (held open: a seek per read)
    except OSError:
        yield lambda: None
        return

    def read() -> float | None:
        try:
            stat.seek(0)
            return int(stat.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    with stat:
        yield read


class LoopLagProbe:
    """Run `run()` as a task on the loop to measure; `observe` gets every lag in seconds (the
    histogram). The clocks are parameters for tests; the defaults are the real ones (the
    run-queue clock: this thread's, opened when `run` starts)."""

    def __init__(
        self,
        observe: Callable[[float], None],
        *,
        interval_s: float = DEFAULT_LOOP_LAG_INTERVAL_S,
        recorder: LagRecorder | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        thread_cpu: Callable[[], float] = time.thread_time,
        process_cpu: Callable[[], float] = time.process_time,
        runqueue: Callable[[], float | None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.recorder = recorder if recorder is not None else LagRecorder()
        self._observe = observe
        self._monotonic = monotonic
        self._thread_cpu = thread_cpu
        self._process_cpu = process_cpu
        self._runqueue = runqueue
        self._gc_s = 0.0

    async def run(self) -> None:
        """Tick until cancelled."""
        with contextlib.ExitStack() as stack:
            runqueue = self._runqueue or stack.enter_context(runqueue_clock())
            stack.enter_context(self._gc_timed())
            while True:
                await self._tick(runqueue)

    @contextlib.contextmanager
    def _gc_timed(self) -> Iterator[None]:
        """Add the collector's time to `self._gc_s` while in the block (gc.callbacks)."""
        started: list[float] = []

        def callback(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                self._gc_s += time.perf_counter() - started.pop()

        gc.callbacks.append(callback)
        try:
            yield
        finally:
            gc.callbacks.remove(callback)

    async def _tick(self, runqueue: Callable[[], float | None]) -> None:
        started = self._monotonic()
        loop_cpu, process_cpu, waited, in_gc = self._thread_cpu(), self._process_cpu(), runqueue(), self._gc_s
        await asyncio.sleep(self.interval_s)
        woke = self._monotonic()
        loop_used = self._thread_cpu() - loop_cpu
        waited_now = runqueue()
        stall = Stall(
            at_s=woke,
            lag_s=max(0.0, woke - started - self.interval_s),
            span_s=woke - started,
            loop_cpu_s=loop_used,
            other_cpu_s=max(0.0, self._process_cpu() - process_cpu - loop_used),
            runqueue_s=None if waited is None or waited_now is None else max(0.0, waited_now - waited),
            gc_s=self._gc_s - in_gc,
        )
        self._observe(stall.lag_s)
        logged = self.recorder.record(stall)
        if logged is not None:
            first, unlogged = logged
            waited_ms = "?" if first.runqueue_s is None else f"{first.runqueue_s * 1000:.0f}"
            log.warning(
                "the event loop ran %.0f ms late (cause: %s; of the %.0f ms tick its thread ran "
                "%.0f ms and waited %s ms for a CPU, other threads ran %.0f ms, the garbage "
                "collector %.0f ms)%s",
                first.lag_s * 1000,
                first.cause(),
                first.span_s * 1000,
                first.loop_cpu_s * 1000,
                waited_ms,
                first.other_cpu_s * 1000,
                first.gc_s * 1000,
                f"; {unlogged} more such since the last line" if unlogged else "",
            )
