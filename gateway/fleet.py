"""The fleet: every backend kvgate fronts, each model's wait queue over them, and their state.

`Fleet` holds the backends (named in the settings, or found by resolving a `dns+` entry: one
per address, re-resolved every DNS_REFRESH_S, retired when the name no longer gives it), the
catalog they fill as they are discovered, and one `WaitQueue` per model whose targets are the
backends that serve the model. It pumps the queues when something can change an answer (a
backend discovered or scraped, a reservation ended) and reports readiness, gauges and
/admin/state for every backend. It makes no decision about a request: the router does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from gateway.admission import AdmissionPolicy
from gateway.backend import Backend
from gateway.capacity import Reconciliation
from gateway.discovery import BackendInfo
from gateway.metrics import GatewayMetrics, GaugeReadings
from gateway.models import ModelCatalog
from gateway.output_model import OutputLengthModel
from gateway.rates import WaitCalibration
from gateway.redis_store import RedisLedgerStore
from gateway.reservation import NO_BACKEND
from gateway.settings import BackendSpec, Settings
from gateway.shared_view import SharedLedger
from gateway.upstream import Upstream
from gateway.waitqueue import WaitQueue

log = logging.getLogger(__name__)

# How often backends named by DNS are resolved again (a headless Service's pods come and go).
DNS_REFRESH_S = 10.0
# How long a starting kvgate waits for the first discovery and scrape of its backends before it
# serves anyway: beyond a discovery's time limit, a tokenizer may still be loading.
FIRST_LOOK_WAIT_S = 15.0

# Resolves a host name and port to addresses.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every TCP address of `host`, in the resolver's order, without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Fleet:
    def __init__(
        self,
        settings: Settings,
        *,
        specs: Iterable[BackendSpec],
        client: httpx.AsyncClient,
        upstream_for: Callable[[BackendSpec], Upstream],
        clock: Callable[[], float],
        metrics: GatewayMetrics,
        catalog: ModelCatalog,
        output_model: OutputLengthModel,
        policy: AdmissionPolicy,
        resolve: Resolver | None = None,
        shared: RedisLedgerStore | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.client = client
        self.metrics = metrics
        self.catalog = catalog
        self.output_model = output_model
        self._policy = policy
        self._upstream_for = upstream_for
        self._resolve = resolve or resolve_addresses
        self.shared = shared
        self.backends: list[Backend] = []
        self._by_name: dict[str, Backend] = {}
        self.queues: dict[str, WaitQueue] = {}
        self._output_buckets: dict[str, tuple[tuple[float, float], ...]] = {}
        specs = list(specs)
        # Backends named by DNS: each address is one, found by `resolve_once`.
        self._resolving = [spec for spec in specs if spec.resolve]
        for spec in specs:
            if not spec.resolve:
                self._add(spec)
        if len(specs) > 1 or self._resolving:
            metrics.add_backend(NO_BACKEND)  # requests refused before any backend took them
        self._resolver_task: asyncio.Task[None] | None = None

    def _add(self, spec: BackendSpec) -> Backend:
        if spec.name in self._by_name:
            raise ValueError(f"two backends are named {spec.name}")
        ledger = self.shared.ledger(spec.name) if self.shared is not None else None
        backend = Backend(
            spec,
            self.settings,
            client=self.client,
            upstream=self._upstream_for(spec),
            clock=self.clock,
            metrics=self.metrics,
            has_waiters=self._waiters_for(spec.name),
            on_discovered=self._discovered,
            on_scrape=self._scraped,
            ledger=ledger,
            standing=ledger.standing if ledger is not None else None,
            scrape_share=self.shared.scrape_share(spec.name) if self.shared is not None else None,
        )
        if self.shared is not None and ledger is not None:
            ledger.on_freed = lambda blocks: backend.pace.completed_elsewhere(blocks, self.clock())
            settle_s = self.settings.settle_s
            self.shared.attach(
                ledger, backend.snapshot, lambda: self.clock() - settle_s, self._waiting_for(spec.name)
            )
        self.backends.append(backend)
        self._by_name[spec.name] = backend
        self.metrics.add_backend(spec.name)
        return backend

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every backend's discovery and poller, and return once each backend was looked
        at (at most FIRST_LOOK_WAIT_S): a request let in before would be refused for a backend
        not reached yet, one that the next moment would have served it. The connections that
        came meanwhile wait in the listening socket's queue (for a worker of `kvgate serve
        --workers`, the one its predecessor left)."""
        for backend in self.backends:
            await backend.start()
        if self._resolving:
            await self.resolve_once()
            self._resolver_task = asyncio.create_task(self._resolve_forever(), name="kvgate-dns")
        looks = asyncio.gather(*(backend.looked_at() for backend in self.backends))
        try:
            await asyncio.wait_for(looks, FIRST_LOOK_WAIT_S)
        except TimeoutError:
            log.warning("serving before every backend was reached (%.0f s passed)", FIRST_LOOK_WAIT_S)

    async def stop(self) -> None:
        if self._resolver_task is not None:
            self._resolver_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resolver_task
        for backend in self.backends:
            await backend.stop()

    def reconfigure(self, settings: Settings) -> None:
        self.settings = settings
        for backend in self.backends:
            backend.reconfigure(settings)

    # -- backends found by DNS ------------------------------------------------------------

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(DNS_REFRESH_S)
            await self.resolve_once()

    async def resolve_once(self) -> None:
        """Add a backend for each new address of the DNS names; retire those whose address is
        gone (nothing new goes there; it stops once its last request ends)."""
        found: set[str] = set()
        for spec in self._resolving:
            parts = urlsplit(spec.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                addresses = await self._resolve(parts.hostname or "", port)
            except OSError as exc:  # keep what is known: a resolver hiccup empties nothing
                log.warning("cannot resolve %s: %s", parts.hostname, exc)
                found.update(b.name for b in self.backends if b.resolved_from == spec.url)
                continue
            for address in addresses:
                host = f"[{address}]" if ":" in address else address
                name = f"{host}:{port}"
                found.add(name)
                known = self._by_name.get(name)
                if known is not None:
                    known.retired = False
                    continue
                url = urlunsplit((parts.scheme, f"{host}:{port}", parts.path, "", ""))
                backend = self._add(BackendSpec(name, url))
                backend.resolved_from = spec.url
                log.info("backend %s found by DNS for %s", name, parts.hostname)
                await backend.start()
        for backend in list(self.backends):
            if backend.resolved_from is not None and backend.name not in found:
                if not backend.retired:
                    log.info("backend %s no longer resolves: retired", backend.name)
                backend.retired = True
        await self.drop_retired()

    async def drop_retired(self) -> None:
        """Stop and forget the retired backends that have nothing in flight."""
        for backend in list(self.backends):
            if backend.retired and backend.ledger.totals().entries == 0:
                await backend.stop()
                self.backends.remove(backend)
                del self._by_name[backend.name]
                self.metrics.remove_backend(backend.name)
                if self.shared is not None:
                    self.shared.detach(backend.name)

    # -- what the backends report ---------------------------------------------------------

    async def _discovered(self, backend: Backend, info: BackendInfo) -> None:
        await self.catalog.learn(info)
        for model in info.names():
            self.queue(model)
        # The backend serves them once this returns: decide for those waiting then.
        asyncio.get_running_loop().call_soon(self.pump)

    def _scraped(self, backend: Backend, reconciliation: Reconciliation | None) -> None:
        if reconciliation is not None and self.shared is not None:
            self.shared.scraped(backend.name)
        if reconciliation is not None:
            # What the backends' answers ran to: the reservation until kvgate has its own.
            reading = backend.budget.reading
            self._output_buckets[backend.name] = reading.output_length_buckets if reading is not None else ()
            buckets = (
                merged_histograms(self._output_buckets.values()) if self.settings.output_backend_prior else ()
            )
            self.output_model.observe_backend(buckets)
        self.pump(backend)

    # -- queues ---------------------------------------------------------------------------

    def queue(self, model: str) -> WaitQueue:
        """The model's queue, over every backend that serves it."""
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = WaitQueue(
                policy=self._policy,
                clock=self.clock,
                targets=lambda now: [b.target(now) for b in self.backends if b.serves(model)],
                calibration=WaitCalibration(),
                booker=self.shared,
            )
        return queue

    def _waiters_for(self, name: str) -> Callable[[], bool]:
        """Whether requests wait for the backend's blocks: here, or, with a shared ledger, in
        another process's queue (their budget and ours must grow alike, see gateway.capacity)."""
        waiting = self._waiting_for(name)

        def has_waiters() -> bool:
            if waiting() > 0:
                return True
            ledger = self._by_name[name].ledger
            return isinstance(ledger, SharedLedger) and ledger.others_waiting > 0

        return has_waiters

    def _waiting_for(self, name: str) -> Callable[[], int]:
        def waiting() -> int:
            backend = self._by_name.get(name)
            if backend is None:
                return 0
            return sum(len(queue) for model, queue in self.queues.items() if backend.serves(model))

        return waiting

    def pump(self, backend: Backend | None = None) -> None:
        """Decide again for everyone waiting (for `backend`'s blocks, or anyone's)."""
        for model, queue in self.queues.items():
            if backend is None or backend.serves(model):
                queue.pump()

    # -- state ----------------------------------------------------------------------------

    def backend(self, name: str) -> Backend:
        return self._by_name[name]

    def serving(self, model: str) -> list[Backend]:
        return [backend for backend in self.backends if backend.serves(model)]

    def label(self, backend: Backend | None) -> str:
        """The backend label of a request: where it went, or, before any backend took it, the
        only backend of a single-backend gateway (`none` in a fleet)."""
        if backend is not None:
            return backend.name
        return self.backends[0].name if len(self.backends) == 1 and not self._resolving else NO_BACKEND

    def readiness(self) -> tuple[bool, str]:
        answers = [backend.readiness() for backend in self.backends]
        if not len(self.catalog):
            reasons = {reason for _, reason in answers}
            return False, "; ".join(sorted(reasons)) if reasons else "no backend"
        if len(answers) == 1:
            return answers[0]
        ready = sum(1 for ok, _ in answers if ok)
        if ready:
            return True, f"{ready} of {len(answers)} backends ready"
        return False, "; ".join(
            f"{b.name}: {why}" for b, (_, why) in zip(self.backends, answers, strict=True)
        )

    def gauge_readings(self) -> list[GaugeReadings]:
        readings = []
        for backend in self.backends:
            depth: dict[Any, int] = {}
            for model, queue in self.queues.items():
                if backend.serves(model):
                    for priority, count in queue.depth().items():
                        depth[priority] = depth.get(priority, 0) + count
            readings.append(backend.gauge_readings(depth))
        return readings

    def describe(self, output_source: Callable[[int], str | None]) -> list[dict[str, Any]]:
        """/admin/state's entry of every backend: its own state, and the queues of its models."""
        described = []
        for backend in self.backends:
            state = backend.describe(output_source)
            sources = [p.counter_source for p in self.catalog.profiles() if backend.serves(p.id)]
            state["tokenizer"] = sources[0] if sources else None
            queues = [q for m, q in self.queues.items() if backend.serves(m)]
            first = queues[0] if queues else None
            state["queue"] = {
                "depth": {
                    p.value: sum(q.depth()[p] for q in queues)
                    for p in (first.depth() if first is not None else {})
                },
                "queued_blocks": sum(q.queued_blocks() for q in queues),
                "drain_rate_blocks_per_s": state["pace"]["drain_rate_blocks_per_s"],
                "saturated_drain_rate_blocks_per_s": state["pace"]["saturated_drain_rate_blocks_per_s"],
                "wait_calibration": (
                    first.calibration.factors()
                    if first is not None and first.calibration is not None
                    else None
                ),
                "stats": {
                    "admitted": sum(q.stats.admitted for q in queues),
                    "shed": sum(q.stats.shed for q in queues),
                    "left": sum(q.stats.left for q in queues),
                },
            }
            described.append(state)
        return described


def merged_histograms(
    histograms: Iterable[tuple[tuple[float, float], ...]],
) -> tuple[tuple[float, float], ...]:
    """Cumulative histograms of several backends summed bound by bound (vLLM's bounds are
    the same everywhere; a bound one backend lacks takes its count at the next lower bound)."""
    present = [h for h in histograms if h]
    if len(present) <= 1:
        return present[0] if present else ()
    bounds = sorted({bound for histogram in present for bound, _ in histogram})
    merged = []
    for bound in bounds:
        total = 0.0
        for histogram in present:
            below = [count for b, count in histogram if b <= bound]
            total += below[-1] if below else 0.0
        merged.append((bound, total))
    return tuple(merged)
