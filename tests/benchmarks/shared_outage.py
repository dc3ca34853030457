"""Benchmark: a budget shared through Redis when a process dies and when Redis goes away (issue
19's measurements; not a test).

    PYTHONPATH=. .venv/bin/python tests/benchmarks/shared_outage.py [--outage-s 10]
        [--how restart|pause] [--lease-ttl-s 2] [--json build/shared_outage.json]

Each scenario starts an emulator (127 blocks, fixed-time steps), a fresh redis-server and two
`kvgate serve` processes sharing one budget in it, with the lease TTL given.

- kill: process A streams two long completions, B a steady load of short ones; A is killed
  with SIGKILL. Measured: the seconds until A's leases are gone from Redis and Redis's total
  equals B's own reservations (the blocks are back), and how B's streams ended.
- outage, once per mode (fail_closed, fail_open): a long stream on each process and a steady
  load of short ones on both; Redis is stopped for --outage-s (SIGKILL and a new empty server
  on the same port, or SIGSTOP/SIGCONT with --how pause). Measured: how soon each process
  noticed (kvgate_shared_ledger_up 0), what the requests sent during the outage were answered,
  and, from Redis's return, the seconds until both processes are ready and until Redis's total
  equals the sum of their in-flight reservations (new sends stop at the return, so that the
  sum holds still; the long streams are still in flight then).

It prints one table and exits 0 when every scenario reached its end state (no 500, no process
died, consistent after the return), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, HERE.parent, HERE.parent / "faults"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import httpx  # noqa: E402
from faultkit import KvgateProcess, SimProcess  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from sharedkit import (  # noqa: E402
    LoadLoop,
    SharedKeys,
    Stream,
    consistent,
    entries,
    shared_settings,
    start_kvgates,
    stream_once,
    token_stream,
)

from sim.config import SimConfig  # noqa: E402
from sim.engine import EngineConfig, StepCost  # noqa: E402

POLL_S = 0.02
GIVE_UP_S = 60.0


def long_stream(i: int) -> dict[str, Any]:
    return token_stream(3000 + i, 900)


def short_stream(i: int) -> dict[str, Any]:
    return token_stream(4000 + i, 100)


def seconds_until(predicate: Callable[[], bool], limit_s: float = GIVE_UP_S) -> float | None:
    """Seconds until `predicate` held (polled), None if it did not within `limit_s`."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        with contextlib.suppress(Exception):
            if predicate():
                return time.monotonic() - started
        time.sleep(POLL_S)
    return None


def first_times(conditions: dict[str, Callable[[], bool]], limit_s: float = GIVE_UP_S) -> dict[str, float]:
    """Seconds until each condition first held (polled together); missing: not within `limit_s`."""
    started = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < len(conditions) and time.monotonic() - started < limit_s:
        for name, condition in conditions.items():
            if name not in seen:
                with contextlib.suppress(Exception):
                    if condition():
                        seen[name] = time.monotonic() - started
        time.sleep(POLL_S)
    return seen


def shared_ledger_up(kvgate: KvgateProcess) -> float | None:
    for line in httpx.get(f"{kvgate.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("kvgate_shared_ledger_up"):
            return float(line.rsplit(" ", 1)[1])
    return None


def answers(streams: Sequence[Stream]) -> dict[str, int]:
    """Status -> count; a stream answered 200 that did not end in [DONE] counts as 'cut'."""
    tally: Counter[str] = Counter()
    for s in streams:
        tally["cut" if s.status == 200 and not s.completed else str(s.status)] += 1
    return dict(sorted(tally.items()))


@dataclass
class Row:
    scenario: str
    mode: str
    answered: dict[str, int] = field(default_factory=dict)
    noticed_s: float | None = None
    ready_s: float | None = None
    consistent_s: float | None = None
    blocks_back_s: float | None = None
    ok: bool = False
    note: str = ""


@contextlib.contextmanager
def deployment(
    work: Path, step_s: float, settings: dict[str, Any]
) -> Iterator[tuple[RedisServer, list[KvgateProcess]]]:
    """An emulator, an empty redis-server and two kvgate processes sharing a budget in it."""
    engine = EngineConfig(
        num_blocks=128, step_cost=StepCost(base_s=step_s, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0)
    )
    sim = SimProcess(SimConfig(engine=engine))
    server = RedisServer(work / "redis.log")
    with contextlib.ExitStack() as stack:
        sim.start()
        stack.callback(sim.stop)
        server.start()
        stack.callback(server.stop)
        kvgates = start_kvgates(stack, sim.url, work, 2, shared_settings(server.url, **settings))
        yield server, kvgates


def kill_scenario(work: Path, step_s: float, ttl_s: float) -> Row:
    row = Row("kill -9 one of two", "-")
    keys = SharedKeys()
    with (
        deployment(work, step_s, {"redis_lease_ttl_s": ttl_s}) as (server, (victim, survivor)),
        ThreadPoolExecutor(4) as pool,
    ):
        store = server.client()
        doomed = [pool.submit(stream_once, victim.url, long_stream(i)) for i in range(2)]
        if seconds_until(lambda: entries(victim) == 2 and len(keys.holders(store)) == 1) is None:
            row.note = "the victim's streams were never booked in Redis"
            return row
        (owner,) = keys.holders(store)
        load = LoadLoop(survivor.url, short_stream(0), threads=2).start()
        seconds_until(lambda: len(keys.holders(store)) == 2)
        victim.stop(signal.SIGKILL)
        row.blocks_back_s = seconds_until(
            lambda: not keys.leases_of(store, owner) and consistent(store, keys, [survivor])
        )
        for future in doomed:
            with contextlib.suppress(Exception):
                future.result(timeout=60)
        time.sleep(2 * ttl_s)  # more of the load on the survivor alone
        row.answered = answers(load.stop())
        row.ok = row.blocks_back_s is not None and set(row.answered) == {"200"} and survivor.ready()
    return row


def outage_scenario(work: Path, step_s: float, ttl_s: float, mode: str, how: str, outage_s: float) -> Row:
    row = Row(f"Redis {'paused' if how == 'pause' else 'killed, restarted'} {outage_s:g} s", mode)
    keys = SharedKeys()
    settings = {"redis_lease_ttl_s": ttl_s, "redis_unavailable": mode}
    with deployment(work, step_s, settings) as (server, kvgates), ThreadPoolExecutor(4) as pool:
        store = server.client()
        longs = [pool.submit(stream_once, k.url, long_stream(i)) for i, k in enumerate(kvgates)]
        if seconds_until(lambda: consistent(store, keys, kvgates) and keys.booked_total(store) > 0) is None:
            row.note = "the long streams were never booked in Redis"
            return row
        loads = [LoadLoop(k.url, short_stream(i), threads=2).start() for i, k in enumerate(kvgates)]
        time.sleep(1.0)  # the load under way
        (server.pause if how == "pause" else server.kill)()
        away_at = time.monotonic()
        row.noticed_s = seconds_until(lambda: all(shared_ledger_up(k) == 0 for k in kvgates), outage_s)
        time.sleep(max(0.0, away_at + outage_s - time.monotonic()))
        for load in loads:
            load.halt()
        (server.resume if how == "pause" else server.start)()
        back_at = time.monotonic()
        seen = first_times(
            {
                "ready": lambda: all(k.ready() for k in kvgates),
                "consistent": lambda: consistent(store, keys, kvgates),
            }
        )
        row.ready_s = seen.get("ready")
        row.consistent_s = seen.get("consistent")
        in_flight = not all(f.done() for f in longs)
        streams = [s for load in loads for s in load.stop()]
        row.answered = answers([s for s in streams if away_at <= s.sent_at < back_at])
        alive = all(k.process.poll() is None for k in kvgates)
        no_500 = all(s.status != 500 for s in streams)
        row.ok = alive and no_500 and len(seen) == 2
        if not in_flight:
            row.note = "the long streams had ended before the check"
    return row


def table(rows: Sequence[Row]) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    head = [
        "scenario",
        "mode",
        "answered (status: count)",
        "noticed s",
        "ready s",
        "consistent s",
        "blocks back s",
        "ok",
    ]
    lines = [
        [
            r.scenario,
            r.mode,
            " ".join(f"{k}:{v}" for k, v in r.answered.items()) or "-",
            fmt(r.noticed_s),
            fmt(r.ready_s),
            fmt(r.consistent_s),
            fmt(r.blocks_back_s),
            ("yes" if r.ok else "NO") + (f" ({r.note})" if r.note else ""),
        ]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in column) for column in zip(head, *lines, strict=True)]
    out = [" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--outage-s", type=float, default=10.0)
    parser.add_argument("--how", choices=["restart", "pause"], default="restart")
    parser.add_argument("--lease-ttl-s", type=float, default=2.0)
    parser.add_argument(
        "--step-ms", type=float, default=30.0, help="emulator step: a long stream lasts 900 steps"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    step_s = args.step_ms / 1000
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="shared-outage-") as tmp:
        work = Path(tmp)
        scenarios: list[tuple[str, Callable[[Path], Row]]] = [
            ("kill", functools.partial(kill_scenario, step_s=step_s, ttl_s=args.lease_ttl_s)),
        ]
        for mode in ("fail_closed", "fail_open"):
            outage = functools.partial(
                outage_scenario,
                step_s=step_s,
                ttl_s=args.lease_ttl_s,
                mode=mode,
                how=args.how,
                outage_s=args.outage_s,
            )
            scenarios.append((mode, outage))
        for name, run in scenarios:
            folder = work / name
            folder.mkdir()
            rows.append(run(folder))
    print(f"lease TTL {args.lease_ttl_s:g} s, emulator step {args.step_ms:g} ms, two kvgate processes")
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
