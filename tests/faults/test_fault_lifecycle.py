"""A real `kvgate serve` process: SIGTERM drains and exits 0; SIGHUP and POST /admin/reload
apply new settings without dropping a request.

SIGTERM: /readyz turns false at once, the queue is answered 503 + Retry-After, new arrivals
too, streams in flight run to their end within the grace period (one that would outlast it is
cut when it ends), every request is concluded exactly once (one request log line each), and
the process exits 0.

Reload: the settings that may change at run time (gateway.settings.RELOADABLE_SETTINGS) take
effect for new requests; streams in flight and queued requests go on untouched; a setting that
needs a restart is reported and kept; invalid settings are refused whole.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import (
    LONG_STREAM,
    SLOW_STEPS,
    KvgateProcess,
    SimProcess,
    kvgate_process,
    ledger_balanced,
    poll_until,
    sim_process,
    sse_events,
    start_kvgate,
)

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost

# 13 blocks each (2 prompt + 400 output tokens, 32 a block): four fill 52 of the 63 blocks, so
# a fifth must queue. At 5 ms a step each stream runs about 2 s, at 20 ms about 8 s.
STREAM = {**LONG_STREAM, "prompt": "a", "max_tokens": 400}
QUEUED = {**STREAM, "stream": False}


# The reload test queues two requests and reloads while the four streams run: at 20 ms a step
# (about 8 s a stream) the streams outlast those steps on a loaded machine, where at 5 ms one
# ended first and let a queued request in before both were seen queued.
SLOWER_STEPS = EngineConfig(
    step_cost=StepCost(base_s=0.02, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0)
)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with sim_process(SimConfig(engine=SLOW_STEPS)) as process:
        yield process


@pytest.fixture
def slower_sim() -> Iterator[SimProcess]:
    with sim_process(SimConfig(engine=SLOWER_STEPS)) as process:
        yield process


def stream_to_end(url: str, body: dict[str, Any]) -> tuple[int, list[str], str | None]:
    """Status, data events and the transport error that ended the stream, if one did."""
    text = ""
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as response,
        ):
            for chunk in response.iter_text():
                text += chunk
            return response.status_code, sse_events(text), None
    except httpx.TransportError as exc:
        return 200, sse_events(text), type(exc).__name__


def request_lines(kvgate: KvgateProcess) -> list[dict[str, Any]]:
    lines = []
    for line in kvgate.output().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("logger") == "kvgate.requests":
                lines.append(record)
    return lines


def admitted(kvgate: KvgateProcess) -> int:
    entries: int = kvgate.state()["backends"][0]["ledger"]["entries"]
    return entries


def queued(kvgate: KvgateProcess) -> int:
    return sum(kvgate.state()["backends"][0]["queue"]["depth"].values())


def test_sigterm_drains_and_exits_cleanly(sim: SimProcess, tmp_path: Path) -> None:
    kvgate = start_kvgate(
        sim.url,
        tmp_path / "kvgate.log",
        # No overcommit: the requests behind the four streams must wait, not be let in on room.
        settings={
            "shutdown_delay_s": 1.0,
            "shutdown_grace_s": 2,
            "log_level": "info",
            "log_format": "json",
            "budget_overcommit": 0,
        },
    )
    try:
        with ThreadPoolExecutor(8) as pool:
            # Three short streams (8 blocks, about 1.25 s each) and one that cannot finish within
            # the grace period (30 blocks, about 4.75 s): 54 of 63 blocks, so QUEUED must wait.
            short = {**STREAM, "max_tokens": 250}
            streams = [pool.submit(stream_to_end, kvgate.url, short) for _ in range(3)]
            too_long = pool.submit(stream_to_end, kvgate.url, {**STREAM, "max_tokens": 950, "prompt": "b"})
            poll_until(lambda: admitted(kvgate) == 4, what="four streams admitted")
            waiting: list[Future[httpx.Response]] = [
                pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=QUEUED, timeout=30)
                for _ in range(2)
            ]
            poll_until(lambda: queued(kvgate) == 2, what="two requests queued")

            signalled = time.monotonic()
            kvgate.process.send_signal(signal.SIGTERM)
            for response in (w.result(timeout=10) for w in waiting):
                assert response.status_code == 503
                assert response.headers["x-should-retry"] == "true"
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["code"] == "shutting_down"
            assert time.monotonic() - signalled < 1.0, "the queue was not answered at once"
            ready = httpx.get(f"{kvgate.url}/readyz", timeout=5)
            assert (ready.status_code, ready.json()["reason"]) == (503, "shutting down")
            late = httpx.post(f"{kvgate.url}/v1/completions", json=QUEUED, timeout=5)
            assert late.status_code == 503
            assert "retry-after" in late.headers

            for stream in streams:  # in flight at the signal: run to their end
                status, events, broken = stream.result(timeout=30)
                assert (status, broken, events[-1]) == (200, None, "[DONE]")
            _, events, broken = too_long.result(timeout=30)
            # Cut at the end of the grace period.
            assert broken is not None
            assert events[-1] != "[DONE]"
        assert kvgate.process.wait(timeout=30) == 0
        took = time.monotonic() - signalled
        assert took < 1.0 + 2 + 2.0, f"exited {took:.1f} s after SIGTERM"
    finally:
        kvgate.stop(signal.SIGKILL)
    lines = request_lines(kvgate)
    outcomes = sorted(line["outcome"] for line in lines)
    # Every request concluded exactly once: 3 completed, 1 cut, 3 refused (2 queued, 1 late).
    assert len({line["request_id"] for line in lines}) == len(lines) == 7
    assert outcomes.count("completed") == 3
    assert outcomes.count("shed_unavailable") == 3
    assert outcomes.count("client_gone") + outcomes.count("upstream_error") == 1


def write_config(path: Path, **values: Any) -> None:
    path.write_text("".join(f"{name} = {toml_value(value)}\n" for name, value in values.items()))


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {toml_value(inner)}" for key, inner in value.items()) + " }"
    return json.dumps(value)


def normal_queue(size: int) -> dict[str, dict[str, int]]:
    return {"normal": {"queue_max": size}}


def normal_queue_max(state: dict[str, Any]) -> int:
    return int(state["settings"]["priority_classes"]["normal"]["queue_max"])


def test_sighup_and_admin_reload_apply_settings_without_dropping_requests(
    slower_sim: SimProcess, tmp_path: Path
) -> None:
    config = tmp_path / "kvgate.toml"
    write_config(config, priority_classes=normal_queue(8), output_quantile=0.9, first_byte_timeout_s=300.0)
    with (
        # No overcommit: the requests behind the four streams must wait, not be let in on room.
        kvgate_process(
            slower_sim.url, tmp_path / "kvgate.log", config_file=config, settings={"budget_overcommit": 0}
        ) as kvgate,
        ThreadPoolExecutor(8) as pool,
    ):
        streams = [pool.submit(stream_to_end, kvgate.url, STREAM) for _ in range(4)]
        poll_until(lambda: admitted(kvgate) == 4, what="four streams admitted")
        waiting = [
            pool.submit(httpx.post, f"{kvgate.url}/v1/completions", json=QUEUED, timeout=60) for _ in range(2)
        ]
        poll_until(lambda: queued(kvgate) == 2, what="two requests queued")

        # SIGHUP: a zero-length queue, another quantile; a new backend URL needs a restart.
        write_config(
            config, priority_classes=normal_queue(0), output_quantile=0.5, first_byte_timeout_s=300.0
        )
        kvgate.process.send_signal(signal.SIGHUP)
        poll_until(lambda: normal_queue_max(kvgate.state()) == 0, what="the reload")
        state = kvgate.state()
        assert state["settings"]["output_quantile"] == 0.5
        assert state["backends"][0]["output_model"]["quantile"] == 0.5
        # New arrivals that would have to wait are shed at once now...
        shed = httpx.post(f"{kvgate.url}/v1/completions", json=QUEUED, timeout=10)
        assert shed.status_code == 429
        assert shed.json()["error"]["code"] == "queue_full"
        # ...while everything already in flight or queued goes on to the end.
        for stream in streams:
            status, events, broken = stream.result(timeout=30)
            assert (status, broken, events[-1]) == (200, None, "[DONE]")
        assert [w.result(timeout=30).status_code for w in waiting] == [200, 200]

        # The admin call does the same and reports what it did.
        write_config(
            config,
            priority_classes=normal_queue(5),
            output_quantile=0.5,
            first_byte_timeout_s=300.0,
            tokenizer_threads=3,
        )
        answer = httpx.post(f"{kvgate.url}/admin/reload", headers=kvgate.admin_headers(), timeout=10)
        assert answer.status_code == 200
        assert answer.json() == {
            "applied": ["priority_classes"],
            "needs_restart": ["tokenizer_threads"],
            "error": None,
        }
        assert kvgate.state()["settings"]["tokenizer_threads"] == 2  # kept until a restart
        # Invalid settings are refused whole; the running ones stay.
        write_config(config, priority_classes=normal_queue(-1), output_quantile=7)
        refused = httpx.post(f"{kvgate.url}/admin/reload", headers=kvgate.admin_headers(), timeout=10)
        assert refused.status_code == 400
        assert "priority_classes.normal.queue_max" in refused.json()["error"]
        assert normal_queue_max(kvgate.state()) == 5
        # A reload needs the admin token like the rest of the admin API.
        assert httpx.post(f"{kvgate.url}/admin/reload", timeout=10).status_code == 401
        poll_until(lambda: ledger_balanced(kvgate.state()), what="the ledger to balance")
        assert kvgate.process.poll() is None  # SIGHUP did not stop it
