"""One backend of a fleet dies (SIGKILL of its emulator's process) and comes back.

What must happen: the streams in flight on it end with a well-formed SSE error event; nothing
queued is lost, it goes to the survivor; every reservation is released on both; kvgate stays
ready on the survivor; and when the dead one is back it is given requests again.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import LONG_STREAM, SLOW_STEPS, Served, SimProcess, served_gateway, sse_events

from gateway.router import Router
from sim.config import SimConfig

# Two of these fill the testbed-shaped pool (30 of 63 blocks each): whatever comes next waits.
HOG = {**LONG_STREAM, "prompt": "a", "max_tokens": 950}
SMALL = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture
def pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    sims = (SimProcess(SimConfig(engine=SLOW_STEPS)), SimProcess(SimConfig(engine=SLOW_STEPS)))
    for sim in sims:
        sim.start()
    try:
        yield sims
    finally:
        for sim in sims:
            sim.stop()


def stream_all(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        return response.status_code, sse_events("".join(response.iter_text()))


def entries(kvgate: Served, name: str) -> int:
    def count() -> int:
        router: Router = kvgate.app.state.kvgate
        return router.backend(name).ledger.totals().entries

    result: int = kvgate.call(count)
    return result


def served_by(kvgate: Served) -> Counter[str]:
    def latest() -> Counter[str]:
        router: Router = kvgate.app.state.kvgate
        return Counter(s.backend for s in router.recent.latest() if s.outcome.value == "completed")

    result: Counter[str] = kvgate.call(latest)
    return result


def test_a_killed_backend_hands_its_queue_to_the_survivor_and_is_used_again_when_back(
    pair: tuple[SimProcess, SimProcess],
) -> None:
    a, b = pair
    with (
        served_gateway(None, backends=[f"a={a.url}", f"b={b.url}"], budget_overcommit=0) as kvgate,
        ThreadPoolExecutor(12) as pool,
    ):
        hogs = [pool.submit(stream_all, kvgate.url, HOG) for _ in range(4)]
        kvgate.wait_until(
            lambda gw: all(b.ledger.totals().entries == 2 for b in gw.router.backends),
            timeout_s=20,
            what="two hogs on each backend",
        )
        queued: list[Future[httpx.Response]] = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=SMALL, timeout=60) for _ in range(4)
        ]
        kvgate.wait_until(lambda gw: len(gw.queue) == 4, what="four requests queued")

        b.kill()

        outcomes = [hog.result(timeout=60) for hog in hogs]
        broken = [events for _, events in outcomes if events[-1] != "[DONE]"]
        assert len(broken) == 2, "the two streams on the killed backend end in an error"
        for events in broken:
            error = json.loads(events[-1])["error"]
            assert error["type"] == "upstream_error"
            assert error["code"] == 502
        assert all(status == 200 for status, _ in outcomes)
        for waiting in queued:
            response = waiting.result(timeout=60)
            assert response.status_code == 200, response.text
        assert served_by(kvgate)["a"] == 2 + 4  # its own hogs and the whole queue
        kvgate.wait_until(
            lambda gw: all(b.ledger.totals().entries == 0 for b in gw.router.backends) and not gw.inflight,
            what="every reservation released",
        )
        assert httpx.get(f"{kvgate.url}/readyz", timeout=5).status_code == 200  # the survivor

        b.start()  # the same port, a fresh engine
        kvgate.wait_until(lambda gw: gw.router.backend("b").readiness()[0], timeout_s=20, what="b back")
        before = served_by(kvgate)["b"]
        answers = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=SMALL, timeout=60) for _ in range(4)
        ]
        assert [f.result(timeout=60).status_code for f in answers] == [200] * 4
        assert served_by(kvgate)["b"] > before
        assert entries(kvgate, "a") == 0
        assert entries(kvgate, "b") == 0


def test_the_fleet_benchmark_runs_end_to_end_at_a_small_scale(tmp_path: Path) -> None:
    """tests/benchmarks/fleet_scale.py, small: every stream answered in full, every token the
    emulators generated counted by the clients, the ledgers empty, both backends used."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fleet_scale

    out = tmp_path / "fleet.json"
    code = fleet_scale.main(
        ["--backends", "2", "--concurrency", "40", "--requests", "240", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    assert code == 0, result
    assert result["ok"] == 240
    assert result["tokens_counted"] == result["tokens_generated"] == 240 * 16
    assert set(result["share"]) == {"sim0", "sim1"}
    assert all(0.2 <= share <= 0.8 for share in result["share"].values()), result["share"]
