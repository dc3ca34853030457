"""The backend's /metrics misbehaves: slow, frozen, malformed, missing, without the pool size,
or reporting another pool after a restart; or it is hostile: it trickles, is huge, is cut,
binary, an HTML page, or carries absurd values (a fake backend on raw sockets, hostile_metrics).

What must happen: kvgate never crashes; an unknown budget counts as saturated (nothing new is
admitted, /readyz says why, new arrivals get 503 + Retry-After, queued requests wait); the
budget rebuilds itself from the first sane scrape, and follows a pool that changed size.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import pytest
from faultkit import (
    LONG_STREAM,
    SLOW_STEPS,
    Served,
    clear_faults,
    gateway_idle,
    poll_until,
    served_gateway,
    set_faults,
    sim_state,
)
from hostile_metrics import FIXTURE, HostileMetrics, hostile_metrics

from gateway.backend import capacity_config
from gateway.budget import INLINE_PARSE_BYTES, MetricsPoller
from gateway.capacity import BudgetState, KvBudget, Reconciliation
from gateway.ledger import InMemoryLedger
from gateway.settings import Settings
from gateway.vllm_metrics import BackendReading
from sim.config import SimConfig
from sim.testing import SimServer, running_sim_server

SMALL = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8}
# 30 of the 63 usable blocks each: two fit at once, a third must wait.
HOG = {**LONG_STREAM, "prompt": "a", "max_tokens": 950, "stream": False}


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with running_sim_server(SimConfig(engine=SLOW_STEPS)) as server:
        yield server


@pytest.fixture
def kvgate(sim: SimServer) -> Iterator[Served]:
    with served_gateway(sim.url, metrics_timeout_s=0.2) as served:
        yield served


def readyz(kvgate: Served) -> tuple[int, str]:
    response = httpx.get(f"{kvgate.url}/readyz", timeout=5)
    reason: str = response.json()["reason"]
    return response.status_code, reason


def budget_state(kvgate: Served) -> str:
    state: str = kvgate.call(lambda: kvgate.gateway.snapshot().state.value)
    return state


def assert_refused_as_unknown(kvgate: Served) -> None:
    """Arrivals are refused once the budget is unknown and no scrape in flight may settle it
    (a scrape too slow is given `backend_down_after_failures` tries first)."""
    kvgate.wait_until(
        lambda gw: not gw.snapshot().known and not gw.snapshot().settles_soon,
        what="the budget unknown past renewal",
    )
    response = httpx.post(f"{kvgate.url}/v1/completions", json=SMALL, timeout=5)
    assert response.status_code == 503, response.text
    assert response.headers["x-should-retry"] == "true"
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["type"] == "service_unavailable"


def assert_serves(kvgate: Served) -> None:
    poll_until(lambda: readyz(kvgate)[0] == 200, what="the budget to rebuild")
    response = httpx.post(f"{kvgate.url}/v1/completions", json=SMALL, timeout=10)
    assert response.status_code == 200, response.text
    kvgate.wait_until(gateway_idle, what="the ledger to balance")


@pytest.mark.parametrize(
    ("faults", "reason"),
    [
        pytest.param({"metrics_delay_s": 0.6}, "timed out waiting for the response headers", id="slow"),
        pytest.param({"metrics_mode": "malformed"}, "malformed", id="malformed"),
        pytest.param({"metrics_mode": "missing", "metrics_status": 404}, "404", id="missing-404"),
        pytest.param({"metrics_mode": "missing", "metrics_status": 500}, "500", id="missing-500"),
        pytest.param({"omit_cache_config_info": True}, "cache_config_info", id="no-cache-config-info"),
    ],
)
def test_unusable_metrics_mean_saturated_until_sane_again(
    kvgate: Served, sim: SimServer, faults: dict[str, Any], reason: str
) -> None:
    assert_serves(kvgate)
    set_faults(sim.url, **faults)
    poll_until(lambda: readyz(kvgate)[0] == 503, what="/readyz to turn false")
    _, why = readyz(kvgate)
    assert "stale" in why
    assert reason in why  # the last error is named
    assert_refused_as_unknown(kvgate)
    assert httpx.get(f"{kvgate.url}/healthz", timeout=5).status_code == 200  # alive all along
    clear_faults(sim.url)
    assert_serves(kvgate)


def test_slow_metrics_within_the_timeout_keep_the_budget_fresh(sim: SimServer) -> None:
    with served_gateway(sim.url, metrics_timeout_s=0.5, metrics_stale_after_s=1.0) as kvgate:
        set_faults(sim.url, metrics_delay_s=0.15)
        kvgate.wait_until(lambda gw: gw.poller.failures == 0 and gw.snapshot().age_s is not None)
        for _ in range(5):
            assert httpx.post(f"{kvgate.url}/v1/completions", json=SMALL, timeout=10).status_code == 200
        assert budget_state(kvgate) == "fresh"
        assert kvgate.call(lambda: kvgate.gateway.poller.failures) == 0


def test_a_scrape_late_past_staleness_but_within_its_time_limit_queues_arrivals(sim: SimServer) -> None:
    """Each scrape takes 0.35 s of the 0.5 s a reading stays fresh, so the budget is stale for
    a while before each one lands: arrivals then wait for it in the queue, none is refused."""
    with served_gateway(
        sim.url, metrics_poll_interval_s=0.05, metrics_stale_after_s=0.5, metrics_timeout_s=1.5
    ) as kvgate:
        set_faults(sim.url, metrics_delay_s=0.35)
        kvgate.wait_until(lambda gw: gw.poller.failures == 0 and gw.snapshot().age_s is not None)
        # The state is sampled beside the requests, not between them: a request that waits
        # for a scrape to land would otherwise lock the samples to the moments just after one.
        states: list[str] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                states.append(budget_state(kvgate))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        statuses = []
        try:
            for _ in range(40):
                statuses.append(
                    httpx.post(f"{kvgate.url}/v1/completions", json=SMALL, timeout=10).status_code
                )
                time.sleep(0.03)
        finally:
            done.set()
            sampler.join()
        assert "stale" in states, "the budget was never stale: the test proved nothing"
        assert statuses == [200] * 40
        assert kvgate.call(lambda: kvgate.gateway.poller.failures) == 0
        # A scrape that fails makes arrivals 503 again at once.
        set_faults(sim.url, metrics_delay_s=0.0, metrics_mode="malformed")
        kvgate.wait_until(
            lambda gw: gw.snapshot().state is BudgetState.STALE and gw.poller.failures > 0,
            what="a failed scrape and the budget stale",
        )
        assert_refused_as_unknown(kvgate)
        clear_faults(sim.url)
        assert_serves(kvgate)


def test_an_arrival_after_a_scrape_too_slow_waits_for_the_next_instead_of_a_503(sim: SimServer) -> None:
    """One scrape times out (the backend, or the gateway, busy for a moment): the budget is
    unknown, but an arrival waits for a later scrape rather than being refused; only
    `backend_down_after_failures` slow scrapes in a row refuse arrivals."""
    with (
        served_gateway(
            sim.url,
            metrics_poll_interval_s=0.05,
            metrics_stale_after_s=0.5,
            metrics_timeout_s=1.0,
            backend_down_after_failures=3,
        ) as kvgate,
        ThreadPoolExecutor(1) as pool,
    ):
        kvgate.wait_until(lambda gw: gw.poller.failures == 0 and gw.snapshot().known)
        set_faults(sim.url, metrics_delay_s=2.0)
        kvgate.wait_until(lambda gw: gw.poller.failures == 1, what="one scrape timed out")
        assert budget_state(kvgate) == "stale"
        # It serves, a moment late: /readyz keeps the load balancer sending.
        status, why = readyz(kvgate)
        assert status == 200, why
        assert "may renew" in why
        arrival = pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=SMALL, timeout=30)
        kvgate.wait_until(lambda gw: len(gw.queue) == 1 or arrival.done(), what="the arrival queued")
        clear_faults(sim.url)
        answer = arrival.result(timeout=30)
        assert answer.status_code == 200, answer.text
        assert int(answer.headers["x-kvgate-queue-ms"]) > 0
        assert_serves(kvgate)


def test_queued_requests_wait_while_unknown_and_are_admitted_when_sane(
    kvgate: Served, sim: SimServer
) -> None:
    with ThreadPoolExecutor(3) as pool:
        hogs = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=HOG, timeout=60) for _ in range(2)
        ]
        kvgate.wait_until(lambda gw: gw.ledger.totals().entries == 2, what="both hogs admitted")
        third = pool.submit(
            httpx.post, f"{kvgate.url}/v1/completions", json={**HOG, "max_tokens": 200}, timeout=60
        )
        kvgate.wait_until(lambda gw: len(gw.queue) == 1, what="the third to queue")
        set_faults(sim.url, metrics_mode="malformed")
        poll_until(lambda: budget_state(kvgate) == "stale", what="the budget to go stale")
        # The hogs finish while the budget is unknown: their blocks free up, yet nobody is
        # admitted into a pool kvgate cannot see.
        assert [hog.result(timeout=30).status_code for hog in hogs] == [200, 200]
        assert kvgate.call(lambda: len(kvgate.gateway.queue)) == 1
        assert kvgate.call(lambda: kvgate.gateway.ledger.totals().entries) == 0
        clear_faults(sim.url)
        assert third.result(timeout=30).status_code == 200
    kvgate.wait_until(gateway_idle, what="the ledger to balance")


def test_frozen_metrics_do_not_let_the_gateway_over_admit(kvgate: Served, sim: SimServer) -> None:
    """A wedged exporter repeats its last text (taken here while idle: no KV in use). Trusting
    it would make every settled request look free and admit far past the pool. kvgate gives no
    credit to requests the engine shows no sign of working on, and once requests have been in
    flight for `metrics_stale_after_s` without the engine-step counter moving, it calls the
    metrics frozen: unknown, so saturated."""
    assert_serves(kvgate)
    set_faults(sim.url, metrics_mode="stale")
    most = [0]

    def admitted() -> int:
        count: int = kvgate.call(lambda: kvgate.gateway.ledger.totals().entries)
        most[0] = max(most[0], count)
        return count

    body = {**HOG, "max_tokens": 400}  # 13 blocks: four fit in the pool at once
    with ThreadPoolExecutor(8) as pool:
        pending = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=body, timeout=60) for _ in range(8)
        ]
        # Noticed while the first four run (about 2 s each).
        # A scrape that fails otherwise on a loaded machine may be the last error for a moment:
        # what counts is that the frozen text ends up called frozen, never trusted.
        poll_until(
            lambda: admitted() >= 0 and "frozen" in readyz(kvgate)[1], what="the metrics to be called frozen"
        )
        assert readyz(kvgate)[0] == 503
        assert_refused_as_unknown(kvgate)
        assert kvgate.call(lambda: len(kvgate.gateway.queue)) == 4  # the rest wait, unadmitted
        # While the metrics were frozen, nothing was admitted past the pool.
        assert most[0] <= 4, f"{most[0]} requests of 13 blocks admitted into a pool of 63"
        clear_faults(sim.url)
        # Live metrics again: the queue drains (with room vLLM shows, the overcommit may now
        # admit past the reservations' sum, as it should).
        while not all(p.done() for p in pending):
            admitted()
        assert [p.result().status_code for p in pending] == [200] * 8
    assert_serves(kvgate)


@pytest.fixture
def strict_kvgate(sim: SimServer) -> Iterator[Served]:
    # No overcommit: the hogs below really grow to their reservations, and what is checked is
    # that the budget follows the pool vLLM reports, not how far unused room may stretch it.
    with served_gateway(sim.url, metrics_timeout_s=0.2, budget_overcommit=0.0) as served:
        yield served


def test_a_restarted_backend_with_another_pool_is_followed(strict_kvgate: Served, sim: SimServer) -> None:
    kvgate = strict_kvgate
    assert kvgate.call(lambda: kvgate.gateway.snapshot().total_blocks) == 63

    def most_admitted_of_two_hogs() -> int:
        most = 0
        with ThreadPoolExecutor(2) as pool:
            hogs = [
                pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=HOG, timeout=60)
                for _ in range(2)
            ]
            while not all(hog.done() for hog in hogs):
                most = max(most, kvgate.call(lambda: kvgate.gateway.ledger.totals().entries))
            assert [hog.result().status_code for hog in hogs] == [200, 200]
        return most

    # vLLM comes back with a smaller pool (39 usable blocks): one hog of 30 at a time.
    httpx.post(f"{sim.url}/sim/restart", json={"num_blocks": 40}, timeout=5).raise_for_status()
    kvgate.wait_until(lambda gw: gw.snapshot().total_blocks == 39, what="the smaller pool")
    assert most_admitted_of_two_hogs() == 1
    assert sim_state(sim.url)["num_preemptions_total"] == 0, sim_state(sim.url)
    # And back to the larger one: both at once again.
    httpx.post(f"{sim.url}/sim/restart", json={"num_blocks": 64}, timeout=5).raise_for_status()
    kvgate.wait_until(lambda gw: gw.snapshot().total_blocks == 63, what="the pool back to its size")
    assert most_admitted_of_two_hogs() == 2
    assert sim_state(sim.url)["num_preemptions_total"] == 0, sim_state(sim.url)
    kvgate.wait_until(gateway_idle, what="the ledger to balance")


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileMetrics]:
    with hostile_metrics() as server:
        yield server


@pytest.fixture(scope="module")
def guarded(hostile: HostileMetrics) -> Iterator[Served]:
    # Each scrape gets 3 s in all (enough for 16 MiB on a loaded machine); the trickle's bytes
    # come every 0.1 s, so no single read ever waits long enough to time out.
    with served_gateway(hostile.url, metrics_timeout_s=3.0) as served:
        yield served


def scrape_failures(kvgate: Served) -> float:
    text = httpx.get(f"{kvgate.url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("kvgate_backend_scrape_failures_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


HOSTILE = [
    pytest.param("trickle", None, "timed out reading the body", id="trickle"),
    pytest.param("huge", None, "larger than 16777216 bytes", id="100-MB"),
    pytest.param("huge-declared", None, "larger than 16777216 bytes (104857600)", id="100-MB-declared"),
    pytest.param("cut", None, "RemoteProtocolError", id="closed-mid-body"),
    pytest.param("garbage", None, "cache_config_info", id="binary-garbage"),
    pytest.param("html", None, "text/html, not Prometheus text", id="html"),
    pytest.param("html-as-text", None, "cache_config_info", id="html-as-text-plain"),
    pytest.param("gzip", None, "compressed (gzip)", id="gzip"),
    pytest.param(
        "absurd", (r'num_gpu_blocks="64"', 'num_gpu_blocks="1e308"'), "num_gpu_blocks", id="blocks-1e308"
    ),
    pytest.param(
        "absurd", (r'num_gpu_blocks="64"', f'num_gpu_blocks="{2**70}"'), "num_gpu_blocks", id="blocks-2**70"
    ),
    pytest.param(
        "absurd",
        (r'kv_cache_size_tokens="2048"', 'kv_cache_size_tokens="inf"'),
        "kv_cache_size_tokens",
        id="tokens-inf",
    ),
    pytest.param("absurd", (r'block_size="32"', 'block_size="0"'), "block_size", id="block-size-0"),
    pytest.param("absurd", (r'block_size="32"', 'block_size="32.5"'), "block_size", id="block-size-32.5"),
    pytest.param(
        "absurd",
        (r"(vllm:kv_cache_usage_perc\{[^}]*\}) \S+", r"\1 +Inf"),
        "vllm:kv_cache_usage_perc",
        id="usage-inf",
    ),
    pytest.param(
        "absurd",
        (r"(vllm:kv_cache_usage_perc\{[^}]*\}) \S+", r"\1 7.5"),
        "vllm:kv_cache_usage_perc",
        id="usage-7.5",
    ),
    pytest.param(
        "absurd",
        (r"(vllm:num_requests_running\{[^}]*\}) \S+", r"\1 1e308"),
        "vllm:num_requests_running",
        id="running-1e308",
    ),
    pytest.param(
        "absurd",
        (r"(vllm:num_preemptions_total\{[^}]*\}) \S+", r"\1 NaN"),
        "vllm:num_preemptions_total",
        id="preemptions-nan",
    ),
    pytest.param(
        "absurd",
        (r"vllm:cache_config_info\{", 'vllm:cache_config_info{junk="' + "x" * (1 << 20) + '",'),
        "a line of vllm:cache_config_info is longer than 16384 bytes",
        id="label-of-a-megabyte",
    ),
]


@pytest.mark.parametrize(("mode", "absurd", "reason"), HOSTILE)
def test_hostile_metrics_mean_saturated_and_the_poller_goes_on(
    guarded: Served, hostile: HostileMetrics, mode: str, absurd: tuple[str, str] | None, reason: str
) -> None:
    hostile.mode = "good"
    poll_until(lambda: readyz(guarded)[0] == 200, what="the budget to be fresh")
    failures = scrape_failures(guarded)
    if absurd is not None:
        hostile.absurd = absurd
    hostile.mode = mode
    poll_until(
        lambda: (lambda answer: answer[0] == 503 and reason in answer[1])(readyz(guarded)),
        what=f"/readyz to turn false naming {reason!r}",
    )
    assert guarded.call(lambda: guarded.gateway.snapshot().known) is False  # unknown: saturated
    assert_refused_as_unknown(guarded)
    assert httpx.get(f"{guarded.url}/healthz", timeout=5).status_code == 200
    assert scrape_failures(guarded) > failures  # counted in kvgate's own metrics
    # The poller goes on: the next good text is read.
    hostile.mode = "good"
    poll_until(lambda: readyz(guarded)[0] == 200, what="the budget to recover")
    assert guarded.call(lambda: guarded.gateway.snapshot().total_blocks) == 63
    assert hostile.url not in readyz(guarded)[1]


def test_a_wide_data_parallel_backend_is_read_off_the_loop(guarded: Served, hostile: HostileMetrics) -> None:
    """40 engines: their lines kvgate reads (52 KB) are parsed in a thread, and summed."""
    config = next(
        line for line in FIXTURE.read_text().splitlines() if line.startswith("vllm:cache_config_info{")
    )
    extra = []
    for engine in range(1, 40):
        extra.append(config.replace('engine="0"', f'engine="{engine}"'))
        extra.append(f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="tiny-llama"}} 0.5')
        extra.append(f'vllm:num_requests_waiting{{engine="{engine}",model_name="tiny-llama"}} 1.0')
    assert len("\n".join(extra)) > INLINE_PARSE_BYTES
    hostile.mode, hostile.extra = "good", "\n".join(extra) + "\n"
    try:
        guarded.wait_until(lambda gw: gw.snapshot().total_blocks == 40 * 63, what="the 40 pools")
        reading = guarded.call(lambda: guarded.gateway.budget.reading)
        assert (reading.engines, reading.waiting) == (40, 39)
        assert reading.used_blocks == pytest.approx(39 * 31.5)
        assert readyz(guarded)[0] == 200
    finally:
        hostile.extra = ""
    guarded.wait_until(lambda gw: gw.snapshot().total_blocks == 63, what="the one pool again")


# -- the poller itself: it survives every failure, and never ends unnoticed --------------------

# kvgate's own defaults, with the short staleness and settling the poller tests wait on.
CAPACITY = replace(
    capacity_config(Settings(backend_url="http://127.0.0.1:1")), stale_after_s=0.5, settle_s=0.05
)


class Fatal(BaseException):
    """Not an Exception: what no `except Exception` takes, so the poller's task ends with it."""


class Scripted:
    """What the poller's parts do on their n-th call (0-based): raise the given exception."""

    def __init__(self, faults: dict[int, BaseException]) -> None:
        self.calls = 0
        self._faults = faults

    def __call__(self) -> None:
        call, self.calls = self.calls, self.calls + 1
        if call in self._faults:
            raise self._faults[call]


class FaultyBudget(KvBudget):
    """A budget whose observe raises on the calls `faults` names (a bug in the closed loop)."""

    def __init__(self, faults: dict[int, BaseException]) -> None:
        super().__init__(CAPACITY, InMemoryLedger())
        self.script = Scripted(faults)

    def observe(
        self, reading: BackendReading, started_at: float, now: float, *, waiting: bool = False
    ) -> Reconciliation | None:
        self.script()
        return super().observe(reading, started_at, now, waiting=waiting)


async def run_poller(
    url: str,
    budget: KvBudget,
    *,
    until: Callable[[list[Reconciliation | None]], bool],
    clock: Callable[[], float] = time.monotonic,
    on_update: Callable[[], None] = lambda: None,
) -> tuple[MetricsPoller, list[Reconciliation | None]]:
    """Run a poller against `url` until `until(results so far)` holds; then stop it."""
    results: list[Reconciliation | None] = []
    done = asyncio.Event()

    def record(result: Reconciliation | None) -> None:
        results.append(result)
        if until(results):
            done.set()
        on_update()

    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(
            client=client,
            url=f"{url}/metrics",
            budget=budget,
            clock=clock,
            interval_s=0.01,
            timeout_s=2.0,
            on_update=record,
        )
        task = asyncio.create_task(poller.run())
        try:
            async with asyncio.timeout(20):
                await done.wait()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return poller, results


def recovered(results: list[Reconciliation | None]) -> bool:
    return None in results and results[-1] is not None


async def test_a_budget_that_raises_is_a_failed_scrape_and_the_poller_goes_on(
    hostile: HostileMetrics,
) -> None:
    hostile.mode = "good"
    budget = FaultyBudget({1: RuntimeError("a bug in the closed loop"), 2: OverflowError("int too large")})
    poller, results = await run_poller(hostile.url, budget, until=recovered)
    assert results[:4] == [results[0], None, None, results[3]]
    assert poller.failures == 2
    assert budget.state(time.monotonic()) is BudgetState.STALE  # stopped by the test: see below
    assert "the metrics poller was stopped" in budget.snapshot(time.monotonic()).detail


async def test_the_last_unforeseen_error_is_what_the_budget_shows(hostile: HostileMetrics) -> None:
    hostile.mode = "good"
    budget = FaultyBudget({n: ZeroDivisionError("division by zero") for n in range(1, 1000)})
    poller, results = await run_poller(hostile.url, budget, until=lambda r: len(r) >= 3)
    assert results[1:] == [None] * (len(results) - 1)
    assert budget.last_error == "unexpected ZeroDivisionError: division by zero"
    assert poller.failures == len(results) - 1


async def test_an_on_update_that_raises_does_not_stop_the_poller(hostile: HostileMetrics) -> None:
    hostile.mode = "good"
    script = Scripted({0: RuntimeError("the queue's pump failed"), 1: KeyError("x")})
    poller, results = await run_poller(
        hostile.url, KvBudget(CAPACITY, InMemoryLedger()), until=lambda r: len(r) >= 4, on_update=script
    )
    assert all(result is not None for result in results)
    assert script.calls >= 4
    assert (poller.failures, poller.update_failures) == (0, 2)


async def test_a_failure_outside_any_scrape_restarts_the_loop(hostile: HostileMetrics) -> None:
    hostile.mode = "good"
    script = Scripted({0: RuntimeError("the clock broke")})  # the loop's first reading of it

    def clock() -> float:
        script()
        return time.monotonic()

    budget = KvBudget(CAPACITY, InMemoryLedger())
    poller, results = await run_poller(hostile.url, budget, until=lambda r: len(r) >= 2, clock=clock)
    assert poller.failures == 1  # counted, then scraped as ever
    assert all(result is not None for result in results)


async def test_a_poller_task_that_dies_anyway_leaves_the_budget_unknown_saying_why(
    hostile: HostileMetrics,
) -> None:
    hostile.mode = "good"
    budget = FaultyBudget({2: Fatal("out of everything")})
    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(
            client=client,
            url=f"{hostile.url}/metrics",
            budget=budget,
            clock=time.monotonic,
            interval_s=0.01,
            timeout_s=2.0,
            on_update=lambda _: None,
        )
        task = asyncio.create_task(poller.run())
        with pytest.raises(Fatal):
            await task
    snapshot = budget.snapshot(time.monotonic())
    assert (snapshot.state, snapshot.known) == (BudgetState.STALE, False)
    assert "the metrics poller died: Fatal: out of everything" in snapshot.detail


def test_a_gateway_whose_poller_stopped_is_not_ready_and_says_so(hostile: HostileMetrics) -> None:
    hostile.mode = "good"
    with served_gateway(hostile.url) as kvgate:
        poll_until(lambda: readyz(kvgate)[0] == 200, what="the budget to be fresh")

        def stop_the_poller() -> None:
            for task in asyncio.all_tasks():
                if task.get_name().startswith("kvgate-metrics-"):
                    task.cancel()

        kvgate.call(stop_the_poller)
        poll_until(lambda: readyz(kvgate)[0] == 503, what="/readyz to turn false")
        assert "the metrics poller was stopped" in readyz(kvgate)[1]
        assert_refused_as_unknown(kvgate)
