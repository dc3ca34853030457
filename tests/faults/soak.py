"""Soak: a real `kvgate serve` in front of the emulator, mixed traffic, faults switched in turn.

    python tests/faults/soak.py --duration 1800 --cpu 0 --json build/soak.json

Starts the emulator and `kvgate serve` as child processes, then runs `--concurrency` clients
for `--duration` seconds: streaming and non-streaming, chat and completions, some with a short
deadline, some that hang up mid-stream. Every `--phase-s` seconds the emulator's faults change
(5xx answers, crashes and resets mid-stream, stalls, hangs, stale / malformed / incomplete
/metrics, a restart with another pool size), so the gateway's error paths run all the time.

Every `--sample-s` it reads the kvgate process's resident memory, open file descriptors and
asyncio task count (`process` in /admin/state). Memory and descriptors are compared at two
quiet points, after the warm-up and at the end, each reached the same way: traffic paused,
faults cleared, the client's connections closed, idle upstream connections expired, one probe
request. The run passes when, from the first quiet point to the last, resident memory grew
less than `--max-rss-growth-mb`, neither descriptors nor tasks grew, the ledger and the queue
are empty at the end, every request got an answer (no client timeout, no broken connection
between client and kvgate, every stream ended with [DONE] or an error event) and kvgate counted
exactly one outcome per request sent. Prints the figures; exit status 0 when they pass.

tests/faults/test_fault_soak.py runs the short variant (about a minute) in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faultkit import SimProcess, start_kvgate

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.lengths import OutputLengthModel

MB = 1024 * 1024
# The idle backend connections kvgate keeps (its generation pool and its client for /metrics and
# /v1/models) expire after 4 s (gateway.upstream); a quiet point waits that long so that both
# quiet points hold the same connections.
KEEPALIVE_EXPIRY_WAIT_S = 4.5
CLIENT_TIMEOUT_S = 30.0
MAX_BACK_OFF_MS = 500
POOL_SIZES = (256, 192)

# Faults switched in turn, one phase each; "restart" restarts the emulator with the next pool.
PHASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("healthy", {}),
    ("5xx", {"error_rate": 0.25, "error_status": 503}),
    ("crash", {"crash_after_tokens": 6}),
    ("stale-metrics", {"metrics_mode": "stale"}),
    ("stall", {"stall_after_tokens": 3}),
    ("healthy", {}),
    ("reset", {"reset_after_tokens": 4}),
    ("malformed-metrics", {"metrics_mode": "malformed"}),
    ("restart", {}),
    ("hang", {"hang": True}),
    ("no-cache-config", {"omit_cache_config_info": True}),
    ("slow-metrics", {"metrics_delay_s": 0.3}),
)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
]


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = 60.0
    warmup_s: float | None = None  # default: a third of a short run, 10 % of a long one
    concurrency: int = 16
    phase_s: float = 2.0
    sample_s: float = 1.0
    seed: int = 0
    cpu: int | None = None
    max_rss_growth_mb: float = 20.0
    # Descriptors and tasks may differ by this much between the quiet points (none).
    max_fd_growth: int = 0
    max_task_growth: int = 0

    @property
    def warmup(self) -> float:
        if self.warmup_s is not None:
            return self.warmup_s
        return min(300.0, max(self.duration_s / 3 if self.duration_s <= 120 else self.duration_s / 10, 5.0))


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    phase: str
    rss_mb: float
    fds: int
    tasks: int
    inflight: int
    queued: int


@dataclass(frozen=True, slots=True)
class Quiet:
    t_s: float
    rss_mb: float
    fds: int
    tasks: int
    ledger_entries: int
    reserved_blocks: int
    queued: int
    # What the descriptors are (see `descriptor_kinds`), so that a grown count says what grew.
    fd_kinds: dict[str, int] = field(default_factory=dict)


def _socket_ends(pid: int) -> dict[str, str]:
    """Socket inode -> "local port -> remote port" for the process's TCP sockets."""
    ends: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                local_port, remote_port = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
                ends[inode] = "listening" if remote_port == 0 else f"{local_port} -> {remote_port}"
    return ends


def descriptor_kinds(pid: int, listen_port: int, backend_port: int) -> dict[str, int]:
    """The process's open descriptors by kind: client and backend connections, pipes, files."""
    ends = _socket_ends(pid)
    kinds: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for entry in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(entry.path)
                if target.startswith("socket:["):
                    end = ends.get(target[8:-1], "not tcp")
                    if end.startswith(f"{listen_port} -> "):
                        target = "tcp from a client"
                    elif end.endswith(f" -> {backend_port}"):
                        target = "tcp to the backend"
                    else:
                        target = f"socket ({end})"
                elif target.startswith("pipe:"):
                    target = "pipe"
                kinds[target] += 1
    return dict(sorted(kinds.items()))


@dataclass
class Tally:
    """What the clients saw."""

    sent: int = 0
    results: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def add(self, result: str, problem: str | None = None) -> None:
        self.results[result] += 1
        if problem is not None and len(self.problems) < 20:
            self.problems.append(problem)


@dataclass
class SoakReport:
    config: dict[str, Any]
    elapsed_s: float
    requests: int
    results: dict[str, int]
    problems: list[str]
    outcomes: dict[str, float]
    baseline: Quiet
    final: Quiet
    samples: list[Sample]
    checks: dict[str, bool]

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def _body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
    common: dict[str, Any] = {"model": "tiny-llama", "max_tokens": rng.randint(1, 64)}
    if rng.random() < 0.5:
        common["ignore_eos"] = True
    if rng.random() < 0.1:
        common["n"] = 2
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": words}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}


async def _back_off(response: httpx.Response) -> None:
    """Wait as told by a 429/503's retry-after-ms, at most half a second, as an SDK would (so
    that instant refusals do not make up most of the traffic while the budget is unknown)."""
    hint = response.headers.get("retry-after-ms")
    if response.status_code in (429, 503) and hint is not None and hint.isdigit():
        await asyncio.sleep(min(int(hint), MAX_BACK_OFF_MS) / 1000)


async def _one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    path, body = _body(rng)
    headers = {"x-kvgate-deadline-ms": "300"} if rng.random() < 0.1 else {}
    streaming = rng.random() < 0.55
    hang_up_after = 2 if streaming and rng.random() < 0.15 else None
    tally.sent += 1
    try:
        if not streaming:
            response = await client.post(path, json=body, headers=headers)
            tally.add(str(response.status_code))
            if response.status_code >= 400 and "error" not in response.json():
                tally.add("not_openai_error", f"{response.status_code}: {response.text[:200]}")
            await _back_off(response)
            return
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        async with client.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                tally.add(str(response.status_code))
                await _back_off(response)
                return
            events = 0
            last = ""
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    last = line[6:]
                    if hang_up_after is not None and events >= hang_up_after:
                        tally.add("hung_up")
                        return
            if last == "[DONE]":
                tally.add("stream_done")
            elif last.startswith('{"error"'):
                tally.add("stream_error_event")
            else:
                tally.add("stream_malformed", f"stream ended with {last[:200]!r}")
    except httpx.TimeoutException as exc:
        tally.add("client_timeout", repr(exc))
    except httpx.TransportError as exc:
        tally.add("transport_error", repr(exc))


async def _worker(
    index: int, config: SoakConfig, client_box: list[httpx.AsyncClient], gate: asyncio.Event, stop: asyncio.Event,
    tally: Tally, busy: Busy,
) -> None:  # fmt: skip
    rng = random.Random(config.seed * 1000 + index)
    while not stop.is_set():
        await gate.wait()
        if stop.is_set():
            return
        with busy:
            await _one_request(client_box[0], rng, tally)


class Busy:
    """Counts the clients in the middle of a request; `idle` is set when none is."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def __enter__(self) -> None:
        self.count += 1
        self.idle.clear()

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


# Equal readings in a row, 50 ms apart, before the quiet point counts descriptors.
SETTLED_READINGS = 10


def _quiet_from(state: dict[str, Any], t_s: float, fd_kinds: dict[str, int]) -> Quiet:
    backend = state["backends"][0]
    process = state["process"]
    return Quiet(
        t_s=round(t_s, 1),
        rss_mb=round(process["rss_bytes"] / MB, 2),
        fds=process["open_fds"],
        tasks=process["asyncio_tasks"],
        ledger_entries=backend["ledger"]["entries"],
        reserved_blocks=backend["ledger"]["reserved_blocks"],
        queued=sum(backend["queue"]["depth"].values()),
        fd_kinds=fd_kinds,
    )


def _outcomes(metrics_text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("kvgate_requests_total{"):
            labels, _, value = line.rpartition(" ")
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] = found.get(outcome, 0.0) + float(value)
    return found


async def run_soak(config: SoakConfig, workdir: Path, *, progress: bool = True) -> SoakReport:
    """Run one soak in `workdir` (logs go there) and return its report."""
    sim = SimProcess(
        SimConfig(
            engine=EngineConfig(
                num_blocks=POOL_SIZES[0],
                block_size=16,
                max_model_len=1024,
                step_cost=StepCost(base_s=0.01, per_token_s=0.0, per_seq_s=0.0002, per_request_s=0.0),
            ),
            output_len=OutputLengthModel.parse("lognormal:12:1.0"),
        ),
        cpu=config.cpu,
    )
    sim.start()
    kvgate = None
    try:
        kvgate = start_kvgate(
            sim.url,
            workdir / "kvgate.log",
            settings={
                "metrics_poll_interval_s": 0.1,
                "metrics_stale_after_s": 0.5,
                "first_byte_timeout_s": 1.5,
                "between_chunk_timeout_s": 1.0,
                "priority_classes": {"normal": {"queue_timeout_s": 5.0}},
            },
            cpu=config.cpu,
        )
        pid = kvgate.pid

        def fd_kinds() -> dict[str, int]:
            return descriptor_kinds(pid, urlsplit(kvgate.url).port or 80, urlsplit(sim.url).port or 80)

        return await _drive(config, sim, kvgate.url, kvgate.admin_headers(), fd_kinds, progress)
    finally:
        if kvgate is not None:
            code = kvgate.stop(signal.SIGTERM)
            if code != 0 and progress:
                print(f"kvgate serve exited with {code}", file=sys.stderr)
        sim.stop()


async def _drive(
    config: SoakConfig,
    sim: SimProcess,
    url: str,
    admin: dict[str, str],
    fd_kinds: Callable[[], dict[str, int]],
    progress: bool,
) -> SoakReport:
    tally = Tally()
    stop = asyncio.Event()
    gate = asyncio.Event()
    busy = Busy()
    samples: list[Sample] = []
    phase_name = ["warm-up"]
    started = time.monotonic()

    def new_client() -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=url,
            timeout=CLIENT_TIMEOUT_S,
            limits=httpx.Limits(max_connections=config.concurrency + 4),
        )

    client_box = [new_client()]
    # One connection: the sampler and the quiet point never make it open a second, which would
    # stay open (kept alive) and count as a grown descriptor.
    control = httpx.AsyncClient(
        base_url=url, headers=admin, timeout=10, limits=httpx.Limits(max_connections=1)
    )
    sim_control = httpx.AsyncClient(base_url=sim.url, timeout=10)

    async def admin_state() -> dict[str, Any]:
        response = await control.get("/admin/state")
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state

    async def sampler() -> None:
        while not stop.is_set():
            state = await admin_state()
            backend, process = state["backends"][0], state["process"]
            samples.append(
                Sample(
                    t_s=round(time.monotonic() - started, 1),
                    phase=phase_name[0],
                    rss_mb=round(process["rss_bytes"] / MB, 2),
                    fds=process["open_fds"],
                    tasks=process["asyncio_tasks"],
                    inflight=backend["ledger"]["entries"],
                    queued=sum(backend["queue"]["depth"].values()),
                )
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.sample_s)

    restarts = [0]

    async def set_phase(index: int) -> None:
        name, faults = PHASES[index % len(PHASES)]
        phase_name[0] = name
        (await sim_control.delete("/sim/faults")).raise_for_status()
        if name == "restart":
            restarts[0] += 1
            blocks = POOL_SIZES[restarts[0] % len(POOL_SIZES)]
            (await sim_control.post("/sim/restart", json={"num_blocks": blocks})).raise_for_status()
        elif faults:
            (await sim_control.post("/sim/faults", json=faults)).raise_for_status()

    async def traffic(seconds: float, first_phase: int) -> int:
        """Run the clients with faults switching for `seconds`; returns the next phase."""
        phase = first_phase
        end = time.monotonic() + seconds
        gate.set()
        while time.monotonic() < end:
            await set_phase(phase)
            phase += 1
            await asyncio.sleep(min(config.phase_s, max(0.0, end - time.monotonic())))
        gate.clear()
        return phase

    async def quiet_point(most_fds: int | None = None) -> Quiet:
        """Descriptors and tasks once the gateway is idle. With `most_fds`, the readings go on
        (past the keep-alive expiry) until no more descriptors than that are open: a connection
        that two overlapping calls opened (a scrape and a discovery, say) stays idle in a pool
        until it expires, while a leaked one never goes."""
        phase_name[0] = "quiet"
        (await sim_control.delete("/sim/faults")).raise_for_status()
        await busy.idle.wait()
        await client_box[0].aclose()
        client_box[0] = new_client()
        # The budget must be fresh again (faults cleared) before the probe can be admitted.
        deadline = time.monotonic() + 30
        while (await control.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, "kvgate did not become ready again"
            await asyncio.sleep(0.05)
        await asyncio.sleep(KEEPALIVE_EXPIRY_WAIT_S)
        async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
            answer = await probe.post(
                "/v1/completions", json={"model": "tiny-llama", "prompt": "probe", "max_tokens": 2}
            )
            answer.raise_for_status()
        tally.sent += 1
        tally.add("200")
        # The probe's connection closed: let the server notice before counting descriptors
        # (equal readings for half a second: on a loaded machine a close can take longer than a
        # few readings to be seen), bounded so that a leak shows rather than hangs.
        deadline = time.monotonic() + 5 + (KEEPALIVE_EXPIRY_WAIT_S if most_fds is not None else 0)
        readings: list[Quiet] = []
        while True:
            readings.append(_quiet_from(await admin_state(), time.monotonic() - started, fd_kinds()))
            last = readings[-SETTLED_READINGS:]
            settled = len(last) == SETTLED_READINGS and len({(q.fds, q.tasks) for q in last}) == 1
            within = most_fds is None or last[-1].fds <= most_fds
            if (settled and within and last[-1].ledger_entries == 0) or time.monotonic() > deadline:
                return readings[-1]
            await asyncio.sleep(0.05)

    workers = [
        asyncio.create_task(_worker(i, config, client_box, gate, stop, tally, busy))
        for i in range(config.concurrency)
    ]
    sampling = asyncio.create_task(sampler())
    try:
        warmup = config.warmup
        phase = await traffic(warmup, 0)
        baseline = await quiet_point()
        if progress:
            print(f"warm-up done after {baseline.t_s:.0f} s: {baseline}", file=sys.stderr)
        measured = max(0.0, config.duration_s - (time.monotonic() - started) - KEEPALIVE_EXPIRY_WAIT_S - 1)
        chunk = 60.0
        while measured > 0:
            step = min(chunk, measured)
            phase = await traffic(step, phase)
            measured -= step
            if progress and samples:
                last = samples[-1]
                print(
                    f"t={last.t_s:.0f}s rss={last.rss_mb:.1f}MB fds={last.fds} tasks={last.tasks} "
                    f"sent={tally.sent} {dict(tally.results)}",
                    file=sys.stderr,
                )
        final = await quiet_point(baseline.fds + config.max_fd_growth)
        metrics_text = (await control.get("/metrics")).text
    finally:
        stop.set()
        gate.set()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, sampling, return_exceptions=True)
        await client_box[0].aclose()
        await control.aclose()
        await sim_control.aclose()
    elapsed = time.monotonic() - started
    outcomes = _outcomes(metrics_text)
    growth_mb = final.rss_mb - baseline.rss_mb
    checks = {
        f"rss growth {growth_mb:.2f} MB < {config.max_rss_growth_mb} MB": growth_mb
        < config.max_rss_growth_mb,
        f"fds {baseline.fds} -> {final.fds}": final.fds - baseline.fds <= config.max_fd_growth,
        f"tasks {baseline.tasks} -> {final.tasks}": final.tasks - baseline.tasks <= config.max_task_growth,
        "ledger and queue empty at the end": final.ledger_entries == 0
        and final.reserved_blocks == 0
        and final.queued == 0,
        "no client timeout": tally.results["client_timeout"] == 0,
        "no broken client connection": tally.results["transport_error"] == 0,
        "every stream well-formed": tally.results["stream_malformed"] == 0,
        "every error is OpenAI's JSON": tally.results["not_openai_error"] == 0,
        f"one outcome per request ({sum(outcomes.values()):.0f} counted, {tally.sent} sent)": (
            round(sum(outcomes.values())) == tally.sent
        ),
    }
    return SoakReport(
        config={**asdict(config), "warmup_s": config.warmup},
        elapsed_s=round(elapsed, 1),
        requests=tally.sent,
        results=dict(tally.results),
        problems=tally.problems,
        outcomes=outcomes,
        baseline=baseline,
        final=final,
        samples=samples,
        checks=checks,
    )


def summary(report: SoakReport) -> str:
    measured = [s for s in report.samples if s.t_s >= report.baseline.t_s]
    rss = [s.rss_mb for s in measured] or [0.0]
    fds = [s.fds for s in measured] or [0]
    tasks = [s.tasks for s in measured] or [0]
    lines = [
        f"soak: {report.elapsed_s:.0f} s, {report.requests} requests "
        f"({report.requests / max(report.elapsed_s, 1e-9):.1f}/s), concurrency {report.config['concurrency']}",
        f"  client results: {dict(sorted(report.results.items()))}",
        f"  kvgate outcomes: { {k: int(v) for k, v in sorted(report.outcomes.items())} }",
        f"  quiet after warm-up ({report.baseline.t_s:.0f} s): rss {report.baseline.rss_mb:.1f} MB, "
        f"fds {report.baseline.fds}, tasks {report.baseline.tasks}",
        f"  quiet at the end    ({report.final.t_s:.0f} s): rss {report.final.rss_mb:.1f} MB, "
        f"fds {report.final.fds}, tasks {report.final.tasks}, ledger entries {report.final.ledger_entries}, "
        f"reserved {report.final.reserved_blocks}, queued {report.final.queued}",
        f"  under load after warm-up: rss min/median/max {min(rss):.1f}/{statistics.median(rss):.1f}/"
        f"{max(rss):.1f} MB, fds max {max(fds)}, tasks max {max(tasks)}",
    ]
    lines += [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in report.checks.items()]
    if report.final.fd_kinds != report.baseline.fd_kinds:
        lines.append(f"  descriptors after warm-up: {report.baseline.fd_kinds}")
        lines.append(f"  descriptors at the end:    {report.final.fd_kinds}")
    lines += [f"  problem: {p}" for p in report.problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds in all (default 60)")
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds of warm-up (default: see SoakConfig)"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=2.0, help="seconds per fault phase")
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu", type=int, default=None, help="pin the emulator, kvgate and the clients to this core"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report (samples included) here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep kvgate's log here")
    args = parser.parse_args(argv)
    config = SoakConfig(
        duration_s=args.duration,
        warmup_s=args.warmup,
        concurrency=args.concurrency,
        phase_s=args.phase_s,
        sample_s=args.sample_s,
        seed=args.seed,
        cpu=args.cpu,
    )
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-soak-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(run_soak(config, workdir))
    print(summary(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    return 0 if report.passed else 1


__all__ = ["SoakConfig", "SoakReport", "main", "run_soak", "summary"]

if __name__ == "__main__":
    sys.exit(main())
