"""Many kvgate processes, one budget in Redis (issue 19), on one real vLLM engine.

    .venv/bin/python tests/benchmarks/shared_budget.py --trace azure -n 300 --rate 30 \\
        --cases 1,2,3 --overhead --out build/shared_budget

The engine is the CPU testbed at --engine (default http://127.0.0.1:8041, started with
`VLLM_SERVER_DEV_MODE=1 tests/testbed/testbed.py start --port 8041 ...`, pinned to the last
core; `--start-engine` starts it here when nothing answers). Everything else (the kvgate
processes, redis-server, this client) is pinned to --client-core (default 0).

Before the first case the plan is replayed once straight to the engine, unmeasured
(`--warm-up N`: its first N requests; 0: none), so that the first case does not meet a cold
engine. Cases, each on the same arrivals (a trace preset of tests/benchmarks/fleet.py, or a trace
path with --ctx-scale / --gen-scale), each with fresh processes, a fresh redis-server
(`redis-server --port P --save '' --appendonly no`) and the engine's prefix cache emptied
(when it has vLLM's dev route):

- `N` (N = 1, 2, 3...): N `kvgate serve --backend ENGINE --set redis_url=redis://...` sharing
  the Redis; the client deals request i to process i mod N (bench/spread.py);
- `1-local`: one kvgate without Redis, today's single process;
- `NAME#TAG` (e.g. `1#2`): case NAME again, to see how far the machine drifted meanwhile.

Requests are the bench's (bench/payload.py): streamed completions with exact prompt lengths,
clients that give up at --deadline (sent as X-Kvgate-Deadline-Ms), output lengths forced on
the engine through `vllm_xargs`, which no gateway reads. Every 50 ms during a case the harness
reads `HGETALL {kvgate}:booked:default` (the shared total and each process's part) and
`HGETALL {kvgate}:peer:default` (the caps the processes published) from Redis in one
transaction, and every process's /admin/state (`budget.admissible_blocks`); bench/shared_budget.py turns those samples, the bench's summary
and the engine's counters into the figures (useful tokens, preemptions, 429/503, the samples
over the smallest admissible budget and the largest excess).

`--overhead` then measures the admission overhead against the emulator (`python -m sim.cli`,
pinned to the engine's core, room for everything, 1 ms steps): one kvgate without Redis, one
with, a second one without (its difference from the first is the noise floor) and the
emulator straight, side by side; short streamed completions one at a time, the targets in
turn (the order rotating every round), so each round's differences come from the same moment
of the machine. Reported: the median first-byte and first-token times,
the median `x-kvgate-queue-ms` (all admitted at once at this load), and the median of the
per-round differences against the kvgate without Redis.

Writes cases.md, cases.json, samples-<case>.jsonl, requests-<case>.jsonl (with the process
that served each), metrics-<case>.jsonl (the engine's and the kvgates' scrapes every 0.5 s),
overhead.md/.json and every process's log under --out. `--cases "" --overhead` measures the
overhead alone, without the engine. Not a test: about a minute per case plus start-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "testbed"))
import fleet as fleet_bench  # noqa: E402
import testbed  # noqa: E402

from bench import counting, report, shared_budget, spread  # noqa: E402
from bench import workload as wl  # noqa: E402
from bench.cli import run_on_fast_loop  # noqa: E402
from bench.payload import OUTPUT_TOKENS_FIELD, Forcing, PayloadOptions, PlannedRequest, plan_requests  # noqa: E402
from bench.prompts import PromptFactory  # noqa: E402
from bench.runner import quiet_gc  # noqa: E402

BIN = Path(sys.executable).parent
DEFAULT_ENGINE_PORT = 8041
BACKEND_NAME = "default"  # `kvgate serve --backend URL` names its one backend so
KEY_PREFIX = "kvgate"
SAMPLE_PERIOD_S = 0.05
HTTP_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 40.0  # kvgate drains requests in flight for up to 30 s
LOCAL = "1-local"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pin_self(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def pinned(core: int | None, command: list[str]) -> list[str]:
    return command if core is None else ["taskset", "-c", str(core), *command]


@contextlib.contextmanager
def process(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own session, stopped on exit: SIGTERM to its group (by its pid), then
    SIGKILL if it has not ended within STOP_TIMEOUT_S."""
    with log.open("wb") as handle:
        child = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield child
    finally:
        # Reaped here, not polled by group: an unreaped child keeps its group alive.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def wait_until(ready: Any, child: subprocess.Popen[bytes], what: str, log: Path) -> None:
    give_up_at = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < give_up_at:
        if child.poll() is not None:
            raise RuntimeError(f"{what} exited with {child.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError, ValueError):
            if ready():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready within {READY_TIMEOUT_S:.0f} s; see {log}")


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
        return bool(response.status == 200)


@contextlib.contextmanager
def redis_server(out: Path, core: int | None) -> Iterator[str]:
    """A fresh redis-server without persistence; its URL."""
    port = free_port()
    command = pinned(core, ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"])
    log = out / f"redis-{port}.log"
    with process(command, log) as child:

        def ready() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")

        wait_until(ready, child, "redis-server", log)
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def kvgates(
    backend: str,
    count: int,
    redis_url: str | None,
    out: Path,
    name: str,
    core: int | None,
    extra: Sequence[str],
) -> Iterator[list[str]]:
    """`count` kvgate processes in front of `backend` (sharing `redis_url` when given), all
    started before any is waited for; their base URLs."""
    with contextlib.ExitStack() as stack:
        started: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        for i in range(count):
            port = free_port()
            settings = ["--set", f"redis_url={redis_url}"] if redis_url else []
            command = [
                str(BIN / "kvgate"), "serve", "--backend", backend, "--port", str(port),
                "--log-level", "warning", *settings, *extra,
            ]  # fmt: skip
            log = out / f"kvgate-{name}-{i}.log"
            child = stack.enter_context(process(pinned(core, command), log))
            started.append((f"http://127.0.0.1:{port}", child, log))
        for url, child, log in started:
            wait_until(lambda url=url: http_ok(f"{url}/readyz"), child, f"kvgate at {url}", log)
        yield [url for url, _, _ in started]


# --------------------------------------------------------------------------------------------
# The workload


@dataclass(frozen=True, slots=True)
class Plan:
    requests: tuple[PlannedRequest, ...]
    offered_s: float
    model: str
    facts: dict[str, Any]


def build_plan(engine: str, args: argparse.Namespace) -> Plan:
    """The bench's requests for the trace slice, as `kvgate bench` builds them."""
    trace: fleet_bench.Trace = args.trace_spec
    work = wl.load_trace(trace.path)
    work = wl.take_first(work, args.n)
    work = wl.rescale_rate(work, args.rate)
    work = wl.scale_lengths(work, trace.ctx_scale, trace.gen_scale)
    with httpx.Client(timeout=counting.SETUP_TIMEOUT_S) as client:
        info = counting.fetch_model_info(client, engine, None)
        if info is None or info.root is None or not Path(info.root).is_dir():
            raise RuntimeError(f"{engine}/v1/models names no local model folder (its tokenizer)")
        if not counting.honours_forced_length(client, engine, info.name, OUTPUT_TOKENS_FIELD):
            raise RuntimeError(f"{engine} does not read vllm_xargs.{OUTPUT_TOKENS_FIELD}: start the testbed")
    count = counting.local_counter(info.root, counting.Api.COMPLETIONS, info.name)
    work, clamp = wl.clamp_to_context(work, info.max_model_len, args.max_tokens)
    factory = PromptFactory.calibrate(count, seed=args.seed, block_tokens=work.block_tokens)
    prompts = [factory.text_for(spec, i)[0] for i, spec in enumerate(work.requests)]
    options = PayloadOptions(
        model=info.name,
        api=counting.Api.COMPLETIONS,
        max_tokens_cap=args.max_tokens,
        max_model_len=info.max_model_len,
        forcing=Forcing.XARGS,
        deadline_s=args.deadline,
    )
    facts = {**wl.describe(work), "trace": str(trace.path), "ctx_scale": trace.ctx_scale}
    facts |= {
        "gen_scale": trace.gen_scale,
        "rate": args.rate,
        "clamped": clamp.outputs_clamped + clamp.prompts_clamped,
    }
    return Plan(plan_requests(work.requests, prompts, options), wl.offered_seconds(work), info.name, facts)


# --------------------------------------------------------------------------------------------
# Sampling the shared total and the budgets


async def sample_budgets(
    redis_url: str | None, gateways: Sequence[str], into: list[tuple[float, Any, list[int | None], Any]]
) -> None:
    """Every SAMPLE_PERIOD_S until cancelled: (monotonic time, booked hash or None, each
    process's admissible blocks, the published caps or None); the two hashes are read in one
    transaction, at one instant of the ledger."""
    key = shared_budget.booked_key(KEY_PREFIX, BACKEND_NAME)
    client = aioredis.Redis.from_url(redis_url, socket_timeout=HTTP_TIMEOUT_S) if redis_url else None

    peers = shared_budget.peer_key(KEY_PREFIX, BACKEND_NAME)

    async def booked() -> tuple[dict[str, int] | None, dict[str, int] | None]:
        if client is None:
            return None, None
        try:
            async with client.pipeline(transaction=True) as pipe:
                pipe.hgetall(key)
                pipe.hgetall(peers)
                raw_booked, raw_caps = await pipe.execute()
        except (OSError, aioredis.RedisError):
            return None, None
        return shared_budget.parse_booked(raw_booked), shared_budget.parse_caps(raw_caps)

    async def admissible(http: httpx.AsyncClient, url: str) -> int | None:
        try:
            state = (await http.get(f"{url}/admin/state")).json()
            value = state["backends"][0]["budget"]["admissible_blocks"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return None
        return int(value) if isinstance(value, int | float) else None

    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
        try:
            next_at = time.monotonic()
            while True:
                at = time.monotonic()
                (total, caps), budgets = await asyncio.gather(
                    booked(), asyncio.gather(*(admissible(http, g) for g in gateways))
                )
                into.append((at, total, list(budgets), caps))
                next_at += SAMPLE_PERIOD_S
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        finally:
            if client is not None:
                await client.aclose()


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=HTTP_TIMEOUT_S) as response:
        return str(response.read().decode())


def ledger_metrics(text: str) -> dict[str, float]:
    """The kvgate_shared_ledger_* samples of a kvgate scrape (summed over labels)."""
    out: dict[str, float] = {}
    wanted = "\n".join(line for line in text.splitlines() if "kvgate_shared_ledger" in line) + "\n"
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


# --------------------------------------------------------------------------------------------
# Cases


def parse_case(name: str) -> tuple[int, bool]:
    """'N' -> (N, with Redis); '1-local' -> (1, without); a tag after '#' names a repeat
    ('1#2': case 1 again)."""
    base = name.split("#", 1)[0]
    if base == LOCAL:
        return 1, False
    processes = int(base)
    if processes < 1:
        raise ValueError(f"case {name!r}: at least one process")
    return processes, True


def warm_engine(engine: str, plan: Plan, args: argparse.Namespace) -> None:
    """Replay the plan (or its first `--warm-up` requests) at the engine itself, unmeasured.

    Every case is compared with the first, and a freshly started engine served the first case
    cold (docs/measurements.md, "The shared-budget harness warms the engine first")."""
    head = plan.requests if args.warm_up is None else plan.requests[: args.warm_up]
    ran = run_on_fast_loop(spread.run_spread([engine], head, deadline_s=args.deadline, label="warm-up"))
    summary = report.summarize(
        ran.result, offered_s=head[-1].spec.arrival_s if head else 0.0, deadline_s=args.deadline
    )
    print(f"warm-up: {len(head)} requests straight to the engine, {summary.ok} answered", flush=True)


def run_case(name: str, engine: str, plan: Plan, args: argparse.Namespace) -> shared_budget.CaseFigures:
    processes, with_redis = parse_case(name)
    out: Path = args.out
    if args.reset_cache:
        fleet_bench.reset_prefix_caches([engine])
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(redis_server(out, args.client_core)) if with_redis else None
        gateways = stack.enter_context(
            kvgates(engine, processes, redis_url, out, name, args.client_core, args.kvgate_args)
        )
        raw: list[tuple[float, Any, list[int | None], Any]] = []

        async def go() -> spread.SpreadResult:
            sampler = asyncio.create_task(sample_budgets(redis_url, gateways, raw))
            try:
                return await spread.run_spread(
                    gateways,
                    plan.requests,
                    deadline_s=args.deadline,
                    metrics_urls=[engine, *gateways],
                    label=f"{name} ({processes} kvgate{'s' if processes > 1 else ''})",
                )
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)

        load_before = os.getloadavg()[0]
        print(
            f"case {name}: {processes} process(es) {gateways}, redis {redis_url}, load {load_before:.2f}",
            flush=True,
        )
        with quiet_gc():
            ran = run_on_fast_loop(go())
        after = {g: ledger_metrics(scrape_text(g)) for g in gateways}
        leftover = None
        if redis_url:
            leftover = run_on_fast_loop(_booked_now(redis_url))
    summary = report.summarize(ran.result, offered_s=plan.offered_s, deadline_s=args.deadline)
    samples = [
        shared_budget.BudgetSample(at - ran.started_at, booked, tuple(budgets), caps)
        for at, booked, budgets, caps in raw
        if at >= ran.started_at
    ]
    with (out / f"samples-{name}.jsonl").open("w") as handle:
        for sample in samples:
            handle.write(json.dumps(sample.to_json()) + "\n")
    with (out / f"requests-{name}.jsonl").open("w") as handle:
        for record in ran.result.records:
            handle.write(json.dumps({**record.to_json(), "via": ran.target_of.get(record.index)}) + "\n")
    with (out / f"metrics-{name}.jsonl").open("w") as handle:
        for point in ran.result.samples:
            handle.write(
                json.dumps({"t_s": point.t_s, "source": point.source, **asdict(point.reading)}) + "\n"
            )
    per_process = [sum(1 for t in ran.target_of.values() if t == g) for g in gateways]
    figures = shared_budget.case_figures(
        name=name,
        processes=processes,
        redis=with_redis,
        summary=summary.to_json(),
        statuses=[r.status for r in ran.result.records],
        requests_per_process=per_process,
        samples=samples if with_redis else None,
    )
    (out / f"case-{name}.json").write_text(
        json.dumps(
            {
                "figures": figures.to_json(),
                "summary": summary.to_json(),
                "start_slack_s": ran.start_slack_s,
                # Other work on this shared machine: the 1-minute load average before and after.
                "load_average": [load_before, os.getloadavg()[0]],
                "ledger_metrics_after": after,
                "booked_after_idle": leftover,
            },
            indent=1,
        )
    )
    print(shared_budget.render_cases([figures]).splitlines()[-1], flush=True)
    print(
        f"  start slack {ran.start_slack_s:.3f} s; booked after idle {leftover}; ledger {after}", flush=True
    )
    return figures


async def _booked_now(redis_url: str) -> dict[str, int] | None:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=HTTP_TIMEOUT_S)
    try:
        return shared_budget.parse_booked(
            await client.hgetall(shared_budget.booked_key(KEY_PREFIX, BACKEND_NAME))
        )
    finally:
        await client.aclose()


# --------------------------------------------------------------------------------------------
# Admission overhead against the emulator


def probe_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "The capital of France is a city that many people like to visit in the spring",
        "max_tokens": 64,
        "stream": True,
        "vllm_xargs": {OUTPUT_TOKENS_FIELD: 4},
    }


def probe(client: httpx.Client, target: str, url: str, body: dict[str, Any]) -> shared_budget.Probe:
    sent = time.perf_counter()
    first_byte = first_token = None
    queue_ms: int | None = None
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            first_byte = time.perf_counter() - sent
            header = response.headers.get("x-kvgate-queue-ms")
            queue_ms = int(header) if header is not None else None
            for line in response.iter_lines():
                if first_token is None and line.startswith("data: {"):
                    first_token = time.perf_counter() - sent
            status = response.status_code
    except httpx.HTTPError:
        status = None
    return shared_budget.Probe(target, first_byte, first_token, queue_ms, status)


def run_overhead(engine_core: int | None, args: argparse.Namespace) -> shared_budget.OverheadFigures:
    out: Path = args.out
    model_dir = testbed.model_dir()
    sim_port = free_port()
    sim_command = pinned(
        engine_core,
        [
            str(BIN / "python"), "-m", "sim.cli", "--port", str(sim_port), "--tokenizer", str(model_dir),
            "--model-name", testbed.SERVED_MODEL_NAME, "--num-blocks", "4096", "--max-num-seqs", "256",
            "--step-base-ms", "1", "--step-per-token-ms", "0", "--step-per-seq-ms", "0",
            "--step-per-request-ms", "0",
        ],
    )  # fmt: skip
    sim_url = f"http://127.0.0.1:{sim_port}"
    log = out / "sim.log"
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(process(sim_command, log))
        wait_until(lambda: http_ok(f"{sim_url}/health"), sim, "the emulator", log)
        redis_url = stack.enter_context(redis_server(out, args.client_core))
        (local,) = stack.enter_context(
            kvgates(sim_url, 1, None, out, "overhead-local", args.client_core, args.kvgate_args)
        )
        (again,) = stack.enter_context(
            kvgates(sim_url, 1, None, out, "overhead-local-again", args.client_core, args.kvgate_args)
        )
        (shared,) = stack.enter_context(
            kvgates(sim_url, 1, redis_url, out, "overhead-redis", args.client_core, args.kvgate_args)
        )
        # A second kvgate without Redis: the difference between the two is the noise floor.
        targets = {
            "emulator straight": sim_url,
            "kvgate": local,
            "kvgate again (no Redis)": again,
            "kvgate + Redis": shared,
        }
        body = probe_body(testbed.SERVED_MODEL_NAME)
        rounds: list[dict[str, shared_budget.Probe]] = []
        names = list(targets)
        with httpx.Client(timeout=10.0) as client:
            for _ in range(args.overhead_warmup):
                for name, url in targets.items():
                    probe(client, name, url, body)
            for i in range(args.overhead_rounds):
                order = names[i % len(names) :] + names[: i % len(names)]
                one: dict[str, shared_budget.Probe] = {}
                for name in order:
                    one[name] = probe(client, name, targets[name], body)
                    time.sleep(args.overhead_gap_s)
                rounds.append(one)
        ledger = ledger_metrics(scrape_text(shared))
    figures = shared_budget.overhead(rounds, baseline="kvgate")
    with (out / "overhead-probes.jsonl").open("w") as handle:
        for one in rounds:
            handle.write(json.dumps({name: asdict(p) for name, p in one.items()}) + "\n")
    text = shared_budget.render_overhead(figures)
    count = ledger.get("kvgate_shared_ledger_round_trip_seconds_count")
    total = ledger.get("kvgate_shared_ledger_round_trip_seconds_sum")
    if count:
        text += f"\nRedis round trips seen by the kvgate with Redis: {count:.0f}, mean {1000 * (total or 0) / count:.3f} ms\n"
    (out / "overhead.md").write_text(text)
    (out / "overhead.json").write_text(
        json.dumps({"figures": figures.to_json(), "ledger_metrics": ledger}, indent=1)
    )
    print(text, flush=True)
    return figures


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default=f"http://127.0.0.1:{DEFAULT_ENGINE_PORT}")
    parser.add_argument(
        "--start-engine", action="store_true", help="start the testbed when --engine does not answer"
    )
    parser.add_argument(
        "--trace", default="azure", help="a preset of fleet.py (azure, mooncake) or a trace path"
    )
    parser.add_argument("--ctx-scale", type=float, help="override the preset's context scale")
    parser.add_argument("--gen-scale", type=float, help="override the preset's output scale")
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--rate", type=float, default=30.0, help="mean arrivals per second")
    parser.add_argument("--deadline", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cases", default="1,2,3", help=f"comma-separated: process counts or {LOCAL}, each may end in #TAG"
    )
    parser.add_argument("--client-core", type=int, default=0, help="core of kvgate, Redis and this client")
    parser.add_argument("--kvgate-args", default="", help="more `kvgate serve` arguments, one string")
    parser.add_argument("--no-reset-cache", dest="reset_cache", action="store_false")
    parser.add_argument(
        "--warm-up",
        type=int,
        default=None,
        help="replay the plan's first N requests (default: all) straight to the engine before the first case",
    )
    parser.add_argument("--overhead", action="store_true", help="also measure the admission overhead")
    parser.add_argument("--overhead-rounds", type=int, default=300)
    parser.add_argument("--overhead-warmup", type=int, default=20)
    parser.add_argument("--overhead-gap-s", type=float, default=0.01)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    preset = fleet_bench.PRESETS.get(args.trace)
    base = preset or fleet_bench.Trace(Path(args.trace).stem, Path(args.trace), 1.0, 1.0)
    args.trace_spec = fleet_bench.Trace(
        base.name, base.path, args.ctx_scale or base.ctx_scale, args.gen_scale or base.gen_scale
    )
    if not args.trace_spec.path.is_file():
        parser.error(f"no trace at {args.trace_spec.path}")
    args.case_list = [part.strip() for part in args.cases.split(",") if part.strip()]
    try:
        for case in args.case_list:
            parse_case(case)
    except ValueError as exc:
        parser.error(str(exc))
    args.kvgate_args = args.kvgate_args.split()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = args.engine.rstrip("/")
    cores = os.cpu_count() or 1
    engine_core = cores - 1 if cores > 1 else None
    with contextlib.ExitStack() as stack:
        if not args.case_list:
            # The overhead alone runs against the emulator: no engine to wait for.
            pin_self(args.client_core)
            if args.overhead:
                run_overhead(engine_core, args)
            return 0
        if not testbed.is_ready(engine):
            if not args.start_engine:
                raise SystemExit(f"{engine} does not answer /health (start the testbed, or --start-engine)")
            port = int(engine.rsplit(":", 1)[1])
            os.environ["VLLM_SERVER_DEV_MODE"] = "1"
            child = testbed.start(port, args.out / "vllm.log", [])
            stack.callback(testbed.stop_process, child.pid)
        pin_self(args.client_core)
        if args.reset_cache and not fleet_bench.reset_prefix_caches([engine]):
            print(
                "warning: the engine lacks POST /reset_prefix_cache: cases start with its cache warm",
                flush=True,
            )
            args.reset_cache = False
        plan = build_plan(engine, args)
        print(
            f"plan: {len(plan.requests)} requests, offered {plan.offered_s:.1f} s, {plan.facts}", flush=True
        )
        if args.warm_up != 0:
            warm_engine(engine, plan, args)
        cases = [run_case(name, engine, plan, args) for name in args.case_list]
        text = shared_budget.render_cases(cases)
        (args.out / "cases.md").write_text(text)
        (args.out / "cases.json").write_text(
            json.dumps(
                {
                    "engine": engine,
                    "workload": plan.facts,
                    "deadline_s": args.deadline,
                    "cases": [c.to_json() for c in cases],
                },
                indent=1,
            )
        )
        print(text, flush=True)
        if args.overhead:
            run_overhead(engine_core, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
