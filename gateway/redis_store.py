"""The shared ledger in Redis: every kvgate process in front of the same backends, one budget.

What lives in Redis (the layout is in gateway/lua/common.lua): a lease per admitted request,
holding its reserved blocks with an expiry in the server's time; per backend the sum of the
leases, in total and per process; and what each process published at its last scrape (its
requests' held blocks and credit, and its cap: the most its own view of the budget allows to
be booked). Everything else stays in each process: its wait queue, its budget of each backend (fed by the
reading one process at a time takes of the backend's /metrics for all, gateway.shared_scrape),
its output-length model and its drain rates.

Why a sum never exceeds the budget: a booking is one Lua script run atomically on the server.
It books each request on the first of its candidate backends whose booked total plus the
request's blocks stays within the smallest cap any live process published (and the caller's
own): the most conservative view of the budget among the processes, so the AIMD shares,
learned lengths and drain rates they keep apart may differ without anyone over-promising.

Leases: the process renews its leases every third of `redis_lease_ttl_s`, saying which of its
requests still live and what they reserve. A process that dies stops renewing and its leases
expire; a release that was lost (a timeout, a cancelled task) expires the same way, and a
lease that expired while its request still runs (Redis was away) is booked again by the next
renewal, since vLLM really holds that request's KV. Nothing ever needs a manual reset.

Every call goes through one writer task: each round trip is one pipeline carrying everything
pending (the readings this process took as a scrape lease's holder first, then the reserves'
takes, releases, bookings, the reserves' new sizes and renewals), so a burst of admissions
costs one round trip, and the answers come back in the order the changes were made.

While nobody waits for a backend, an admission that fits this process's standing reserve on
it (gateway.reserve) is answered at once, without a round trip, and told to Redis with the
next one.

While Redis cannot be reached, `redis_unavailable` decides: `fail_closed` makes every budget
unknown (new requests get 503 with Retry-After, /readyz says why); `fail_open` admits within
`1 / N` of each budget over this process's own requests, N the processes last seen alive (at
least `workers`). The writer retries every RECONNECT_S; the first renewal that succeeds books
again whatever this process admitted meanwhile, and the process is back in the shared count.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Gauge
from redis.exceptions import NoScriptError, RedisError

from gateway.capacity import BudgetSnapshot
from gateway.credentials import redact_url
from gateway.metrics import GatewayMetrics
from gateway.reserve import RESERVE_DIVISOR, Reserve, reserve_target
from gateway.settings import Settings
from gateway.shared_scrape import ScrapeShare, redis_text
from gateway.shared_view import PeerView, SharedLedger
from gateway.waitqueue import Booking, BookingAnswer

log = logging.getLogger(__name__)

# While Redis cannot be reached, how often the writer tries again.
RECONNECT_S = 0.5
# Renewals carry every live lease this many times per TTL: one lost renewal costs nothing.
RENEWALS_PER_TTL = 3
# Round trips that must fail in a row before Redis counts as unreachable.
FAILURES_TO_UNREACHABLE = 2
# Releases kept for Redis's return while it is away; past this many the leases' expiry repairs it.
MAX_PENDING_RELEASES = 100_000
# How soon releases and resizes go to Redis after they are made (a booking takes them along
# at once): soon enough that the others see the room, late enough that a stream's first
# token is not sent beside a round trip and that a busy process's changes go in a few trips.
CHANGES_FLUSH_S = 0.01
# The lease id of a process's standing reserve on a backend: "<owner>:reserve" (a request's is
# "<owner>:<key>", key an integer).
RESERVE_LEASE = "reserve"


LUA = Path(__file__).with_name("lua")


def _script(name: str) -> str:
    lua = LUA
    return (lua / "common.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


def owner_id() -> str:
    """This process among all that share the ledger: host, pid and a random part (a pid is
    reused by a restarted container)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class KeyNames:
    """The Redis keys of one deployment (`prefix`): one hash tag, one Cluster slot."""

    prefix: str

    def backend(self, name: str) -> list[str]:
        tag = f"{{{self.prefix}}}"
        return [f"{tag}:{part}:{name}" for part in ("lease", "expiry", "booked", "peer")]

    @property
    def alive(self) -> str:
        return f"{{{self.prefix}}}:alive"

    def booked(self, name: str) -> str:
        return self.backend(name)[2]

    def scrape(self, name: str) -> list[str]:
        """The backend's scrape lease and shared reading (gateway.shared_scrape)."""
        tag = f"{{{self.prefix}}}"
        return [f"{tag}:{part}:{name}" for part in ("scrape-lease", "reading")]


def cap_of(snapshot: BudgetSnapshot, credit_blocks: int) -> int | None:
    """The most that may be booked on the backend by this process's view of its budget: the
    admissible blocks, less usage no request explains, plus what vLLM shares between requests.
    None when the budget is not known (then it books nothing and publishes no cap)."""
    if not snapshot.known:
        return None
    return snapshot.admissible_blocks - snapshot.external_blocks + credit_blocks


@dataclass(slots=True)
class _BackendLink:
    ledger: SharedLedger
    snapshot: Callable[[], BudgetSnapshot]
    settled_before: Callable[[], float]
    waiting: Callable[[], int]
    # (lease key, blocks) in the order the changes were made: blocks 0 releases.
    changes: list[tuple[int, int]] = field(default_factory=list)
    publish: bool = False
    reserve: Reserve = field(default_factory=Reserve)


@dataclass(slots=True)
class _Trip:
    """What one round trip carries, in the order the pipeline sends it."""

    readings: list[tuple[ScrapeShare, list[str | int]]]  # scrape_publish.lua's arguments
    takes: list[tuple[_BackendLink, list[tuple[int, int]], int]]  # (link, takes, target or -1)
    changes: list[tuple[_BackendLink, list[tuple[int, int]]]]
    bookings: list[_PendingBooking]
    sizes: list[tuple[_BackendLink, int]]  # the reserves' new sizes, after the bookings
    publishing: list[_BackendLink]
    renew: bool

    def empty(self) -> bool:
        return not (
            self.readings or self.takes or self.bookings or self.sizes or self.publishing or self.renew
            or any(pending for _, pending in self.changes)
        )  # fmt: skip


@dataclass(slots=True)
class _PendingBooking:
    bookings: Sequence[Booking]
    answer: Callable[[BookingAnswer], None]


class RedisLedgerStore:
    """The shell around the shared ledger (see the module docstring). One event loop."""

    def __init__(
        self,
        settings: Settings,
        metrics: GatewayMetrics,
        *,
        client: aioredis.Redis | None = None,
        owner: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert settings.redis_url is not None or client is not None
        self.settings = settings
        self.metrics = metrics
        self.owner = owner or owner_id()
        self.keys = KeyNames(settings.redis_key_prefix)
        self._clock = clock
        url = settings.redis_url.get_secret_value() if settings.redis_url is not None else ""
        self._url = redact_url(url) if url else "(given client)"
        self._redis: aioredis.Redis = client or aioredis.Redis.from_url(
            url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            health_check_interval=0,
        )
        # Loaded once (SCRIPT LOAD) and called by digest: redis-py's script objects ask the
        # server whether they exist before every pipeline, a second round trip each time.
        self._sources = {
            name: _script(name) for name in ("book", "release", "renew", "reserve", "scrape_publish")
        }
        self._digests = {
            name: hashlib.sha1(source.encode()).hexdigest() for name, source in self._sources.items()
        }
        self._loaded = False
        self._links: dict[str, _BackendLink] = {}
        self._bookings: list[_PendingBooking] = []
        self._wake = asyncio.Event()
        self._flush: asyncio.TimerHandle | None = None
        self._renew_due = True
        self._renewed_at = -math.inf
        self.connected = False
        self._ever_connected = False
        self._reported_down = False
        self._fail_open = settings.redis_unavailable == "fail_open"
        self._attempted_at = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failures = 0
        self._gauges: list[Gauge] = []
        self._shares: list[ScrapeShare] = []

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._write_forever(), name="kvgate-shared-ledger")
        up = Gauge(
            "kvgate_shared_ledger_up",
            "1 while the shared ledger (Redis) answers, 0 while it cannot be reached",
            registry=self.metrics.registry,
        )
        up.set_function(lambda: 1.0 if self.connected else 0.0)
        processes = Gauge(
            "kvgate_shared_ledger_processes",
            "kvgate processes the shared ledger saw alive at the last renewal, this one included",
            registry=self.metrics.registry,
        )
        processes.set_function(lambda: float(self.processes()))
        self._gauges = [up, processes]

    async def stop(self, *, give_back: bool = True) -> None:
        """Leave: with `give_back`, first return every lease still booked (the requests were
        completed or cut by now), bounded by the Redis timeout and harmless if Redis is away;
        without, leave them to expire, as a process that crashes does."""
        # A flag first, then a cancellation: the writer should not be stopped in the middle of
        # a pipeline, and a cancellation there can be absorbed by the client (see the writer).
        if self._stopping:
            return
        self._stopping = True
        for share in self._shares:
            share.stopped = True  # the client closes below; the pollers read for themselves
        self._wake.set()
        if self._task is not None:
            patience = self.settings.redis_timeout_s * 4
            await asyncio.wait({self._task}, timeout=patience + RECONNECT_S)
            if not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=patience)
            self._task = None
        if give_back:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.settings.redis_timeout_s * 4):
                    await self._round_trip()
                    await self._redis.zrem(self.keys.alive, self.owner)
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        for gauge in self._gauges:
            with contextlib.suppress(KeyError):
                self.metrics.registry.unregister(gauge)
        self._gauges = []
        await self._redis.aclose()

    # -- what the fleet wires -------------------------------------------------------------

    def ledger(self, backend: str) -> SharedLedger:
        """A new shared ledger for `backend` (link it with `attach` once its budget exists)."""
        ledger = SharedLedger(backend, self)
        ledger.fail_open = self._fail_open
        ledger.processes = self.settings.workers
        return ledger

    def scrape_share(self, backend: str) -> ScrapeShare | None:
        """`backend`'s /metrics scrape shared with the other processes (None: not shared)."""
        if not self.settings.redis_shared_scrape:
            return None
        settings = self.settings
        share = ScrapeShare(
            self._redis,
            self.keys.scrape(backend),
            self.owner,
            _script("scrape_turn"),
            processes=self.processes,
            wake=self._wake.set,
            interval_s=settings.metrics_poll_interval_s,
            timeout_s=settings.metrics_timeout_s,
            stale_after_s=settings.metrics_stale_after_s,
        )
        self._shares.append(share)
        return share

    def attach(
        self,
        ledger: SharedLedger,
        snapshot: Callable[[], BudgetSnapshot],
        settled_before: Callable[[], float],
        waiting: Callable[[], int],
    ) -> None:
        """Link `ledger` to its backend's budget, the settle horizon of its scrapes and how many
        of this process's requests wait for it."""
        self._links[ledger.backend] = _BackendLink(ledger, snapshot, settled_before, waiting)
        self._renew_due = True
        self._wake.set()

    def detach(self, backend: str) -> None:
        """The backend left the fleet (its requests are done): forget it."""
        self._links.pop(backend, None)

    def describe(self) -> dict[str, Any]:
        """/admin/state's view of the shared ledger."""
        return {
            "url": self._url,
            "key_prefix": self.settings.redis_key_prefix,
            "owner": self.owner,
            "connected": self.connected,
            "mode_when_unreachable": self.settings.redis_unavailable,
            "processes": self.processes(),
            "lease_ttl_s": self.settings.redis_lease_ttl_s,
            "others_booked_blocks": {name: link.ledger.others_booked for name, link in self._links.items()},
            "reserve_blocks": {name: link.reserve.available for name, link in self._links.items()},
        }

    def processes(self) -> int:
        return max((link.ledger.processes for link in self._links.values()), default=1)

    def scraped(self, backend: str) -> None:
        """A scrape of `backend` succeeded: publish this process's view and cap of it."""
        link = self._links.get(backend)
        if link is not None:
            link.publish = True
            self._wake.set()

    # -- Booker (gateway.waitqueue) ---------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.connected

    def book(self, bookings: Sequence[Booking], answer: Callable[[BookingAnswer], None]) -> None:
        if self._take_from_reserves(bookings):
            for booking in bookings:
                self.metrics.shared_reserve_admissions.labels(booking.candidates[0][0]).inc()
            # The takes ride with the next round trip (at the latest the next scrape's): their
            # blocks are booked already, and a round trip now would compete with the request's
            # first token for the loop.
            asyncio.get_running_loop().call_soon(answer, [booking.candidates[0][0] for booking in bookings])
            return
        self._bookings.append(_PendingBooking(bookings, answer))
        self._wake.set()

    def _take_from_reserves(self, bookings: Sequence[Booking]) -> bool:
        """Admit the whole batch from the reserves of its chosen backends, if they hold it."""
        if not self.connected:
            return False
        needs: dict[str, int] = {}
        for booking in bookings:
            name, blocks = booking.candidates[0]
            needs[name] = needs.get(name, 0) + blocks
        for name, blocks in needs.items():
            link = self._links.get(name)
            if link is None or not link.reserve.fits(blocks):
                return False
        for booking in bookings:
            name, blocks = booking.candidates[0]
            self._links[name].reserve.take(booking.key, blocks)
        return True

    def release(self, target: str, key: int) -> None:
        self.released(target, key)

    # -- LeaseSink (gateway.shared_view) ----------------------------------------------------

    def resized(self, backend: str, key: int, blocks: int) -> None:
        self._change(backend, key, blocks)

    def released(self, backend: str, key: int) -> None:
        self._change(backend, key, 0)

    def _change(self, backend: str, key: int, blocks: int) -> None:
        link = self._links.get(backend)
        if link is None:
            return
        if len(link.changes) >= MAX_PENDING_RELEASES:
            return  # Redis has been away long: the leases' expiry repairs what is dropped
        link.changes.append((key, blocks))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(CHANGES_FLUSH_S, self._flushed)

    def _flushed(self) -> None:
        self._flush = None
        self._wake.set()

    # -- the writer -----------------------------------------------------------------------

    def _lease_id(self, key: int) -> str:
        return f"{self.owner}:{key}"

    async def _write_forever(self) -> None:
        renew_every = self.settings.redis_lease_ttl_s / RENEWALS_PER_TTL
        while not self._stopping:
            # redis-py can absorb a cancellation that arrives in the middle of a call (its own
            # clean-up catches it): a cancelled writer must still stop, at the next pass.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            if self.connected:
                wait = renew_every - (self._clock() - self._renewed_at)
                if wait > 0:
                    # asyncio.wait, not a timeout around the event: a cancellation that meets
                    # the timeout's expiry must not be swallowed with it (Python 3.11).
                    woken = asyncio.ensure_future(self._wake.wait())
                    try:
                        await asyncio.wait({woken}, timeout=wait)
                    finally:
                        woken.cancel()
            else:
                # Away: try again at a steady pace, however many changes wait to be sent.
                await asyncio.sleep(max(0.0, RECONNECT_S - (self._clock() - self._attempted_at)))
            self._wake.clear()
            if self._stopping:
                return
            self._attempted_at = self._clock()
            if not self.connected or self._clock() - self._renewed_at >= renew_every:
                self._renew_due = True
            try:
                await self._round_trip()
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure of the store means "unreachable"
                self._failed(exc)

    async def _round_trip(self) -> None:
        trip = self._next_trip()
        if trip.empty():
            return
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.settings.redis_timeout_s):
                if not self._loaded:
                    await self._load_scripts()
                try:
                    results = await self._send(trip)
                except NoScriptError:
                    # Redis restarted (or flushed its scripts): load them again and resend;
                    # every script is idempotent, so what did run may run twice. A restarted
                    # Redis lost the leases too: they are renewed with the next round trip,
                    # at once (the connection error that would have said so may have gone to
                    # another caller sharing the client, the shared scrape).
                    self._renew_due = True
                    self._wake.set()
                    await self._load_scripts()
                    results = await self._send(trip)
        except BaseException as exc:
            # Nothing of this round trip is known to have happened: the changes and takes are
            # sent again (they are idempotent), the bookings are refused (their waiters go back
            # to the queue), the readings are not (a newer one comes with the next scrape).
            for share, _ in trip.readings:
                share.published(None, exc)
            for link, changes in trip.changes:
                link.changes[:0] = changes
            for link in self._links.values():
                link.reserve.failed()
            for link in trip.publishing:
                link.publish = True
            for pending in trip.bookings:
                pending.answer(None)
            raise
        self.metrics.shared_round_trip.observe(time.perf_counter() - started)
        self._apply(results, trip)

    def _next_trip(self) -> _Trip:
        """Take everything pending into one round trip."""
        readings = [(share, args) for share in self._shares if (args := share.publication()) is not None]
        bookings, self._bookings = self._bookings, []
        renew = self._renew_due or not self.connected
        links = list(self._links.values())
        booked_on = {name for pending in bookings for name in _candidate_names(pending.bookings)}
        takes: list[tuple[_BackendLink, list[tuple[int, int]], int]] = []
        sizes: list[tuple[_BackendLink, int]] = []
        for link in links:
            reserve = link.reserve
            target = self._reserve_target(link)
            # A booking that goes to Redis must not be refused for this process's own reserve:
            # the reserve is given back before it, and sized again after.
            first = 0 if link.ledger.backend in booked_on and reserve.held > 0 else None
            sent = reserve.send(first)
            if sent or first is not None:
                takes.append((link, sent, -1 if first is None else first))
            # What the reserve holds once the takes are made; renewed with the leases.
            after = 0 if first is not None else max(0, reserve.held - sum(blocks for _, blocks in sent))
            if target != after or (renew and after > 0):
                reserve.available = min(reserve.available, target)
                sizes.append((link, target))
        changes = [(link, link.changes) for link in links]
        for link in links:
            link.changes = []
        publishing = [link for link in links if link.publish or renew]
        for link in publishing:
            link.publish = False
        return _Trip(readings, takes, changes, bookings, sizes, publishing, renew)

    def _reserve_target(self, link: _BackendLink) -> int:
        ledger = link.ledger
        if self._stopping or not self.connected or not ledger.connected:
            return 0
        return reserve_target(
            cap=_reserve_cap(link.snapshot()),
            others_booked=ledger.others_booked,
            own_reserved=ledger.own_totals().reserved_blocks,
            processes=ledger.processes,
            waiting=link.waiting() + ledger.others_waiting,
        )

    async def _send(self, trip: _Trip) -> list[Any]:
        ttl_ms = str(int(self.settings.redis_lease_ttl_s * 1000))
        view_ttl_ms = str(int(self.settings.metrics_stale_after_s * 1000))
        async with self._redis.pipeline(transaction=False) as pipe:
            for share, publication in trip.readings:
                _call(pipe, self._digests["scrape_publish"], share.keys, publication)
            for link, takes, target in trip.takes:
                self._reserve_call(pipe, link, ttl_ms, target, takes)
            for link, pending in trip.changes:
                if pending:
                    args: list[str | int] = [self.owner]
                    for key, blocks in pending:
                        args += [self._lease_id(key), blocks]
                    _call(pipe, self._digests["release"], self.keys.backend(link.ledger.backend), args)
            for pending_booking in trip.bookings:
                keys, args = self._booking_call(pending_booking.bookings, ttl_ms)
                _call(pipe, self._digests["book"], keys, args)
            for link, target in trip.sizes:
                self._reserve_call(pipe, link, ttl_ms, target, [])
            for link in trip.publishing:
                snapshot = link.snapshot()
                cap = cap_of(snapshot, link.ledger.totals().credit_blocks) if link.ledger.connected else None
                view = link.ledger.view(link.settled_before(), link.waiting()) if cap is not None else None
                args = [
                    self.owner,
                    ttl_ms,
                    view.to_text() if view is not None else "",
                    view_ttl_ms,
                    cap if cap is not None else 0,
                ]
                if trip.renew:
                    for key, blocks in link.ledger.leases().items():
                        args += [self._lease_id(key), blocks]
                _call(
                    pipe,
                    self._digests["renew"],
                    [*self.keys.backend(link.ledger.backend), self.keys.alive],
                    args,
                )
            result: list[Any] = await pipe.execute()
        return result

    def _reserve_call(
        self, pipe: Any, link: _BackendLink, ttl_ms: str, target: int, takes: Sequence[tuple[int, int]]
    ) -> None:
        cap = _reserve_cap(link.snapshot())
        share = RESERVE_DIVISOR * max(1, link.ledger.processes)
        args: list[str | int] = [self.owner, ttl_ms, self._lease_id_of_reserve(), cap or 0, target, share]
        for key, blocks in takes:
            args += [self._lease_id(key), blocks]
        _call(pipe, self._digests["reserve"], self.keys.backend(link.ledger.backend), args)

    def _lease_id_of_reserve(self) -> str:
        return f"{self.owner}:{RESERVE_LEASE}"

    async def _load_scripts(self) -> None:
        for name, source in self._sources.items():
            digest = await self._redis.script_load(source)
            if digest != self._digests[name]:
                raise RedisError(f"Redis digests the {name} script as {digest}, not {self._digests[name]}")
        self._loaded = True

    def _booking_call(self, bookings: Sequence[Booking], ttl_ms: str) -> tuple[list[str], list[str | int]]:
        names = _candidate_names(bookings)
        index = {name: position for position, name in enumerate(names, start=1)}
        keys: list[str] = []
        caps: list[int] = []
        for name in names:
            keys += self.keys.backend(name)
            link = self._links.get(name)
            cap = None
            if link is not None:
                cap = cap_of(link.snapshot(), link.ledger.totals().credit_blocks)
            caps.append(cap if cap is not None else -1)
        args: list[str | int] = [self.owner, ttl_ms, len(names), *caps, len(bookings)]
        for booking in bookings:
            args += [self._lease_id(booking.key), len(booking.candidates)]
            for name, blocks in booking.candidates:
                args += [index[name], blocks]
        return keys, args

    def _apply(self, results: list[Any], trip: _Trip) -> None:
        answers = iter(results)
        # In the order the server ran them: readings, takes, releases, bookings, sizes, then
        # renewals (the newest totals).
        for share, _ in trip.readings:
            share.published(next(answers))
        held: dict[str, int] = {}
        for link, _takes, _target in trip.takes:
            reserve_blocks, others_booked = next(answers)
            held[link.ledger.backend] = int(reserve_blocks)
            link.ledger.heard(int(others_booked))
        for link, pending in trip.changes:
            if pending:
                link.ledger.heard(int(next(answers)))
        booking_results = [next(answers) for _ in trip.bookings]
        places_of: list[list[str | None]] = []
        for pending_booking, (placements, _caps, others) in zip(trip.bookings, booking_results, strict=True):
            names = _candidate_names(pending_booking.bookings)
            for name, booked in zip(names, others, strict=True):
                if (booked_link := self._links.get(name)) is not None:
                    booked_link.ledger.heard(int(booked))
            places: list[str | None] = []
            for booking, placed in zip(pending_booking.bookings, placements, strict=True):
                place = names[int(placed) - 1] if int(placed) > 0 else None
                if place is None:
                    self.metrics.shared_refusals.labels(booking.candidates[0][0]).inc()
                places.append(place)
            places_of.append(places)
        for link, _target in trip.sizes:
            reserve_blocks, others_booked = next(answers)
            held[link.ledger.backend] = int(reserve_blocks)
            link.ledger.heard(int(others_booked))
        for link in self._links.values():
            link.reserve.answered(held.get(link.ledger.backend, link.reserve.held))
        for link in trip.publishing:
            others_booked, alive, views = next(answers)
            parsed = {
                redis_text(owner): view
                for owner, text in zip(views[::2], views[1::2], strict=True)
                if (view := PeerView.from_text(redis_text(text))) is not None
            }
            link.ledger.heard(int(others_booked), parsed, max(int(alive), self.settings.workers))
        if trip.renew:
            self._renewed_at = self._clock()
            self._renew_due = False
        if not self.connected:
            again = " again: this process's leases are booked anew" if self._ever_connected else ""
            log.warning("the shared ledger at %s answers%s", self._url, again)
        self.connected = self._ever_connected = True
        self._reported_down = False
        for pending_booking, places in zip(trip.bookings, places_of, strict=True):
            pending_booking.answer(places)

    def _failed(self, exc: BaseException) -> None:
        """A round trip failed. One failure alone (a slow moment, a connection the server
        closed) is retried at once; FAILURES_TO_UNREACHABLE in a row mean Redis is away."""
        self.metrics.shared_errors.inc()
        self._failures += 1
        self._renew_due = True
        if self.connected and self._failures < FAILURES_TO_UNREACHABLE:
            log.warning("a round trip to the shared ledger failed (%r): trying again", exc)
            self._wake.set()
            return
        if self.connected or not self._reported_down:
            mode = "admitting within 1/N of each budget" if self._fail_open else "admitting nothing new"
            log.error("the shared ledger at %s cannot be reached (%r): %s", self._url, exc, mode)
            self._reported_down = True
        self.connected = False
        for link in self._links.values():
            link.ledger.lost()


def _reserve_cap(snapshot: BudgetSnapshot) -> int | None:
    """The cap a reserve is sized under: this process's, without the prefix credit (credit is
    room that requests sharing blocks leave; a reserve shares none, so it never takes it)."""
    return cap_of(snapshot, 0)


def _call(pipe: Any, digest: str, keys: Sequence[str], args: Sequence[str | int]) -> None:
    """Queue one script call on a pipeline (its answer comes with the pipeline's)."""
    pipe.evalsha(digest, len(keys), *keys, *args)


def _candidate_names(bookings: Sequence[Booking]) -> list[str]:
    """The backends a batch names, in order of first mention: the script's backend indices."""
    return list(dict.fromkeys(name for booking in bookings for name, _ in booking.candidates))
