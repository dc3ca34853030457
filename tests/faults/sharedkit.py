"""Helpers of the shared-budget fault tests and benchmark (issue 19): several `kvgate serve`
processes on one emulator, one budget in a real Redis.

- `shared_settings`: the settings every process of one deployment gets (same Redis, same key
  prefix, a short lease TTL so that a dead process's leases expire while the test watches).
- `SharedKeys`: the Redis keys of SHARED_DESIGN.md for one backend, and reads of them.
- `Stream`/`stream_once`: one streamed completion, with the moments its first event and its
  end arrived (ordering, not timing, is what the tests compare).
- `LoadLoop`: streams sent back to back to one process from a thread until told to stop,
  every answer kept.
- `consistent`: whether Redis's booked total equals the processes' own in-flight reservations
  in one read that nothing changed in between.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from faultkit import KvgateProcess, sse_events, start_kvgate

from gateway.redis_store import RESERVE_LEASE

BACKEND = "default"
PREFIX = "kvgate"
RESERVE_SUFFIX = f":{RESERVE_LEASE}"
LEASE_TTL_S = 2.0
# Streams before any of these fail are answered; the few-second polls below are bounds on
# liveness (the system must get there at all), not performance targets.
CLIENT_TIMEOUT_S = 120.0
REFUSED_PAUSE_S = 0.05


def shared_settings(redis_url: str, **more: Any) -> dict[str, Any]:
    """Settings for `faultkit.start_kvgate` of one process of the deployment."""
    return {
        "redis_url": redis_url,
        "redis_key_prefix": PREFIX,
        "redis_lease_ttl_s": LEASE_TTL_S,
        # Past the budget's max fraction nothing is admitted: "the budget" is the pool.
        "budget_overcommit": 0,
        # Several processes scrape one emulator on a shared machine: a slower pace, and a
        # budget called stale only when scrapes have really stopped (a stale one is full).
        "metrics_poll_interval_s": 0.25,
        "metrics_stale_after_s": 5.0,
        # A waiter is served when room comes, however slowly the shared machine streams.
        "priority_classes": {"normal": {"queue_timeout_s": CLIENT_TIMEOUT_S}},
        **more,
    }


@dataclass(frozen=True, slots=True)
class SharedKeys:
    """The deployment's keys for one backend (SHARED_DESIGN.md)."""

    prefix: str = PREFIX
    backend: str = BACKEND

    @property
    def booked(self) -> str:
        return f"{{{self.prefix}}}:booked:{self.backend}"

    @property
    def lease(self) -> str:
        return f"{{{self.prefix}}}:lease:{self.backend}"

    @property
    def expiry(self) -> str:
        return f"{{{self.prefix}}}:expiry:{self.backend}"

    @property
    def alive(self) -> str:
        return f"{{{self.prefix}}}:alive"

    def booked_total(self, client: redis.Redis) -> int:
        """HGET booked total: the blocks of every live lease, the processes' standing reserves
        included (0 when there is none)."""
        value = client.hget(self.booked, "total")
        return int(value) if value is not None else 0

    def reserves(self, client: redis.Redis) -> dict[str, int]:
        """Owner -> the blocks of its standing reserve (gateway.reserve), for those that hold one."""
        return _reserves(client.hgetall(self.lease))

    def requests_booked(self, client: redis.Redis) -> int:
        """The blocks booked for requests: the total less the reserves, read in one transaction."""
        total, leases = (
            client.pipeline(transaction=True).hget(self.booked, "total").hgetall(self.lease).execute()
        )
        return int(total or 0) - sum(_reserves(leases).values())

    def owners_alive(self, client: redis.Redis) -> set[str]:
        return {str(owner) for owner in client.zrange(self.alive, 0, -1)}

    def holders(self, client: redis.Redis) -> set[str]:
        """The owners holding at least one request's lease."""
        return {
            str(value).rpartition(" ")[0]
            for lease_id, value in client.hgetall(self.lease).items()
            if not str(lease_id).endswith(RESERVE_SUFFIX)
        }

    def leases_of(self, client: redis.Redis, owner: str) -> dict[str, int]:
        """Lease id -> blocks, for the requests' leases `owner` holds ("<owner> <blocks>" values)."""
        leases: dict[str, int] = {}
        for lease_id, value in client.hgetall(self.lease).items():
            holder, _, blocks = str(value).rpartition(" ")
            if holder == owner and not str(lease_id).endswith(RESERVE_SUFFIX):
                leases[str(lease_id)] = int(blocks)
        return leases

    def booked_by(self, client: redis.Redis, owner: str) -> int:
        """The blocks `owner` booked, its reserve included."""
        value = client.hget(self.booked, owner)
        return int(value) if value is not None else 0


def _reserves(leases: dict[Any, Any]) -> dict[str, int]:
    held: dict[str, int] = {}
    for lease_id, value in leases.items():
        if str(lease_id).endswith(RESERVE_SUFFIX):
            holder, _, blocks = str(value).rpartition(" ")
            held[holder] = int(blocks)
    return held


def start_kvgates(
    stack: contextlib.ExitStack, backend_url: str, logs: Path, count: int, settings: dict[str, Any]
) -> list[KvgateProcess]:
    """`count` processes of one deployment, started together (each loads its tokenizer, which
    takes seconds) and ready; `stack` kills them at its end."""
    kvgates: list[KvgateProcess] = []
    for i in range(count):
        kvgate = start_kvgate(backend_url, logs / f"kvgate{i}.log", settings=settings, wait_ready=False)
        stack.callback(kvgate.stop, signal.SIGKILL)
        kvgates.append(kvgate)
    for kvgate in kvgates:
        kvgate.wait_ready()
    return kvgates


def backend_state(kvgate: KvgateProcess) -> dict[str, Any]:
    state: dict[str, Any] = kvgate.state()["backends"][0]
    return state


def own_reserved_blocks(kvgate: KvgateProcess) -> int:
    """The process's own in-flight reservations: the sum over the requests its /admin/state
    ledger lists. (The ledger's `reserved_blocks` is the shared view while Redis answers: its
    own plus what the others booked.)"""
    ledger = backend_state(kvgate)["ledger"]
    requests = ledger["requests"]
    if len(requests) != ledger["entries"]:
        raise AssertionError("the admin state lists only some of the requests: too many in flight")
    return sum(int(r["reserved_blocks"]) for r in requests)


def viewed_reserved_blocks(kvgate: KvgateProcess) -> int:
    """What the process counts as reserved on the backend: with Redis, everyone's bookings."""
    return int(backend_state(kvgate)["ledger"]["reserved_blocks"])


def entries(kvgate: KvgateProcess) -> int:
    return int(backend_state(kvgate)["ledger"]["entries"])


def admissible_blocks(kvgate: KvgateProcess) -> int:
    return int(backend_state(kvgate)["budget"]["admissible_blocks"])


def consistent(
    client: redis.Redis, keys: SharedKeys, kvgates: Sequence[KvgateProcess], *, views: bool = False
) -> bool:
    """Redis's blocks booked for requests equal the sum of the processes' own reservations,
    read between two equal reads (so no lease came or went while the ledgers were read). With
    `views`, each process's view of the backend's reservations equals the total less its own
    reserve (the others' reserves are booked for it; its own is its room)."""
    try:
        before = keys.requests_booked(client)
        own = sum(own_reserved_blocks(k) for k in kvgates)
        seen = [(viewed_reserved_blocks(k), owner_of(k)) for k in kvgates] if views else []
        reserves = keys.reserves(client)
        total = keys.booked_total(client)
        after = keys.requests_booked(client)
    except (redis.RedisError, httpx.HTTPError):
        return False
    return before == after == own and all(view == total - reserves.get(owner, 0) for view, owner in seen)


def owner_of(kvgate: KvgateProcess) -> str:
    """The process's name in the shared ledger."""
    return str(kvgate.state()["shared_ledger"]["owner"])


def redis_idle(client: redis.Redis, keys: SharedKeys) -> bool:
    """No request's lease left: the total is the reserves' and only reserves are leased."""
    reserves = keys.reserves(client)
    return keys.booked_total(client) == sum(reserves.values()) and client.hlen(keys.lease) == len(reserves)


# -- streams ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stream:
    """One streamed completion as its client saw it (monotonic seconds)."""

    status: int
    events: list[str]
    sent_at: float
    first_event_at: float | None
    ended_at: float
    retry_after: str | None
    body: str

    @property
    def completed(self) -> bool:
        return self.status == 200 and bool(self.events) and self.events[-1] == "[DONE]"


def token_stream(prompt_id: int, max_tokens: int) -> dict[str, Any]:
    """A streamed completion of one prompt token (an id: kvgate and the emulator count it alike)
    generating exactly `max_tokens`; different ids keep prompts apart in the prefix cache."""
    return {
        "model": "tiny-llama",
        "prompt": [prompt_id],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def stream_once(url: str, body: dict[str, Any], *, client: httpx.Client | None = None) -> Stream:
    """POST a streamed completion to `url` and read it to its end (on `client` if given: a
    connection opened beforehand lets several requests leave at the same moment)."""
    with contextlib.ExitStack() as stack:
        if client is None:
            client = stack.enter_context(httpx.Client(timeout=CLIENT_TIMEOUT_S))
        return _stream(client, url, body)


def _stream(client: httpx.Client, url: str, body: dict[str, Any]) -> Stream:
    sent_at = time.monotonic()
    first: float | None = None
    chunks: list[str] = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        for chunk in response.iter_text():
            if first is None and "data: " in chunk:
                first = time.monotonic()
            chunks.append(chunk)
        text = "".join(chunks)
        return Stream(
            status=response.status_code,
            events=sse_events(text) if response.status_code == 200 else [],
            sent_at=sent_at,
            first_event_at=first,
            ended_at=time.monotonic(),
            retry_after=response.headers.get("retry-after"),
            body=text,
        )


@dataclass
class LoadLoop:
    """Streams of `body` sent one after another to `url` from `threads` threads until `stop`.

    Transport errors are kept as status 0 (the client could not even get an answer)."""

    url: str
    body: dict[str, Any]
    threads: int = 2
    results: list[Stream] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> LoadLoop:
        for _ in range(self.threads):
            worker = threading.Thread(target=self._run, daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def halt(self) -> None:
        """Send nothing new (the streams in flight go on)."""
        self._stop.set()

    def stop(self, timeout_s: float = CLIENT_TIMEOUT_S) -> list[Stream]:
        """Send nothing new, wait for the streams in flight, return every answer."""
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout_s)
        if any(worker.is_alive() for worker in self._workers):
            raise AssertionError(f"a stream to {self.url} did not end within {timeout_s} s")
        with self._lock:
            return list(self.results)

    def since(self, moment: float) -> list[Stream]:
        with self._lock:
            return [r for r in self.results if r.sent_at >= moment]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                result = stream_once(self.url, self.body)
            except httpx.HTTPError as exc:
                now = time.monotonic()
                result = Stream(0, [], now, None, now, None, repr(exc))
            with self._lock:
                self.results.append(result)
            if not result.completed:
                # A refused client backs off a little (rather than the Retry-After's whole
                # seconds, so that the outage still sees many requests) instead of spinning.
                self._stop.wait(REFUSED_PAUSE_S)


def statuses(streams: Sequence[Stream]) -> Counter[int]:
    return Counter(s.status for s in streams)


def sample_while(
    condition: Callable[[], bool], sample: Callable[[], None], *, timeout_s: float, what: str
) -> None:
    """Call `sample` repeatedly until `condition` holds (AssertionError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        sample()
