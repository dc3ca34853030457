"""A real Prometheus, configured by deploy/prometheus/ (only targets and intervals replaced),
scrapes `kvgate serve` (run as the container runs it: a process configured by KVGATE_*
variables) in front of the vLLM emulator under load, the emulator's own /metrics, and a second
kvgate whose backend is down. Every PromQL expression of every dashboard panel,
template variable and alert rule must then parse and return data, and so must every single
selector inside them (which catches a misspelled label hidden by an `or`); every alert must
become active, each through the situation it is about:

- the queue grows (clients ramp up faster than the pool frees blocks);
- kvgate sheds (a 2-request low-priority queue, and requests with a 400 ms deadline);
- vLLM preempts despite kvgate (bursts of long requests sent to the emulator directly);
- a backend is down and its metrics are stale, and a scrape target is down (the second
  kvgate's backend is a port nobody listens on; Prometheus scrapes that port as a vLLM).

Needs /usr/bin/prometheus (Debian package `prometheus`, installed by `.ci/run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_files import (
    ALERT_RULES,
    PROMETHEUS_CONFIG,
    Query,
    alert_rules,
    dashboard_queries,
    load_yaml,
    require_tool,
    rule_queries,
    selectors,
    variable_queries,
)

from gateway.settings import ENV_PREFIX
from sim.config import SimConfig
from sim.lengths import OutputLengthModel
from sim.testing import running_sim

SCRAPE_INTERVAL = "1s"
STARTUP_TIMEOUT_S = 20.0
# Long enough for rate() windows to fill and every alert condition to come about, with room
# for a slow shared machine; a healthy run finishes in about 15 s.
DATA_TIMEOUT_S = 45.0
POLL_INTERVAL_S = 0.5

LIVE_BACKEND = "sim"
DOWN_BACKEND = "down"
CLIENTS = 14
RAMP_STEP_S = 0.4
PRIORITIES = ("high", "normal", "low")
# Raising priority to high takes the priority token (see gateway.client_hints).
PRIORITY_TOKEN = "deploy-priority-token"
PROMPT = "word " * 150
GATEWAY_MAX_TOKENS = 64
# Bursts sent straight to the emulator, around kvgate: 5 x (60 + 400) tokens overflow the
# 2,048-token pool by themselves, so vLLM preempts whatever kvgate does.
BYPASS_BURST = 5
BYPASS_MAX_TOKENS = 400
BYPASS_PAUSE_S = 1.0


# -- servers ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _closed_port() -> Iterator[int]:
    """A port that refuses connections: bound (so nobody else takes it) but not listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@contextlib.contextmanager
def _kvgate_serve(settings: dict[str, str], log_path: Path, *, ready: bool) -> Iterator[str]:
    """`kvgate serve` in a child process, configured only by KVGATE_* variables as in the
    container; yields its base URL once it answers /healthz (and /readyz, with `ready`)."""
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith(ENV_PREFIX)}
    env.update({f"{ENV_PREFIX}{key.upper()}": value for key, value in settings.items()})
    env.update(
        KVGATE_HOST="127.0.0.1",
        KVGATE_PORT=str(port),
        KVGATE_LOG_LEVEL="warning",
        KVGATE_PRIORITY_TOKEN=PRIORITY_TOKEN,
        # As in the image: tokenizers come from local files only (the emulator's model name
        # is no local folder, so kvgate falls back on estimating prompt tokens).
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        path = "/readyz" if ready else "/healthz"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"kvgate serve exited: {log_path.read_text()[-2000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + path, timeout=1.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, (
                f"kvgate serve: no 200 on {path}: {log_path.read_text()[-2000:]}"
            )
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _prometheus_config(tmp: Path, kvgate: list[str], vllm: dict[str, str | None]) -> Path:
    """deploy/prometheus/prometheus.yml with the test's targets and 1 s intervals.

    `vllm` maps host:port -> the backend name kvgate gives it. Targets without a name are one
    group as in the real configuration (its relabel rule labels each with its address, kvgate's
    default name); a named one gets a group of its own labelled with its name, as the
    configuration says to do for a backend named in KVGATE_BACKENDS."""
    config = load_yaml(PROMETHEUS_CONFIG)
    config["global"].update(
        scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL, evaluation_interval=SCRAPE_INTERVAL
    )
    config["rule_files"] = [str(ALERT_RULES)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvgate", "vllm"}, f"unexpected scrape jobs {sorted(jobs)}"
    jobs["kvgate"]["static_configs"] = [{"targets": kvgate}]
    (template,) = jobs["vllm"]["static_configs"]
    labels = template.get("labels", {})
    unnamed = [target for target, name in vllm.items() if name is None]
    groups = [{"targets": unnamed, "labels": labels}] if unnamed else []
    groups += [
        {"targets": [target], "labels": {**labels, "backend": name}}
        for target, name in vllm.items()
        if name is not None
    ]
    jobs["vllm"]["static_configs"] = groups
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def _prometheus(config: Path, tmp: Path) -> Iterator[str]:
    binary = require_tool("prometheus")
    port = _free_port()
    log_path = tmp / "prometheus.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"prometheus exited: {log_path.read_text()[-2000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"prometheus not ready: {log_path.read_text()[-2000:]}"
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- load ---------------------------------------------------------------------------------


class Load:
    """Traffic through kvgate (ramping clients, mixed priorities, some with tight deadlines)
    and, around it, bursts of long requests straight to the emulator. Runs its own event
    loop in a thread until the context exits."""

    def __init__(self, kvgate_url: str, sim_url: str, model: str) -> None:
        self._kvgate = kvgate_url
        self._sim = sim_url
        self._model = model
        self.statuses: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        assert self._started.wait(STARTUP_TIMEOUT_S)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the load generator did not stop"

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        limits = httpx.Limits(max_connections=CLIENTS + BYPASS_BURST + 4)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
            tasks = [asyncio.create_task(self._bypass(client))]
            for index in range(CLIENTS):
                tasks.append(asyncio.create_task(self._client(client, index)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), RAMP_STEP_S)
            await self._stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        priority = PRIORITIES[index % len(PRIORITIES)]
        for n in range(1_000_000):
            headers = {"x-kvgate-priority": priority, "x-kvgate-priority-token": PRIORITY_TOKEN}
            if n % 4 == 3:
                headers["x-kvgate-deadline-ms"] = "400"
            body = {
                "model": self._model,
                "prompt": PROMPT,
                "max_tokens": GATEWAY_MAX_TOKENS,
                "stream": n % 2 == 0,
            }
            try:
                async with client.stream(
                    "POST", f"{self._kvgate}/v1/completions", json=body, headers=headers
                ) as r:
                    async for _ in r.aiter_raw():
                        pass
                    self.statuses[f"kvgate {r.status_code}"] += 1
                    shed = r.status_code in (429, 503)
            except httpx.HTTPError as exc:
                self.statuses[f"kvgate {type(exc).__name__}"] += 1
                shed = True
            if shed:
                # A shed client backs off as the OpenAI SDK would, instead of spinning.
                await asyncio.sleep(0.2)

    async def _bypass(self, client: httpx.AsyncClient) -> None:
        body = {
            "model": self._model,
            "prompt": "word " * 60,
            "max_tokens": BYPASS_MAX_TOKENS,
            "ignore_eos": True,
        }
        while True:
            answers = await asyncio.gather(
                *(client.post(f"{self._sim}/v1/completions", json=body) for _ in range(BYPASS_BURST)),
                return_exceptions=True,
            )
            for answer in answers:
                key = answer.status_code if isinstance(answer, httpx.Response) else type(answer).__name__
                self.statuses[f"bypass {key}"] += 1
            await asyncio.sleep(BYPASS_PAUSE_S)


# -- Prometheus's HTTP API -----------------------------------------------------------------


def _api(client: httpx.Client, url: str, path: str, **params: str) -> Any:
    response = client.get(f"{url}/api/v1/{path}", params=params, timeout=10.0)
    body = response.json()
    if body.get("status") != "success":
        raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def _has_data(data: dict[str, Any], *, finite: bool) -> bool:
    """Non-empty; with `finite`, at least one sample is a number (not NaN or Inf)."""
    if data["resultType"] in ("scalar", "string"):
        return True
    values: list[str] = []
    for series in data["result"]:
        if "value" in series:
            values.append(series["value"][1])
        values.extend(v for _, v in series.get("values", []))
    if not finite:
        return bool(values)
    return any(math.isfinite(float(v)) for v in values)


def _checks(queries: list[Query], *, finite: bool = True) -> dict[str, tuple[str, bool]]:
    """Every expression to run -> (where it comes from, whether it needs a finite value):
    each query (finite as asked) and every selector inside it (any value)."""
    checks: dict[str, tuple[str, bool]] = {}
    for query in queries:
        checks.setdefault(query.expr, (query.origin, finite))
        for selector in selectors(query.expr):
            checks.setdefault(selector.text, (f"selector in {query.origin}", False))
    return checks


def _per_backend(queries: list[Query]) -> dict[str, str]:
    """The queries that show one series per backend from kvgate's own series alone -> where
    they come from. Every backend kvgate has must appear in each (kvgate exports its series
    from the start); vLLM's series exist only for a vLLM that Prometheus reaches."""
    return {
        query.expr: query.origin
        for query in queries
        if re.search(r"\bby \(backend\b", query.expr)
        and all(selector.metric.startswith("kvgate_") for selector in selectors(query.expr))
    }


def _backends_in(result: list[dict[str, Any]]) -> set[str]:
    return {series["metric"]["backend"] for series in result if "backend" in series["metric"]}


def _vllm_target_backends(client: httpx.Client, prometheus: str) -> dict[str, str]:
    """host:port -> the `backend` label Prometheus gave each vllm target."""
    targets = _api(client, prometheus, "targets")["activeTargets"]
    return {
        target["discoveredLabels"]["__address__"]: target["labels"].get("backend", "")
        for target in targets
        if target["labels"].get("job") == "vllm"
    }


# -- the tests ------------------------------------------------------------------------------


def test_every_panel_and_rule_returns_data_from_a_live_kvgate(tmp_path: Path) -> None:
    require_tool("prometheus")
    sim_config = SimConfig(output_len=OutputLengthModel.parse(f"uniform:1:{GATEWAY_MAX_TOKENS}"))
    checks = _checks(dashboard_queries() + variable_queries() + rule_queries())
    per_backend = _per_backend(dashboard_queries() + variable_queries())
    assert per_backend, "no panel shows kvgate's series per backend"
    alerts = {rule["alert"] for rule in alert_rules()}

    with contextlib.ExitStack() as stack:
        sim_url = stack.enter_context(running_sim(sim_config))
        dead_port = stack.enter_context(_closed_port())
        live = {
            "backend_url": sim_url,
            "backend_name": LIVE_BACKEND,
            # Learn output lengths after a few requests, so reservations are exceeded at times.
            "output_min_samples": "5",
            # A tiny low-priority queue: bursts of low-priority requests are shed at once.
            "priority_classes": '{"low": {"queue_max": 2}}',
        }
        dead = {"backend_url": f"http://127.0.0.1:{dead_port}", "backend_name": DOWN_BACKEND}
        kvgate_url = stack.enter_context(_kvgate_serve(live, tmp_path / "kvgate.log", ready=True))
        dead_url = stack.enter_context(_kvgate_serve(dead, tmp_path / "kvgate-down.log", ready=False))
        sim_target, dead_target = sim_url.removeprefix("http://"), f"127.0.0.1:{dead_port}"
        config = _prometheus_config(
            tmp_path,
            kvgate=[kvgate_url.removeprefix("http://"), dead_url.removeprefix("http://")],
            # The emulator named as kvgate names it; the dead port labelled with its address.
            vllm={sim_target: LIVE_BACKEND, dead_target: None},
        )
        prometheus = stack.enter_context(_prometheus(config, tmp_path))
        load = stack.enter_context(Load(kvgate_url, sim_url, sim_config.model_name))
        client = stack.enter_context(httpx.Client())

        pending = dict(checks)
        pending_backends = dict(per_backend)
        last: dict[str, Any] = {}
        active: set[str] = set()
        started = time.monotonic()
        while pending or pending_backends or active != alerts:
            for expr, (_, finite) in list(pending.items()):
                data = _api(client, prometheus, "query", query=expr)
                last[expr] = data["result"]
                if _has_data(data, finite=finite):
                    del pending[expr]
            for expr in list(pending_backends):
                result = _api(client, prometheus, "query", query=expr)["result"]
                last[expr] = result
                if _backends_in(result) >= {LIVE_BACKEND, DOWN_BACKEND}:
                    del pending_backends[expr]
            for alert in _api(client, prometheus, "alerts")["alerts"]:
                if alert["state"] in ("pending", "firing"):
                    active.add(alert["labels"]["alertname"])
            if time.monotonic() - started > DATA_TIMEOUT_S:
                break
            time.sleep(POLL_INTERVAL_S)
        elapsed = time.monotonic() - started

        rules = [r for g in _api(client, prometheus, "rules")["groups"] for r in g["rules"]]
        vllm_backends = _vllm_target_backends(client, prometheus)

    unanswered = [f"{checks[e][0]}:\n    {e}\n    -> {last.get(e)}" for e in pending]
    assert not unanswered, f"no data after {elapsed:.0f} s (load: {dict(load.statuses)}):\n" + "\n".join(
        unanswered
    )
    missing = [f"{per_backend[e]}:\n    {e}\n    -> {last.get(e)}" for e in pending_backends]
    assert not missing, "panels without a series for each backend:\n" + "\n".join(missing)
    assert active == alerts, f"alerts never active: {sorted(alerts - active)}; load: {dict(load.statuses)}"
    assert {r["name"] for r in rules} == alerts, "Prometheus did not load deploy/prometheus's rules"
    broken = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not broken, f"rules failing in Prometheus: {broken}"
    # The relabel rule: a named vLLM keeps its name, an unnamed one is labelled with its address.
    assert vllm_backends == {sim_target: LIVE_BACKEND, dead_target: dead_target}
    # The situations were real: kvgate served requests and shed others.
    assert load.statuses["kvgate 200"] > 0, dict(load.statuses)
    assert load.statuses["kvgate 429"] > 0, dict(load.statuses)


def test_a_fresh_kvgate_leaves_no_panel_empty(tmp_path: Path) -> None:
    """Started, serving its first requests one at a time, before anything was shed, queued or
    preempted: every dashboard query and template variable returns series (a rate of 0, or a
    NaN quantile of a histogram nothing was observed in), none "No data", because kvgate
    exports every series whose labels it knows from the start."""
    require_tool("prometheus")
    sim_config = SimConfig(output_len=OutputLengthModel.parse(f"uniform:1:{GATEWAY_MAX_TOKENS}"))
    queries = dashboard_queries() + variable_queries()
    checks = _checks(queries, finite=False)

    with contextlib.ExitStack() as stack:
        sim_url = stack.enter_context(running_sim(sim_config))
        settings = {"backend_url": sim_url, "backend_name": LIVE_BACKEND}
        kvgate_url = stack.enter_context(_kvgate_serve(settings, tmp_path / "kvgate.log", ready=True))
        config = _prometheus_config(
            tmp_path,
            kvgate=[kvgate_url.removeprefix("http://")],
            vllm={sim_url.removeprefix("http://"): LIVE_BACKEND},
        )
        prometheus = stack.enter_context(_prometheus(config, tmp_path))
        client = stack.enter_context(httpx.Client())

        pending = dict(checks)
        last: dict[str, Any] = {}
        served = 0
        started = time.monotonic()
        while pending and time.monotonic() - started < DATA_TIMEOUT_S:
            # One request at a time: nothing waits for blocks, none is shed, vLLM never preempts.
            body = {
                "model": sim_config.model_name,
                "prompt": PROMPT,
                "max_tokens": 16,
                "stream": served % 2 == 0,
            }
            answer = client.post(f"{kvgate_url}/v1/completions", json=body, timeout=30.0)
            assert answer.status_code == 200, answer.text
            served += 1
            for expr in list(pending):
                data = _api(client, prometheus, "query", query=expr)
                last[expr] = data["result"]
                if _has_data(data, finite=False):
                    del pending[expr]
        elapsed = time.monotonic() - started

        # Still before any shed, wait or preemption (else the check above proved nothing).
        # (`or vector(0)`: a series kvgate does not export counts as nothing happened.)
        quiet = [
            'kvgate_requests_total{outcome!="completed"}',
            "kvgate_queue_wait_prediction_error_seconds_count",
            "vllm:num_preemptions_total",
            "kvgate_backend_preemptions_total",
        ]
        seen: dict[str, float] = {}
        for series in quiet:
            (sample,) = _api(client, prometheus, "query", query=f"sum({series}) or vector(0)")["result"]
            seen[series] = float(sample["value"][1])

    assert seen == dict.fromkeys(quiet, 0.0), f"something was shed, queued or preempted: {seen}"
    unanswered = [f"{checks[e][0]}:\n    {e}\n    -> {last.get(e)}" for e in pending]
    assert not unanswered, f"no data after {elapsed:.0f} s and {served} requests:\n" + "\n".join(unanswered)


@pytest.mark.parametrize("expr", ["sum(rate(kvgate_requests_total[1m]", 'up{job="kvgate"'])
def test_the_api_check_reports_unparsable_promql(tmp_path: Path, expr: str) -> None:
    """The live check would fail, not pass, on an expression Prometheus cannot parse."""
    require_tool("prometheus")
    config = _prometheus_config(tmp_path, kvgate=[], vllm={})
    with (
        _prometheus(config, tmp_path) as prometheus,
        httpx.Client() as client,
        pytest.raises(AssertionError, match="bad_data"),
    ):
        _api(client, prometheus, "query", query=expr)
