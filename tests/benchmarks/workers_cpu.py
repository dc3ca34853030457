"""Benchmark: kvgate's CPU per relayed token with `--workers 2` against one process (issue 19; not a test).

    .venv/bin/python tests/benchmarks/workers_cpu.py [--streams 400] [--tokens-per-stream 100]
        [--repeat 3] [--json]

The load and the counters are tests/benchmarks/relay_cpu.py's: the emulator (`python -m sim.cli`)
as the backend, many streamed completions at once from a bare asyncio client, each process's
CPU time read from the kernel before and after. Three kvgates run in turn, alternating, each
round a fresh process:

- `one`: `kvgate serve --backend SIM` (one process, no Redis);
- `redis-1`: the same with `--redis redis://127.0.0.1:P/0 --workers 1` (one process, the
  ledger in Redis);
- `redis-2`: `--redis ... --workers 2`: a parent holding the socket and two workers under it;
- `redis-2-apart`: the same with `--set redis_shared_scrape=false`: each worker reads the
  backend's /metrics itself, where in `redis-2` one at a time does and the other takes its
  reading from Redis (gateway.shared_scrape).

Redis is a real `redis-server --port P --save '' --appendonly no`, started once and flushed
before each run. kvgate's CPU is that of the process `kvgate serve` started and of every
process under it (found through /proc/<pid>/task/<tid>/children), each read from its own
CPU-time clock. Reported, as microseconds of kvgate CPU per relayed token: `whole` (first
request to last answer) and `steady` (every stream open), and their ratios redis-2 / redis-1
and redis-2 / one.

Which worker carried a stream is read from the kernel, not from kvgate: at the moment every
stream has its first token (all of them open), each worker's descriptors are matched against
the established TCP sockets on kvgate's port (/proc/net/tcp), so each client connection is
counted to the one process that accepted it. The count must add up to the streams.

Pinning: a two-core machine cannot give two workers a core each beside the emulator, so in
every case all of kvgate's processes share core `--kvgate-cpu` (0) and the emulator, Redis and
this client share `--sim-cpu` (1). With two workers on one core the figure is what sharing
costs in CPU (two event loops, two pollers, the ledger's traffic), not what a second core
would add in throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import relay_cpu  # noqa: E402
from relay_cpu import REPO, LoadResult, Window, free_port, idle_share, kvgate_process  # noqa: E402

from sim.testing import sim_process  # noqa: E402

DEFAULT_STREAMS = 400
DEFAULT_TOKENS_PER_STREAM = 100
REDIS_SERVER = "/usr/bin/redis-server"
REDIS_READY_TIMEOUT_S = 10.0
# How long the workers of `--workers N` may take to all listen after the first one answers.
WORKERS_READY_TIMEOUT_S = 60.0
POLL_S = 0.1
KVGATE = "kvgate"  # the process `kvgate serve` started; its descendants are "kvgate/<pid>"
CASES = ("one", "redis-1", "redis-2", "redis-2-apart")
_ESTABLISHED = "01"


# -- processes under kvgate ---------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, children first (from each thread's children list)."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as children:
            for child in children.read().split():
                found.append(int(child))
                found.extend(descendants(int(child)))
    return found


def kvgate_pids(top: int) -> dict[str, int]:
    return {KVGATE: top, **{f"{KVGATE}/{pid}": pid for pid in descendants(top)}}


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _listen_fd(pid: int) -> int | None:
    """The inherited listening descriptor a worker was started with (gateway.workers)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            args = cmdline.read().split(b"\0")
    except OSError:
        return None
    if b"--listen-fd" in args:
        return int(args[args.index(b"--listen-fd") + 1])
    return None


def listens(pid: int) -> bool:
    """Whether `pid` watches its inherited listening socket in an epoll set: it serves. Read from
    /proc/<pid>/fdinfo of its epoll descriptors (a `tfd:` line per watched descriptor)."""
    fd = _listen_fd(pid)
    if fd is None:
        return False
    with contextlib.suppress(OSError):
        for entry in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{entry}") != "anon_inode:[eventpoll]":
                    continue
                with open(f"/proc/{pid}/fdinfo/{entry}") as info:
                    for line in info:
                        if line.startswith("tfd:") and int(line.split()[1]) == fd:
                            return True
    return False


def wait_for_workers(top: int, workers: int) -> list[int]:
    """With workers > 1, wait until `workers` processes under `top` listen; returns their pids."""
    if workers <= 1:
        return [top]
    deadline = time.monotonic() + WORKERS_READY_TIMEOUT_S
    while True:
        serving = [pid for pid in descendants(top) if listens(pid)]
        if len(serving) >= workers:
            return serving
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(serving)} of {workers} workers listen")
        time.sleep(POLL_S)


def established_inodes(port: int) -> set[int]:
    """Inodes of the established TCP sockets whose local port is `port` (kvgate's ends)."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows)
            for row in rows:
                columns = row.split()
                if columns[3] == _ESTABLISHED and int(columns[1].rpartition(":")[2], 16) == port:
                    inodes.add(int(columns[9]))
    return inodes


def streams_by_process(port: int, pids: Sequence[int]) -> dict[int, int]:
    """How many established connections on `port` each of `pids` holds."""
    open_here = established_inodes(port)
    return {pid: len(_socket_inodes(pid) & open_here) for pid in pids}


class _CountingLoad(relay_cpu._Load):
    """relay_cpu's load, which also counts each worker's connections once every stream is open."""

    def __init__(self, streams: int, pids: dict[str, int], port: int, workers: Sequence[int]) -> None:
        super().__init__(streams, pids)
        self._port = port
        self._workers = list(workers)
        self.carried: dict[int, int] | None = None

    def first_token(self, now: float) -> None:
        super().first_token(now)
        # After the steady window's first sample: the few ms this takes fall in the client.
        if self.steady_start is not None and self.carried is None:
            self.carried = streams_by_process(self._port, self._workers)


class _LoadMaker:
    """Builds the measured load's counters for relay_cpu.run_load and keeps them."""

    def __init__(self, port: int, workers: Sequence[int]) -> None:
        self._port = port
        self._workers = workers
        self.loads: list[_CountingLoad] = []

    def __call__(self, streams: int, pids: dict[str, int]) -> relay_cpu._Load:
        load = _CountingLoad(streams, pids, self._port, self._workers)
        self.loads.append(load)
        return load


# -- Redis --------------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_process(cpu: int | None, log: Path) -> Iterator[tuple[str, int]]:
    """A throwaway redis-server on a free port, nothing persisted; yields (url, pid)."""
    port = free_port()
    command = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
        deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise SystemExit(f"redis-server exited with {process.returncode}; see {log}")
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not answer; see {log}")
            time.sleep(POLL_S)
        client.close()
        yield f"redis://127.0.0.1:{port}/0", process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()


# -- the benchmark ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    case: str
    round_no: int
    result: LoadResult
    workers: list[int]  # the pids that serve
    carried: dict[int, int]  # streams per serving pid (empty: not counted)

    def kvgate_us(self, span: Window | None) -> float:
        """us of CPU per token of kvgate's processes together."""
        if span is None or not span.tokens:
            return float("nan")
        cpu = sum(value for name, value in span.cpu_s.items() if name.split("/")[0] == KVGATE)
        return cpu / span.tokens * 1e6

    def kvgate_idle_share(self) -> float:
        """kvgate's processes' share of a core together while idle before the load (pollers)."""
        idle = self.result.idle_cpu_share
        return sum(value for name, value in idle.items() if name.split("/")[0] == KVGATE)

    def kvgate_us_net(self, span: Window | None) -> float:
        """As kvgate_us, net of what the processes spend idle over the span's length."""
        if span is None or not span.tokens:
            return float("nan")
        return self.kvgate_us(span) - self.kvgate_idle_share() * span.seconds / span.tokens * 1e6

    def relative_to_emulator(self) -> float:
        """kvgate's steady us per token over the emulator's: the emulator's work per token is the
        same in every case, so this ratio takes out much of a shared machine's drift in speed."""
        steady = self.result.steady
        if steady is None:
            return float("nan")
        return self.kvgate_us(steady) / steady.us_per_token("emulator")

    def worker_cpu_share(self) -> dict[int, float]:
        """Each serving process's part of kvgate's CPU over the whole load."""
        cpu = self.result.whole.cpu_s
        names = {pid: KVGATE if pid == self.workers[0] and len(self.workers) == 1 else f"{KVGATE}/{pid}"
                 for pid in self.workers}  # fmt: skip
        total = sum(value for name, value in cpu.items() if name.split("/")[0] == KVGATE)
        return {pid: cpu.get(name, 0.0) / total if total > 0 else float("nan") for pid, name in names.items()}

    def stream_share(self) -> dict[int, float]:
        total = sum(self.carried.values())
        return {pid: count / total for pid, count in self.carried.items()} if total else {}

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "round": self.round_no,
            "kvgate_whole_us_per_token": round(self.kvgate_us(self.result.whole), 3),
            "kvgate_steady_us_per_token": round(self.kvgate_us(self.result.steady), 3),
            "streams_carried": {str(pid): n for pid, n in self.carried.items()},
            "worker_cpu_share": {str(pid): round(v, 4) for pid, v in self.worker_cpu_share().items()},
            "load": self.result.to_json(),
        }


@dataclass
class Options:
    streams: int = DEFAULT_STREAMS
    tokens_per_stream: int = DEFAULT_TOKENS_PER_STREAM
    prompt_tokens: int = relay_cpu.DEFAULT_PROMPT_TOKENS
    step_ms: float = relay_cpu.DEFAULT_STEP_MS
    repeat: int = 3
    cases: list[str] = field(default_factory=lambda: list(CASES))
    kvgate_cpu: int | None = 0
    sim_cpu: int | None = 1
    idle_s: float = 1.0


def case_args(case: str, redis_url: str) -> list[str]:
    if case == "one":
        return []
    args = ["--redis", redis_url, "--workers", case.split("-")[1]]
    if case.endswith("-apart"):
        args += ["--set", "redis_shared_scrape=false"]
    return args


def run_benchmark(options: Options, report: Any = print) -> list[Run]:
    if options.sim_cpu is not None:
        os.sched_setaffinity(0, {options.sim_cpu})  # the client beside the emulator
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-workers-cpu-"))
    config = relay_cpu.sim_config(
        options.streams, options.prompt_tokens, options.tokens_per_stream, options.step_ms
    )
    runs: list[Run] = []
    with (
        sim_process(config, cpu=options.sim_cpu, log=workdir / "sim.log") as sim,
        redis_process(options.sim_cpu, workdir / "redis.log") as (redis_url, redis_pid),
    ):
        for round_no in range(options.repeat):
            for case in options.cases:
                flush_redis(redis_url)
                args = case_args(case, redis_url)
                workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
                log = workdir / f"kvgate-{round_no}-{case}.log"
                with kvgate_process(REPO, sim.url, options.kvgate_cpu, log, args, options.streams) as (
                    url,
                    top,
                ):
                    serving = wait_for_workers(top, workers)
                    pids = {**kvgate_pids(top), "emulator": sim.pid}
                    if case != "one":
                        pids["redis"] = redis_pid
                    port = int(url.rpartition(":")[2])
                    relay_cpu.run_load(url, sim.url, target="kvgate", label=case, pids=pids,
                                       streams=relay_cpu.WARMUP_STREAMS, tokens=relay_cpu.WARMUP_TOKENS,
                                       prompt_tokens=options.prompt_tokens)  # fmt: skip
                    idle = idle_share(pids, options.idle_s) if options.idle_s > 0 else {}
                    make_load = _LoadMaker(port, serving)
                    result = relay_cpu.run_load(url, sim.url, target="kvgate", label=case, pids=pids,
                                                streams=options.streams, tokens=options.tokens_per_stream,
                                                prompt_tokens=options.prompt_tokens, idle_cpu_share=idle,
                                                make_load=make_load)  # fmt: skip
                    carried = make_load.loads[0].carried or {}
                    run = Run(case, round_no, result, serving, carried)
                    runs.append(run)
                    report(describe(run))
    return runs


def describe(run: Run) -> str:
    result = run.result
    check = "exact" if result.exact else "NOT EXACT"
    lines = [
        f"{run.case} #{run.round_no}: {result.tokens_counted} tokens ({check}), {len(result.errors)} errors; "
        f"kvgate whole {run.kvgate_us(result.whole):.2f} us/token, steady {run.kvgate_us(result.steady):.2f}, "
        f"steady net of idle {run.kvgate_us_net(result.steady):.2f} (idle {run.kvgate_idle_share():.3f} core)"
    ]
    for name, span in (("whole", result.whole), ("steady", result.steady)):
        if span is None:
            continue
        shares = ", ".join(f"{n} {span.core_share(n):.2f}" for n in span.cpu_s)
        lines.append(f"  {name}: {span.tokens} tokens in {span.seconds:.2f} s; core shares: {shares}")
    if run.carried:
        cpu = run.worker_cpu_share()
        lines.append(
            "  streams per serving process: "
            + ", ".join(f"pid {pid} {n} ({cpu[pid]:.0%} of kvgate CPU)" for pid, n in run.carried.items())
        )
    if result.errors:
        lines.append(f"  first errors: {result.errors[:3]}")
    return "\n".join(lines)


def _median(values: Sequence[float]) -> float:
    present = [v for v in values if v == v]
    return statistics.median(present) if present else float("nan")


def _figure(run: Run, span: str) -> float:
    if span == "whole":
        return run.kvgate_us(run.result.whole)
    if span == "steady":
        return run.kvgate_us(run.result.steady)
    if span == "steady over the emulator's":
        return run.relative_to_emulator()
    return run.kvgate_us_net(run.result.steady)


def summary(runs: list[Run]) -> dict[str, Any]:
    """Per case the median over its runs; the ratios of the medians, and of the rounds."""
    figures: dict[str, Any] = {}
    for case in dict.fromkeys(run.case for run in runs):
        mine = [run for run in runs if run.case == case]
        figures[case] = {
            "runs": len(mine),
            "whole_us_per_token": round(_median([r.kvgate_us(r.result.whole) for r in mine]), 3),
            "steady_us_per_token": round(_median([r.kvgate_us(r.result.steady) for r in mine]), 3),
            "steady_net_of_idle_us_per_token": round(_median([r.kvgate_us_net(r.result.steady) for r in mine]), 3),
            "steady_over_emulator": round(_median([r.relative_to_emulator() for r in mine]), 3),
            "idle_core_share": round(_median([r.kvgate_idle_share() for r in mine]), 4),
            "emulator_whole_us_per_token": round(_median([r.result.whole.us_per_token("emulator") for r in mine]), 3),
            "stream_shares": [sorted((round(v, 3) for v in r.stream_share().values()), reverse=True) for r in mine],
            "exact": all(r.result.exact for r in mine),
        }  # fmt: skip
    ratios: dict[str, Any] = {}
    for over in ("redis-1", "one", "redis-2-apart"):
        if "redis-2" not in figures or over not in figures:
            continue
        for span, key in (
            ("whole", "whole_us_per_token"),
            ("steady", "steady_us_per_token"),
            ("steady net of idle", "steady_net_of_idle_us_per_token"),
            ("steady over the emulator's", "steady_over_emulator"),
        ):
            per_round = []
            for round_no in sorted({r.round_no for r in runs}):
                pair = {r.case: r for r in runs if r.round_no == round_no}
                if "redis-2" in pair and over in pair:
                    a, b = pair["redis-2"], pair[over]
                    per_round.append(_figure(a, span) / _figure(b, span))
            ratios[f"redis-2/{over} {span}"] = {
                "of_medians": round(figures["redis-2"][key] / figures[over][key], 3),
                "per_round": [round(v, 3) for v in per_round],
            }
    figures["ratios"] = ratios
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=DEFAULT_STREAMS)
    parser.add_argument("--tokens-per-stream", type=int, default=DEFAULT_TOKENS_PER_STREAM)
    parser.add_argument("--prompt-tokens", type=int, default=relay_cpu.DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--step-ms", type=float, default=relay_cpu.DEFAULT_STEP_MS)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each runs every case once")
    parser.add_argument("--case", action="append", choices=CASES, help="only these cases (repeatable)")
    parser.add_argument("--kvgate-cpu", type=int, default=0, help="core of all of kvgate's processes")
    parser.add_argument("--sim-cpu", type=int, default=1, help="core of the emulator, Redis and this client")
    parser.add_argument("--idle-s", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print every run and the summary as JSON")
    args = parser.parse_args(argv)
    options = Options(
        streams=args.streams,
        tokens_per_stream=args.tokens_per_stream,
        prompt_tokens=args.prompt_tokens,
        step_ms=args.step_ms,
        repeat=args.repeat,
        cases=args.case or list(CASES),
        kvgate_cpu=args.kvgate_cpu,
        sim_cpu=args.sim_cpu,
        idle_s=args.idle_s,
    )
    runs = run_benchmark(options, (lambda text: None) if args.json else print)
    figures = summary(runs)
    if args.json:
        print(json.dumps({"runs": [r.to_json() for r in runs], "summary": figures}, indent=2))
    else:
        print("\nsummary (median over runs): us of kvgate CPU (all its processes) per relayed token")
        for case in options.cases:
            row = figures[case]
            print(
                f"  {case}: whole {row['whole_us_per_token']:.2f}  steady {row['steady_us_per_token']:.2f}  "
                f"steady net of idle {row['steady_net_of_idle_us_per_token']:.2f} (idle {row['idle_core_share']:.3f} core)  "
                f"steady over the emulator's {row['steady_over_emulator']:.2f}  "
                f"(emulator {row['emulator_whole_us_per_token']:.2f}; {row['runs']} runs; "
                f"{'exact' if row['exact'] else 'NOT EXACT'}; stream shares {row['stream_shares']})"
            )
        for name, ratio in figures["ratios"].items():
            print(f"  {name}: {ratio['of_medians']:.3f} (per round {ratio['per_round']})")
    return 0 if all(run.result.exact for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
