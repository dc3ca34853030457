"""Several kvgate gateways, one budget: in-process gateways over one emulator, sharing a real
redis-server (tests/redis_server.py), the way several processes do."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from conftest import READY_TIMEOUT_S, TEST_SETTINGS, wait_until
from redis_server import RedisServer, free_port, running_redis

from estimator.tokens import TokenCounter
from gateway.app import create_app
from gateway.redis_store import RESERVE_LEASE, KeyNames
from gateway.router import Router
from gateway.settings import Settings
from gateway.shared_scrape import ScrapeShare
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.lengths import OutputLengthModel
from sim.server import SimApp, create_sim_app

SLOW_ENGINE = EngineConfig(step_cost=StepCost(base_s=0.004, per_token_s=0.0, per_seq_s=0.0))
# Answers stop after 60 tokens, but nothing is learned yet: each reserves its max_tokens, 16
# blocks, so three fit the emulator's 63 admissible blocks and a fourth does not.
SHORT_ANSWERS = SimConfig(engine=SLOW_ENGINE, output_len=OutputLengthModel.parse("fixed:60"))
LONG = {"model": "tiny-llama", "prompt": "y", "max_tokens": 500}
# Answers that outlast an outage of Redis and its noticing (450 steps of 10 ms).
LONG_ANSWERS = SimConfig(
    engine=EngineConfig(step_cost=StepCost(base_s=0.01, per_token_s=0.0, per_seq_s=0.0)),
    output_len=OutputLengthModel.parse("fixed:450"),
)
# Three gateways in one process poll the emulator: less often than alone, to leave the loop time.
SHARED_TEST_SETTINGS = {**TEST_SETTINGS, "metrics_poll_interval_s": 0.05}
RESERVE_ID_END = f":{RESERVE_LEASE}".encode()


@dataclass
class Sharing:
    routers: list[Router]
    clients: list[httpx.AsyncClient]
    sim: SimApp
    redis: aioredis.Redis
    keys: KeyNames

    async def booked(self, backend: str = "default") -> int:
        """The blocks booked for requests: the total less the gateways' standing reserves
        (gateway.reserve), read in one transaction."""
        total, reserves = await self.booked_and_reserves(backend)
        return total - reserves

    async def booked_and_reserves(self, backend: str = "default") -> tuple[int, int]:
        """Redis's total (every lease) and the reserves' part of it."""
        async with self.redis.pipeline(transaction=True) as pipe:
            total, leases = (
                await pipe.hget(self.keys.booked(backend), "total")
                .hgetall(self.keys.backend(backend)[0])
                .execute()
            )
        return int(total or 0), sum(_reserves(leases).values())

    async def reserves(self, backend: str = "default") -> dict[str, int]:
        """Owner -> the blocks of its reserve, for the gateways that hold one."""
        return _reserves(await self.redis.hgetall(self.keys.backend(backend)[0]))


def _reserves(leases: dict[bytes, bytes]) -> dict[str, int]:
    held: dict[str, int] = {}
    for lease, value in leases.items():
        if lease.endswith(RESERVE_ID_END):
            owner, _, blocks = value.decode().rpartition(" ")
            held[owner] = int(blocks)
    return held


def counting_scrapes(app: Any, scrapes: list[float]) -> Any:
    """`app` (ASGI), noting the time of every GET /metrics it is sent."""

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            scrapes.append(asyncio.get_running_loop().time())
        await app(scope, receive, send)

    return counted


@contextlib.asynccontextmanager
async def gateways_sharing(
    count: int,
    server: RedisServer | RedisAt,
    prefix: str,
    sim_config: SimConfig | None = None,
    scrapes: list[float] | None = None,
    **overrides: Any,
) -> AsyncIterator[Sharing]:
    sim_app = create_sim_app(sim_config or SHORT_ANSWERS)
    settings_values = {
        **SHARED_TEST_SETTINGS,
        "redis_url": server.url,
        "redis_key_prefix": prefix,
        "budget_overcommit": 0.0,
        **overrides,
    }
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(sim_app.run())
        served = sim_app if scrapes is None else counting_scrapes(sim_app, scrapes)
        backend = await stack.enter_async_context(httpx.AsyncClient(transport=httpx.ASGITransport(served)))
        routers: list[Router] = []
        clients: list[httpx.AsyncClient] = []
        for _ in range(count):
            settings = Settings(backend_url="http://sim", **settings_values)
            app = create_app(settings, http_client=backend, token_counter=TokenCounter.approximate())
            await stack.enter_async_context(app.router.lifespan_context(app))
            routers.append(app.state.kvgate)
            clients.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost")
                )
            )
        for router in routers:
            await wait_until(lambda r=router: r.readiness()[0], READY_TIMEOUT_S, "every gateway to be ready")
        client = aioredis.Redis.from_url(server.url)
        stack.push_async_callback(client.aclose)
        yield Sharing(routers, clients, sim_app, client, KeyNames(prefix))


async def booked_becomes(
    sharing: Sharing, blocks: int, backend: str = "default", timeout_s: float = 5.0
) -> None:
    """Wait for Redis's total to read `blocks` (releases reach it a round trip after the ledger)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (booked := await sharing.booked(backend)) != blocks:
        assert asyncio.get_running_loop().time() < deadline, (
            f"Redis still books {booked} blocks, not {blocks}"
        )
        await asyncio.sleep(0.01)


def in_flight(sharing: Sharing) -> int:
    return sum(router.backends[0].ledger.own_totals().entries for router in sharing.routers)  # type: ignore[attr-defined]


async def test_three_gateways_never_book_more_than_one_budget(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(3, redis_service, redis_prefix) as sharing:
        most_booked = most_total = most_running = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal most_booked, most_total, most_running
            while not stop.is_set():
                total, reserves = await sharing.booked_and_reserves()
                most_booked = max(most_booked, total - reserves)
                most_total = max(most_total, total)
                most_running = max(most_running, in_flight(sharing))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=LONG) for client in sharing.clients for _ in range(3))
        )
        stop.set()
        await watcher
        assert [r.status_code for r in responses] == [200] * 9
        assert most_running == 3
        assert 32 < most_booked <= most_total <= 63
        assert sharing.sim.runtime.state()["num_preemptions_total"] == 0
        assert in_flight(sharing) == 0
        await booked_becomes(sharing, 0)
        state = (await sharing.clients[0].get("/admin/state")).json()["shared_ledger"]
        assert state["connected"] is True
        assert state["processes"] == 3
        assert state["key_prefix"] == redis_prefix

        # Each gateway hears of the others' releases at its next round trip (its next scrape):
        # what it counts as reserved is then the others' standing reserves alone.
        async def heard_the_releases() -> bool:
            reserves = await sharing.reserves()
            return all(
                r.backends[0].ledger.totals().reserved_blocks
                == sum(blocks for owner, blocks in reserves.items() if owner != r.shared.owner)  # type: ignore[union-attr]
                for r in sharing.routers
            )

        deadline = asyncio.get_running_loop().time() + 5.0
        while not await heard_the_releases():
            assert asyncio.get_running_loop().time() < deadline, (
                "every gateway to hear that the others released"
            )
            await asyncio.sleep(0.01)
        ledger = (await sharing.clients[0].get("/admin/state")).json()["backends"][0]["ledger"]
        assert ledger["own_reserved_blocks"] == 0


def scrape_shares(sharing: Sharing) -> list[ScrapeShare]:
    shares = []
    for router in sharing.routers:
        share = router.backends[0].poller.share
        assert share is not None
        shares.append(share)
    return shares


def scrape_roles(sharing: Sharing) -> list[str]:
    return [share.describe()["role"] for share in scrape_shares(sharing)]


async def the_lease_holder(sharing: Sharing) -> int:
    """Which gateway holds the scrape lease, once one does."""
    await wait_until(lambda: scrape_roles(sharing).count("leads") == 1, 5.0, "a lease holder")
    return scrape_roles(sharing).index("leads")


@pytest.mark.parametrize("shared_scrape", [True, False])
async def test_one_gateway_at_a_time_reads_the_backends_metrics_and_the_others_take_its_reading(
    redis_service: RedisServer, redis_prefix: str, shared_scrape: bool
) -> None:
    scrapes: list[float] = []
    async with gateways_sharing(
        3, redis_service, redis_prefix, scrapes=scrapes, redis_shared_scrape=shared_scrape
    ) as sharing:
        pollers = [router.backends[0].poller for router in sharing.routers]
        interval_s = SHARED_TEST_SETTINGS["metrics_poll_interval_s"]
        before = [dict(poller.readings) for poller in pollers]
        started = asyncio.get_running_loop().time()
        answers = await asyncio.gather(
            *(client.post("/v1/completions", json=LONG) for client in sharing.clients for _ in range(2))
        )
        await asyncio.sleep(max(0.0, 1.5 - (asyncio.get_running_loop().time() - started)))
        elapsed = asyncio.get_running_loop().time() - started
        read = len([at for at in scrapes if at >= started])
        assert [answer.status_code for answer in answers] == [200] * 6
        # Every budget stayed fresh however it was read.
        assert all(router.backends[0].snapshot().known for router in sharing.routers)
        gained = [
            {source: poller.readings[source] - seen[source] for source in seen}
            for poller, seen in zip(pollers, before, strict=True)
        ]
        if not shared_scrape:
            assert all(poller.share is None for poller in pollers)
            # Each gateway reads the backend for itself.
            assert all(got["scraped"] > 0.5 * elapsed / interval_s for got in gained), gained
            assert all(got["shared"] == 0 for got in gained), gained
            return
        roles = scrape_roles(sharing)
        assert roles.count("leads") == 1, roles
        assert roles.count("follows") == 2, roles
        # One process's worth of scrapes (a follower reads for itself now and then, when the
        # reading it finds is too old on a loop three gateways share).
        assert read < 1.6 * elapsed / interval_s, (read, elapsed)
        leader = roles.index("leads")
        for position, got in enumerate(gained):
            if position == leader:
                assert got["scraped"] > 0.5 * elapsed / interval_s, got
                assert got["shared"] == 0, got
            else:
                assert got["shared"] > 0.5 * elapsed / interval_s, got
                assert got["shared"] > 4 * got["scraped"], got
        metrics = (await sharing.clients[(leader + 1) % 3].get("/metrics")).text
        assert 'kvgate_backend_readings_total{backend="default",source="shared"}' in metrics
        state = (await sharing.clients[leader].get("/admin/state")).json()["backends"][0]
        assert state["metrics_readings"]["shared_scrape"]["role"] == "leads"


async def test_a_gateway_alone_on_the_ledger_reads_the_backend_without_asking_or_publishing(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(1, redis_service, redis_prefix) as sharing:
        poller = sharing.routers[0].backends[0].poller
        before = dict(poller.readings)
        await asyncio.sleep(0.5)
        assert poller.readings["scraped"] > before["scraped"]
        assert poller.readings["shared"] == 0
        assert scrape_roles(sharing)[0].startswith("reads itself"), scrape_roles(sharing)
        lease, reading = sharing.keys.scrape("default")
        assert await sharing.redis.exists(lease, reading) == 0


async def test_when_the_scrape_lease_holder_stops_another_takes_it_and_no_budget_goes_stale(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(3, redis_service, redis_prefix) as sharing:
        leader = await the_lease_holder(sharing)
        share = scrape_shares(sharing)[leader]
        # The holder dies as a process does: nothing more reaches Redis from it (it goes on
        # reading the backend for itself), and its lease is not renewed.
        doomed = sharing.routers[leader].shared
        assert doomed is not None
        await doomed.stop(give_back=False)
        others = [router for position, router in enumerate(sharing.routers) if position != leader]
        deadline = asyncio.get_running_loop().time() + share.lease_ttl_s + 2.0
        while not any(
            router.backends[0].poller.share.describe()["role"] == "leads"  # type: ignore[union-attr]
            for router in others
        ):
            # Meanwhile the others read the backend themselves: no budget goes stale.
            assert all(router.backends[0].snapshot().known for router in others)
            assert asyncio.get_running_loop().time() < deadline, scrape_roles(sharing)
            await asyncio.sleep(0.01)
        for client in (sharing.clients[position] for position in range(3) if position != leader):
            assert (await client.post("/v1/completions", json=LONG)).status_code == 200
        assert all(router.backends[0].snapshot().known for router in others)


async def test_the_scrape_lease_holder_renews_its_lease_by_publishing_and_asks_only_when_it_runs_short(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(2, redis_service, redis_prefix) as sharing:
        leader = await the_lease_holder(sharing)
        pollers = [router.backends[0].poller for router in sharing.routers]
        shares = scrape_shares(sharing)
        asked = [share.turns_asked for share in shares]
        read = [dict(poller.readings) for poller in pollers]
        await asyncio.sleep(1.0)
        asked = [share.turns_asked - before for share, before in zip(shares, asked, strict=True)]
        read = [
            {source: poller.readings[source] - count for source, count in before.items()}
            for poller, before in zip(pollers, read, strict=True)
        ]
        follower = 1 - leader
        assert scrape_roles(sharing)[leader] == "leads"
        assert read[leader]["scraped"] > 10, read
        # Each publication renewed the lease: the holder did not ask for its turn.
        assert asked[leader] == 0, (asked, read)
        # The follower asks at every poll, and takes the holder's readings.
        assert asked[follower] >= read[follower]["shared"] > 10, (asked, read)
        lease, _ = sharing.keys.scrape("default")
        assert await sharing.redis.pttl(lease) > 0


async def test_a_holder_whose_scrape_lease_was_taken_publishes_nothing_more_and_asks_again(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(2, redis_service, redis_prefix) as sharing:
        await the_lease_holder(sharing)
        lease, reading = sharing.keys.scrape("default")
        # Someone else holds the lease now (the holder was too slow, say) and publishes nothing.
        await sharing.redis.set(lease, "another-process", px=60_000)
        await wait_until(lambda: "leads" not in scrape_roles(sharing), 2.0, "the holder to stop leading")
        stamp = await sharing.redis.hget(reading, "stamp")
        await asyncio.sleep(0.5)
        assert await sharing.redis.hget(reading, "stamp") == stamp
        assert "leads" not in scrape_roles(sharing), scrape_roles(sharing)
        # Meanwhile nobody's budget goes stale: past its age the shared reading is not taken
        # and each reads the backend itself.
        assert all(router.backends[0].snapshot().known for router in sharing.routers)
        for client in sharing.clients:
            assert (await client.post("/v1/completions", json=LONG)).status_code == 200


def own_reserved(sharing: Sharing) -> int:
    return sum(router.backends[0].ledger.own_totals().reserved_blocks for router in sharing.routers)  # type: ignore[attr-defined]


async def test_a_gateway_that_stops_renewing_gives_its_blocks_back_after_the_lease_ttl(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(2, redis_service, redis_prefix, redis_lease_ttl_s=0.6) as sharing:
        doomed, survivor = sharing.routers
        requests = [
            asyncio.create_task(sharing.clients[0].post("/v1/completions", json=LONG)) for _ in range(2)
        ]
        await wait_until(lambda: in_flight(sharing) == 2, 5.0, "two requests in flight")
        await booked_becomes(sharing, 32)
        # It dies as a process does: nothing more reaches Redis from it, its requests end with it.
        assert doomed.shared is not None
        await doomed.shared.stop(give_back=False)
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        # The survivor's renewals sweep the expired leases: within the TTL and one renewal.
        await booked_becomes(sharing, 0, timeout_s=0.6 * 2 + 0.5)
        response = await sharing.clients[1].post("/v1/completions", json=LONG)
        assert response.status_code == 200
        assert survivor.backends[0].snapshot().committed_blocks == 0


async def test_fail_closed_answers_503_while_redis_is_away_and_recovers(redis_prefix: str) -> None:
    with running_redis() as server:
        async with gateways_sharing(1, server, redis_prefix, redis_timeout_s=0.2) as sharing:
            router, client = sharing.routers[0], sharing.clients[0]
            assert (await client.post("/v1/completions", json=LONG)).status_code == 200
            server.pause()
            try:
                await wait_until(lambda: not router.readiness()[0], 5.0, "readiness to fall")
                assert "Redis" in router.readiness()[1]
                refused = await client.post("/v1/completions", json=LONG)
                assert refused.status_code == 503
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["code"] == "budget_unknown"
                metrics = (await client.get("/metrics")).text
                assert "kvgate_shared_ledger_up 0.0" in metrics
            finally:
                server.resume()
            await wait_until(lambda: router.readiness()[0], 5.0, "readiness to return")
            assert (await client.post("/v1/completions", json=LONG)).status_code == 200
            assert "kvgate_shared_ledger_up 1.0" in (await client.get("/metrics")).text
            assert "kvgate_shared_ledger_errors_total 0.0" not in (await client.get("/metrics")).text
            await booked_becomes(sharing, 0)


async def test_fail_open_admits_within_a_share_and_books_it_again_when_redis_returns(
    redis_prefix: str,
) -> None:
    with running_redis() as server:
        async with gateways_sharing(
            2, server, redis_prefix, LONG_ANSWERS, redis_timeout_s=0.2, redis_unavailable="fail_open"
        ) as sharing:
            await wait_until(
                lambda: all(r.shared is not None and r.shared.processes() == 2 for r in sharing.routers),
                5.0,
                "both to see two processes",
            )
            server.pause()
            try:
                await wait_until(
                    lambda: all(r.shared is not None and not r.shared.connected for r in sharing.routers),
                    5.0,
                    "both to notice Redis is away",
                )
                assert all(r.readiness()[0] for r in sharing.routers)
                # Half of the 63 admissible blocks each: one 16-block request at a time, not three.
                assert [r.backends[0].snapshot().admissible_blocks for r in sharing.routers] == [31, 31]
                requests = [
                    asyncio.create_task(client.post("/v1/completions", json=LONG))
                    for client in sharing.clients
                    for _ in range(2)
                ]
                await wait_until(lambda: in_flight(sharing) == 2, 5.0, "one request in flight on each")
                assert all(
                    r.backends[0].ledger.own_totals().entries == 1  # type: ignore[attr-defined]
                    for r in sharing.routers
                )
            finally:
                server.resume()
            # Back: what was admitted meanwhile is booked in Redis again, the ledger consistent.
            await wait_until(
                lambda: all(r.shared is not None and r.shared.connected for r in sharing.routers),
                5.0,
                "both to reconnect",
            )
            # The two admitted while Redis was away still run (their answers are long): the first
            # renewal books them, and Redis's total is again the sum of what the two hold.
            deadline = asyncio.get_running_loop().time() + 3.0
            while (booked := await sharing.booked()) != own_reserved(sharing):
                assert asyncio.get_running_loop().time() < deadline, (
                    f"Redis books {booked}, not {own_reserved(sharing)}"
                )
                await asyncio.sleep(0.01)
            assert booked >= 32
            responses = await asyncio.gather(*requests)
            assert [r.status_code for r in responses] == [200] * 4
            await booked_becomes(sharing, 0)


async def test_a_redis_that_restarts_empty_gets_the_scripts_and_the_leases_again(redis_prefix: str) -> None:
    with running_redis() as server:
        async with gateways_sharing(1, server, redis_prefix, redis_timeout_s=0.3) as sharing:
            client = sharing.clients[0]
            running = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await wait_until(lambda: in_flight(sharing) == 1, 5.0, "a request in flight")
            await booked_becomes(sharing, 16)
            server.restart()  # no persistence: every key and script is gone
            await sharing.redis.aclose()
            sharing.redis = aioredis.Redis.from_url(server.url)
            # The next renewal books the running request again; new ones are booked as before.
            await booked_becomes(sharing, 16)
            assert (await client.post("/v1/completions", json=LONG)).status_code == 200
            assert (await running).status_code == 200
            await booked_becomes(sharing, 0)
            await sharing.redis.aclose()


async def test_tls_and_a_password_come_with_the_url_and_a_wrong_one_fails_closed(
    certificate: tuple[Path, Path], redis_prefix: str
) -> None:
    cert, key = certificate
    tls_port = free_port()
    server = RedisServer(
        port=free_port(),
        extra_args=[
            "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
            "--user", "kvgate", "on", ">s3cret", "~*", "&*", "+@all",
        ],
    )  # fmt: skip
    server.start()
    try:
        url = f"rediss://kvgate:s3cret@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
        async with gateways_sharing(1, RedisAt(url), redis_prefix) as sharing:
            assert (await sharing.clients[0].post("/v1/completions", json=LONG)).status_code == 200
            state = (await sharing.clients[0].get("/admin/state")).json()["shared_ledger"]
            assert state["connected"] is True
            assert "s3cret" not in json.dumps(state)
        wrong = url.replace("s3cret", "wrong")
        sim_app = create_sim_app(SHORT_ANSWERS)
        async with sim_app.run(), httpx.AsyncClient(transport=httpx.ASGITransport(sim_app)) as backend:
            settings = Settings(
                backend_url="http://sim",
                redis_url=wrong,
                redis_key_prefix=redis_prefix,
                **SHARED_TEST_SETTINGS,
            )
            app = create_app(settings, http_client=backend, token_counter=TokenCounter.approximate())
            async with app.router.lifespan_context(app):
                router: Router = app.state.kvgate
                await asyncio.sleep(1.0)
                ready, detail = router.readiness()
                assert not ready
                assert "Redis" in detail
                assert "wrong" not in detail
    finally:
        server.stop()


@dataclass
class RedisAt:
    """A Redis reached at `url` (for gateways_sharing, which needs only the URL)."""

    url: str


async def reserve_admissions(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    (line,) = [
        line
        for line in text.splitlines()
        if line.startswith('kvgate_shared_ledger_reserve_admissions_total{backend="default"} ')
    ]
    return float(line.split()[1])


async def reserves_become(sharing: Sharing, check: Any, what: str, timeout_s: float = 5.0) -> dict[str, int]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check(reserves := await sharing.reserves()):
        assert asyncio.get_running_loop().time() < deadline, f"{what}: the reserves are {reserves}"
        await asyncio.sleep(0.01)
    return reserves


async def test_while_nobody_waits_a_request_is_admitted_from_the_reserve_and_its_lease_follows(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(1, redis_service, redis_prefix) as sharing:
        (router,), (client,) = sharing.routers, sharing.clients
        assert router.shared is not None
        # Alone before a 63-block budget: half the room, ahead.
        await reserves_become(
            sharing, lambda held: held.get(router.shared.owner) == 63 // 2, "a reserve held"
        )
        before = await reserve_admissions(client)
        request = asyncio.create_task(client.post("/v1/completions", json=LONG))
        await wait_until(lambda: in_flight(sharing) == 1, 5.0, "the request admitted")
        assert await reserve_admissions(client) == before + 1
        # Its lease is made in Redis after it was admitted, out of the reserve's blocks.
        await booked_becomes(sharing, 16)
        assert (await request).status_code == 200
        await booked_becomes(sharing, 0)
        await reserves_become(
            sharing, lambda held: held.get(router.shared.owner) == 63 // 2, "the reserve again"
        )
        # A request larger than the reserve is booked in Redis, its reserve given back first.
        big = {**LONG, "max_tokens": 32 * 32 - 2}
        assert (await client.post("/v1/completions", json=big)).status_code == 200
        assert await reserve_admissions(client) == before + 1
    # A gateway that stops gives its reserve back.
    store = aioredis.Redis.from_url(redis_service.url)
    try:
        assert await store.hlen(sharing.keys.backend("default")[0]) == 0
        assert int(await store.hget(sharing.keys.booked("default"), "total") or 0) == 0
    finally:
        await store.aclose()


async def test_every_reserve_is_given_back_while_a_request_waits_for_the_backend(
    redis_service: RedisServer, redis_prefix: str
) -> None:
    async with gateways_sharing(2, redis_service, redis_prefix, sim_config=LONG_ANSWERS) as sharing:
        await reserves_become(sharing, lambda held: len(held) == 2, "both gateways holding a reserve")
        # Three reserve 48 of the 63 blocks; the fourth waits for one of them to end.
        requests = [
            asyncio.create_task(sharing.clients[0].post("/v1/completions", json=LONG)) for _ in range(4)
        ]
        await wait_until(lambda: in_flight(sharing) == 3, 5.0, "three admitted")
        waiting = sharing.routers[0].fleet.queue("tiny-llama")
        assert len(waiting) == 1
        # The waiting gateway gives its reserve back at once; the other when it reads the
        # first's published queue (at their scrapes).
        await reserves_become(sharing, lambda held: not held, "every reserve given back")
        responses = await asyncio.gather(*requests)
        assert [r.status_code for r in responses] == [200] * 4
        await reserves_become(sharing, lambda held: len(held) == 2, "the reserves again once nobody waits")
