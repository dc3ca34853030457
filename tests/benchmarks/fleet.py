"""Gateways in front of two real vLLM engines, on the same arrivals: kvgate against the SGLang
model gateway (PyPI `sglang-router`) with its cache_aware and round_robin policies.

    .venv/bin/python tests/benchmarks/fleet.py --traces mooncake,azure -n 300 \\
        --find-1x --rates 1x,3x --out build/fleet

It starts two testbeds (tests/testbed/testbed.py, ports --port and --port + 1), each engine
pinned to a core of its own (the first to the last core, the second to core 0), with
VLLM_SERVER_DEV_MODE=1 so that `POST /reset_prefix_cache` exists; `--engines URL,URL` uses
running engines instead (then caches are reset only if they expose that route). For every
trace slice, rate and round it runs each target in turn on the same arrivals with
`kvgate bench` (deadline clients by default, lengths forced through the private field that the
testbed's logits processor reads and no gateway does):

- `cache_aware`, `round_robin`: `python -m sglang_router.launch_router --worker-urls E1 E2
  --policy P`, started fresh for the run (an empty prefix tree), ready when its `/readiness`
  counts every worker healthy;
- `kvgate`: `kvgate serve --backend E1 --backend E2`, started fresh for the run, ready at
  `/readyz`. `--kvgate-single-backend` puts it in front of the first engine only (for a kvgate
  that takes one backend; its figures then compare one engine against two).

Before each run the harness waits until both engines are idle, empties their prefix caches and
scrapes their `/metrics`; after it (the bench waits for idle engines) it scrapes them again.
bench/fleet.py turns the two scrapes and the bench's records into the figures (useful tokens,
preemptions, prefix-cache hit rate, each engine's share of the generated tokens, 429s and
503s, TTFT p50/p99, engines' tokens minus clients') and the verdicts against the issue's
criteria; fleet.md and fleet.json under --out hold them.

The traces are presets with the scales the campaigns use (docs/measurements.md): `mooncake`
(bench/traces/mooncake_synthetic_trace_600.jsonl, contexts / 32, outputs / 2, shared prefixes)
and `azure` (bench/traces/AzureLLMInferenceTrace_code_600.csv, contexts / 8, little sharing);
a path to another trace takes --ctx-scale and --gen-scale. The loads are defined by
measurement as in campaign.py: `--find-1x` searches, per trace and against SGLang round_robin
(the plainest spread over the two engines) with deadline clients, the rate at which 98% of the
slice finishes within the deadline, and 1x = what the fleet keeps up with (derived from that
rate, the slice's length and the deadline: bench/loads.py) x --margin; `--one-x mooncake=R,azure=R`
gives 1x from an earlier search. Not a test: minutes per trace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "testbed"))
import testbed  # noqa: E402

from bench import fleet, loads  # noqa: E402
from bench.promtext import Reading, parse_reading  # noqa: E402

REPO = HERE.parent.parent
BIN = Path(sys.executable).parent
TRACES = REPO / "bench" / "traces"


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    path: Path
    ctx_scale: float
    gen_scale: float


PRESETS = {
    "mooncake": Trace("mooncake", TRACES / "mooncake_synthetic_trace_600.jsonl", 0.03125, 0.5),
    "azure": Trace("azure", TRACES / "AzureLLMInferenceTrace_code_600.csv", 0.125, 1.0),
}
TARGETS = (*fleet.SGLANG_POLICIES, fleet.KVGATE)
HTTP_TIMEOUT_S = 5.0
GATEWAY_READY_TIMEOUT_S = 120.0
# An engine refuses to empty its prefix cache while a request holds blocks: wait for idle first.
IDLE_TIMEOUT_S = 300.0
POLL_S = 0.25


# --------------------------------------------------------------------------------------------
# Engines


def http_json(method: str, url: str, timeout_s: float = HTTP_TIMEOUT_S) -> Any:
    request = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def scrape(engine: str) -> Reading:
    with urllib.request.urlopen(f"{engine}/metrics", timeout=HTTP_TIMEOUT_S) as response:
        return parse_reading(response.read().decode())


def wait_idle(engines: Sequence[str], timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, Reading]:
    """Poll until no engine runs or queues a request; the last readings."""
    give_up_at = time.monotonic() + timeout_s
    while True:
        readings = {engine: scrape(engine) for engine in engines}
        if all((r.busy or 0.0) == 0.0 for r in readings.values()):
            return readings
        if time.monotonic() > give_up_at:
            raise RuntimeError(f"engines still busy after {timeout_s:.0f} s: {readings}")
        time.sleep(POLL_S)


def reset_prefix_caches(engines: Sequence[str], timeout_s: float = IDLE_TIMEOUT_S) -> bool:
    """Empty every engine's prefix cache (vLLM's dev route, VLLM_SERVER_DEV_MODE=1): True when
    all were emptied, False when an engine lacks the route."""
    give_up_at = time.monotonic() + timeout_s
    for engine in engines:
        while True:
            wait_idle([engine], timeout_s)
            try:
                answer = http_json("POST", f"{engine}/reset_prefix_cache")
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return False
                raise
            if answer.get("success"):
                break
            # Blocks still held (a request admitted between the idle check and the reset).
            if time.monotonic() > give_up_at:
                raise RuntimeError(f"{engine} did not empty its prefix cache within {timeout_s:.0f} s")
            time.sleep(POLL_S)
    return True


def wait_healthy(engines: Sequence[str], timeout_s: float = GATEWAY_READY_TIMEOUT_S) -> None:
    give_up_at = time.monotonic() + timeout_s
    for engine in engines:
        while not testbed.is_ready(engine):
            if time.monotonic() > give_up_at:
                raise RuntimeError(f"{engine} does not answer /health")
            time.sleep(POLL_S)


def model_info(engine: str) -> tuple[str, str | None, int | None]:
    """The engine's first served model: name, root folder (its tokenizer; None unless a local
    folder), max_model_len."""
    model = http_json("GET", f"{engine}/v1/models")["data"][0]
    root = model.get("root")
    folder = root if isinstance(root, str) and Path(root).is_dir() else None
    return str(model["id"]), folder, model.get("max_model_len")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def started_engines(port: int, out: Path, cores: Sequence[int | None]) -> Iterator[list[str]]:
    """Two testbeds side by side, each pinned to its core, started at the same time."""
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the testbeds inherit it: /reset_prefix_cache
    processes: list[subprocess.Popen[bytes] | None] = [None] * len(cores)
    errors: list[BaseException] = []

    def start(index: int) -> None:
        try:
            processes[index] = testbed.start(port + index, out / f"vllm-{index}.log", [], core=cores[index])
        except BaseException as exc:  # reported below, after both starts ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(cores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise RuntimeError(f"a testbed did not start: {errors[0]}") from errors[0]
        yield [f"http://127.0.0.1:{port + i}" for i in range(len(cores))]
    finally:
        for process in processes:
            if process is not None:
                testbed.stop_process(process.pid)
                process.wait(timeout=30)


# --------------------------------------------------------------------------------------------
# Gateways


def _popen(command: list[str], log: Path, core: int | None) -> subprocess.Popen[bytes]:
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: Path, ready: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if ready():
                return
        except (OSError, ValueError):
            pass
        time.sleep(POLL_S)
    testbed.stop_process(process.pid)
    raise RuntimeError(f"{url} was not ready within {timeout_s:.0f} s; see {log}")


def sglang_command(policy: str, engines: Sequence[str], port: int, extra: Sequence[str]) -> list[str]:
    # Its Prometheus exporter listens on a port of its own (default 29000): beside the router's.
    return [
        str(BIN / "python"), "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(port + 1),
        "--worker-urls", *engines, "--policy", policy, "--log-level", "warn",
        # Stopped only when idle: no need for its default 180 s wait for requests in flight.
        "--shutdown-grace-period-secs", "1", *extra,
    ]  # fmt: skip


def start_sglang(
    policy: str, engines: Sequence[str], port: int, log: Path, extra: Sequence[str], core: int | None
) -> subprocess.Popen[bytes]:
    """The SGLang model gateway with `policy`, once its /readiness counts every worker healthy
    (its /health answers 200 before any worker is registered)."""
    url = f"http://127.0.0.1:{port}"
    process = _popen(sglang_command(policy, engines, port, extra), log, core)

    def ready() -> bool:
        answer = http_json("GET", f"{url}/readiness")
        return int(answer.get("healthy_workers", 0)) == len(engines)

    _wait_ready(process, url, log, ready, GATEWAY_READY_TIMEOUT_S)
    return process


def kvgate_command(engines: Sequence[str], port: int, extra: Sequence[str]) -> list[str]:
    backends = [part for engine in engines for part in ("--backend", engine)]
    return [str(BIN / "kvgate"), "serve", *backends, "--port", str(port), *extra]


def start_kvgate(
    engines: Sequence[str], port: int, log: Path, extra: Sequence[str], core: int | None
) -> subprocess.Popen[bytes]:
    url = f"http://127.0.0.1:{port}"
    process = _popen(kvgate_command(engines, port, extra), log, core)

    def ready() -> bool:
        with urllib.request.urlopen(f"{url}/readyz", timeout=HTTP_TIMEOUT_S) as response:
            return bool(response.status == 200)

    _wait_ready(process, url, log, ready, GATEWAY_READY_TIMEOUT_S)
    return process


# --------------------------------------------------------------------------------------------
# Runs


@dataclass(frozen=True, slots=True)
class Setup:
    """What every run shares: the engines, the model and how the bench is driven."""

    engines: tuple[str, ...]
    model: str
    tokenizer: str | None
    max_model_len: int | None
    caches_reset: bool
    args: argparse.Namespace


def bench_command(url: str, trace: Trace, rate: float, setup: Setup, out: Path, clients: str) -> list[str]:
    args = setup.args
    command = [
        str(BIN / "kvgate"), "bench", "--target", url,
        "--trace", str(trace.path), "--rate", str(rate), "-n", str(args.n),
        "--ctx-scale", str(args.ctx_scale or trace.ctx_scale),
        "--gen-scale", str(args.gen_scale or trace.gen_scale),
        "--max-tokens", str(args.max_tokens), "--clients", clients, "--ttft-slo", str(args.ttft_slo),
        "--seed", str(args.seed), "--out", str(out), "--force-output", "xargs",
        # SGLang's /v1/models names the model "unknown" and gives no context or folder: the
        # bench learns them from the engine, the same for every target.
        "--model", setup.model,
        *[part for engine in setup.engines for part in ("--backend-metrics", f"{engine}/metrics")],
    ]  # fmt: skip
    if setup.tokenizer:
        command += ["--tokenizer", setup.tokenizer]
    if setup.max_model_len:
        command += ["--max-model-len", str(setup.max_model_len)]
    if clients != "ttft":
        command += ["--deadline", str(args.deadline)]
    if args.client_core is not None:
        command = ["taskset", "-c", str(args.client_core), *command]
    return command


def run_one(
    target: str, trace: Trace, rate: float, round_: int, setup: Setup, folder: Path, clients: str
) -> fleet.RunFigures:
    """One target on one slice at one rate: fresh gateway, cold engine caches, the bench, the
    engines' counters before and after."""
    args = setup.args
    folder.mkdir(parents=True, exist_ok=True)
    port = args.gateway_port
    if not port_free(port) or not port_free(port + 1):
        raise RuntimeError(f"port {port} or {port + 1} is taken: pick another --gateway-port")
    if target == fleet.KVGATE:
        backends = setup.engines[:1] if args.kvgate_single_backend else setup.engines
        gateway = start_kvgate(backends, port, folder / "gateway.log", args.kvgate_args, args.client_core)
        name = fleet.KVGATE
    else:
        gateway = start_sglang(
            target, setup.engines, port, folder / "gateway.log", args.sglang_args, args.client_core
        )
        name = fleet.sglang_target(target)
    try:
        if setup.caches_reset:
            reset_prefix_caches(setup.engines)
        before = wait_idle(setup.engines)
        url = f"http://127.0.0.1:{port}"
        log = folder / "bench.log"
        with log.open("wb") as handle:
            done = subprocess.run(
                bench_command(url, trace, rate, setup, folder, clients),
                check=False,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        if done.returncode != 0:
            raise RuntimeError(f"kvgate bench exited with {done.returncode}:\n{log.read_text()[-3000:]}")
        after = wait_idle(setup.engines)
    finally:
        testbed.stop_process(gateway.pid)
        gateway.wait(timeout=30)
    summary = json.loads((folder / "summary.json").read_text())
    unforced = summary["settings"].get("targets_ignoring_the_length_field") or []
    if unforced:
        raise RuntimeError(f"{name} did not pass the length field on to the engines: {unforced}")
    records = [json.loads(line) for line in (folder / "requests-0.jsonl").read_text().splitlines() if line]
    figures = fleet.run_figures(
        target=name,
        trace=trace.name,
        rate=rate,
        round_=round_,
        summary=summary["targets"][0],
        records=records,
        engines=[fleet.engine_delta(e, before[e], after[e]) for e in setup.engines],
    )
    idle = [e.engine for e in figures.engines if e.generation_tokens == 0]
    if target == fleet.KVGATE and not args.kvgate_single_backend and idle and figures.ok:
        # A kvgate whose `--backend` takes one URL keeps the last one given, silently.
        print(
            f"warning: kvgate sent nothing to {', '.join(idle)}: does it take several --backend?", flush=True
        )
    return figures


def find_one_x(trace: Trace, setup: Setup, out: Path) -> loads.RateSearch:
    """The rate SGLang round_robin sustains on the slice with deadline clients (find-1x.json)."""
    args = setup.args

    def finished_share(rate: float) -> float:
        folder = out / f"find-1x-{trace.name}-rate{rate:.4g}"
        run = run_one("round_robin", trace, rate, 1, setup, folder, "deadline")
        share = run.ok / run.sent if run.sent else 0.0
        print(f"find-1x {trace.name}: rate {rate:.4g}/s: {100 * share:.1f}% within the deadline", flush=True)
        return share

    search = loads.find_rate(
        finished_share,
        start_rate=args.start_rate,
        target_share=args.finished_share,
        margin=args.margin,
        max_doublings=args.max_doublings,
        bisections=args.bisections,
        slice_requests=args.n,
        deadline_s=args.deadline,
    )
    report = {
        "trace": trace.name,
        "n": args.n,
        "target": fleet.sglang_target("round_robin"),
        **search.to_json(),
    }
    (out / f"find-1x-{trace.name}.json").write_text(json.dumps(report, indent=1))
    print(loads.describe(search), flush=True)
    return search


# --------------------------------------------------------------------------------------------
# Command line


def parse_one_x(text: str | None, traces: Sequence[Trace]) -> dict[str, float]:
    """`R` (every trace) or `name=R,name=R`."""
    if not text:
        return {}
    if "=" not in text:
        return {trace.name: float(text) for trace in traces}
    pairs = (part.split("=", 1) for part in text.split(","))
    return {name.strip(): float(value) for name, value in pairs}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces", default="mooncake,azure", help="comma-separated presets (mooncake, azure) or trace paths"
    )
    parser.add_argument("--ctx-scale", type=float, help="override the presets' context scale")
    parser.add_argument("--gen-scale", type=float, help="override the presets' output scale")
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument(
        "--rates",
        default="1x,3x",
        help="requests/s, comma-separated, or multiples of 1x (with --find-1x, --one-x)",
    )
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}"
    )
    parser.add_argument("--clients", default="deadline", choices=("deadline", "ttft", "both"))
    parser.add_argument("--deadline", type=float, default=10.0)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="rounds; each runs every target in turn")
    parser.add_argument("--engines", help="URL,URL of running engines (default: start two testbeds)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the engine's model folder)")
    parser.add_argument("--port", type=int, default=8051, help="the testbeds' ports: this one and the next")
    parser.add_argument("--gateway-port", type=int, default=8061, help="the gateway's port (and the next)")
    parser.add_argument(
        "--client-core", type=int, help="pin the gateway and the bench to this core (default: unpinned)"
    )
    parser.add_argument(
        "--kvgate-single-backend",
        action="store_true",
        help="kvgate in front of the first engine only (a kvgate that takes one --backend)",
    )
    parser.add_argument("--kvgate-args", default="", help="extra `kvgate serve` arguments, one string")
    parser.add_argument("--sglang-args", default="", help="extra sglang_router.launch_router arguments")
    search = parser.add_argument_group("loads by measurement (see campaign.py)")
    search.add_argument("--find-1x", action="store_true", help="search 1x per trace against round_robin")
    search.add_argument("--one-x", help="1x from an earlier search: R, or name=R,name=R")
    search.add_argument("--start-rate", type=float, default=loads.DEFAULT_START_RATE)
    search.add_argument("--finished-share", type=float, default=loads.DEFAULT_FINISHED_SHARE)
    search.add_argument("--margin", type=float, default=loads.DEFAULT_MARGIN)
    search.add_argument("--max-doublings", type=int, default=loads.DEFAULT_MAX_DOUBLINGS)
    search.add_argument("--bisections", type=int, default=loads.DEFAULT_BISECTIONS)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.trace_list = [
        PRESETS.get(name) or Trace(Path(name).stem, Path(name), args.ctx_scale or 1.0, args.gen_scale or 1.0)
        for name in (part.strip() for part in args.traces.split(","))
    ]
    for trace in args.trace_list:
        if not trace.path.is_file():
            parser.error(f"no trace at {trace.path}")
    args.target_list = [part.strip() for part in args.targets.split(",")]
    for target in args.target_list:
        if target not in TARGETS:
            parser.error(f"--targets: {target!r} is none of {', '.join(TARGETS)}")
    args.kvgate_args = args.kvgate_args.split()
    args.sglang_args = args.sglang_args.split()
    if args.find_1x and args.one_x:
        parser.error("--find-1x measures 1x: drop --one-x")
    try:
        args.one_x_of = parse_one_x(args.one_x, args.trace_list)
        if not args.find_1x:
            for trace in args.trace_list:
                loads.parse_rates(args.rates, args.one_x_of.get(trace.name))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[fleet.RunFigures] = []
    searches: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if args.engines:
            engines = [url.strip().rstrip("/") for url in args.engines.split(",")]
            wait_healthy(engines)
        else:
            cores = os.cpu_count() or 1
            # Each engine on a core of its own; two on the last core would halve both.
            pins = [cores - 1, 0] if cores > 1 else [None, None]
            engines = stack.enter_context(started_engines(args.port, args.out, pins))
        model, tokenizer, max_model_len = model_info(engines[0])
        tokenizer = args.tokenizer or tokenizer
        caches_reset = reset_prefix_caches(engines)
        if not caches_reset:
            print(
                "warning: the engines lack POST /reset_prefix_cache: runs start with warm caches", flush=True
            )
        setup = Setup(tuple(engines), model, tokenizer, max_model_len, caches_reset, args)
        for trace in args.trace_list:
            one_x = args.one_x_of.get(trace.name)
            if args.find_1x:
                search = find_one_x(trace, setup, args.out)
                searches[trace.name] = {"one_x": search.one_x, "sustained": search.sustained}
                if search.one_x is None:
                    print(f"{trace.name}: no rate sustained; skipped", flush=True)
                    continue
                one_x = search.one_x
            for rate in loads.parse_rates(args.rates, one_x):
                for round_ in range(1, args.repeat + 1):
                    for target in args.target_list:
                        folder = args.out / f"{trace.name}-rate{rate:.4g}-{target}-r{round_}"
                        run = run_one(target, trace, rate, round_, setup, folder, args.clients)
                        runs.append(run)
                        print(fleet.render_runs([run]).splitlines()[-1], flush=True)
    table = fleet.render_runs(runs)
    verdicts = fleet.render_verdicts(fleet.verdicts(runs))
    text = table + ("\nkvgate against the SGLang policies:\n\n" + verdicts if verdicts else "")
    (args.out / "fleet.md").write_text(text)
    (args.out / "fleet.json").write_text(
        json.dumps(
            {
                "engines": list(setup.engines),
                "caches_reset": setup.caches_reset,
                "kvgate_single_backend": args.kvgate_single_backend,
                "clients": args.clients,
                "deadline_s": args.deadline,
                "n": args.n,
                "one_x": searches or args.one_x_of,
                "runs": [run.to_json() for run in runs],
            },
            indent=1,
        )
    )
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
