"""The shared ledger's Lua scripts on a real redis-server: route-and-reserve, releases and
resizes, renewals, expiry. Time is the server's: expiries here are short, not faked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis_server import RedisServer

from gateway.redis_store import KeyNames, _script

TTL_MS = 60_000


@pytest.fixture
async def client(redis_service: RedisServer) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_service.url)
    yield connection
    await connection.aclose()


class Scripts:
    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.keys = KeyNames(prefix)
        self.book_script = client.register_script(_script("book"))
        self.release_script = client.register_script(_script("release"))
        self.renew_script = client.register_script(_script("renew"))
        self.reserve_script = client.register_script(_script("reserve"))

    async def book(
        self,
        owner: str,
        caps: dict[str, int],
        requests: list[tuple[str, list[tuple[str, int]]]],
        ttl_ms: int = TTL_MS,
    ) -> list[str | None]:
        names = list(caps)
        keys = [key for name in names for key in self.keys.backend(name)]
        args: list[str | int] = [owner, ttl_ms, len(names), *caps.values(), len(requests)]
        for lease, candidates in requests:
            args += [lease, len(candidates)]
            for name, blocks in candidates:
                args += [names.index(name) + 1, blocks]
        placements, _caps, _others = await self.book_script(keys=keys, args=args)
        return [names[int(p) - 1] if int(p) else None for p in placements]

    async def release(self, owner: str, backend: str, changes: list[tuple[str, int]]) -> int:
        args: list[str | int] = [owner]
        for lease, blocks in changes:
            args += [lease, blocks]
        return int(await self.release_script(keys=self.keys.backend(backend), args=args))

    async def renew(
        self,
        owner: str,
        backend: str,
        leases: list[tuple[str, int]],
        *,
        view: str = "",
        cap: int = 0,
        ttl_ms: int = TTL_MS,
    ) -> tuple[int, int, list[str]]:
        args: list[str | int] = [owner, ttl_ms, view, TTL_MS, cap]
        for lease, blocks in leases:
            args += [lease, blocks]
        others, alive, views = await self.renew_script(
            keys=[*self.keys.backend(backend), self.keys.alive], args=args
        )
        return int(others), int(alive), [v.decode() for v in views]

    async def reserve(
        self,
        owner: str,
        backend: str,
        *,
        cap: int,
        target: int = -1,
        share: int = 1,
        takes: list[tuple[str, int]] | None = None,
        ttl_ms: int = TTL_MS,
    ) -> tuple[int, int]:
        """The reserve script: (the reserve's blocks, others' booked blocks)."""
        args: list[str | int] = [owner, ttl_ms, f"{owner}:reserve", cap, target, share]
        for lease, blocks in takes or []:
            args += [lease, blocks]
        held, others = await self.reserve_script(keys=self.keys.backend(backend), args=args)
        return int(held), int(others)

    async def lease(self, backend: str, lease: str) -> str | None:
        value = await self.client.hget(self.keys.backend(backend)[0], lease)
        return value.decode() if value is not None else None

    async def booked(self, backend: str, field: str = "total") -> int:
        return int(await self.client.hget(self.keys.booked(backend), field) or 0)


async def test_a_request_is_booked_on_the_first_candidate_with_room_or_on_none(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    caps = {"a": 10, "b": 10}
    assert await scripts.book("p1", caps, [("p1:1", [("a", 8), ("b", 8)])]) == ["a"]
    # a has 2 left: the next goes to b; then neither has 8 left.
    placed = await scripts.book("p1", caps, [("p1:2", [("a", 8), ("b", 8)]), ("p1:3", [("a", 8), ("b", 8)])])
    assert placed == ["b", None]
    assert await scripts.book("p1", caps, [("p1:4", [("a", 2)])]) == ["a"]
    assert (await scripts.booked("a"), await scripts.booked("b")) == (10, 8)
    assert await scripts.booked("a", "p1") == 10


async def test_booking_the_same_lease_twice_counts_it_once(client: aioredis.Redis, redis_prefix: str) -> None:
    scripts = Scripts(client, redis_prefix)
    assert await scripts.book("p1", {"a": 10}, [("p1:1", [("a", 6)])]) == ["a"]
    # The answer was lost and the request is booked again: the same lease, already there.
    assert await scripts.book("p1", {"a": 10}, [("p1:1", [("a", 6)])]) == ["a"]
    assert await scripts.booked("a") == 6


async def test_the_smallest_cap_of_the_live_processes_holds(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    await scripts.renew("p2", "a", [], view="[0,0,0,0,0,0,0,0]", cap=5)
    assert await scripts.book("p1", {"a": 10}, [("p1:1", [("a", 6)])]) == [None]
    assert await scripts.book("p1", {"a": 10}, [("p1:2", [("a", 5)])]) == ["a"]
    # A cap whose process stopped publishing it no longer binds.
    await scripts.renew("p3", "a", [], view="[0,0,0,0,0,0,0,0]", cap=1, ttl_ms=TTL_MS)
    await client.hset(KeyNames(redis_prefix).backend("a")[3], mapping={"p2": "1 5 x", "p3": "1 1 x"})
    assert await scripts.book("p1", {"a": 10}, [("p1:3", [("a", 5)])]) == ["a"]


async def test_releases_and_resizes_apply_once_and_only_to_live_leases(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    await scripts.book("p1", {"a": 20}, [("p1:1", [("a", 6)]), ("p1:2", [("a", 4)])])
    await scripts.book("p2", {"a": 20}, [("p2:1", [("a", 3)])])
    others = await scripts.release("p1", "a", [("p1:1", 9), ("p1:2", 0), ("p1:2", 0), ("p1:9", 5)])
    assert others == 3  # p2's
    assert await scripts.booked("a") == 12
    assert await scripts.booked("a", "p1") == 9
    await scripts.release("p1", "a", [("p1:1", 0)])
    assert await scripts.booked("a") == 3
    assert await client.hexists(KeyNames(redis_prefix).booked("a"), "p1") == 0


async def test_expired_leases_give_their_blocks_back_and_a_renewal_books_a_live_one_again(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    await scripts.book("dead", {"a": 20}, [("dead:1", [("a", 7)])], ttl_ms=100)
    await scripts.book("p1", {"a": 20}, [("p1:1", [("a", 5)])], ttl_ms=100)
    await asyncio.sleep(0.25)
    # p1 still runs its request: its renewal recreates the lease; the dead one's is swept.
    others, alive, views = await scripts.renew("p1", "a", [("p1:1", 5)], view="[1,2,3,4,5,6,7,8]", cap=20)
    assert (others, alive, views) == (0, 1, [])
    assert await scripts.booked("a") == 5
    # A renewal resizes a lease whose resize was lost, and shows the others' views.
    await scripts.renew("p2", "a", [], view="[9,9,9,9,9,9,9,9]", cap=20)
    others, alive, views = await scripts.renew("p1", "a", [("p1:1", 8)])
    assert (others, alive, views) == (0, 2, ["p2", "[9,9,9,9,9,9,9,9]"])
    assert await scripts.booked("a") == 8


async def test_a_peer_entry_that_is_not_ours_binds_nobody_and_is_dropped(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    peer = KeyNames(redis_prefix).backend("a")[3]
    far = 2**50  # an expiry far in the future: only the format is wrong
    await client.hset(peer, mapping={"old": "garbage", "odd": f"{far} notanumber x", "bare": f"{far}"})
    assert await scripts.book("p1", {"a": 10}, [("p1:1", [("a", 6)])]) == ["a"]
    assert await client.hlen(peer) == 0
    others, alive, views = await scripts.renew("p1", "a", [("p1:1", 6)])
    assert (others, alive, views) == (0, 1, [])


async def test_a_reserve_grows_to_its_share_of_the_room_under_the_smallest_cap(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    await scripts.book("p2", {"a": 40}, [("p2:1", [("a", 10)])])
    # 40 - 10 = 30 blocks of room, a fourth of it at most.
    assert await scripts.reserve("p1", "a", cap=40, target=100, share=4) == (7, 10)
    assert await scripts.booked("a") == 17
    # Another process published a smaller cap, 15, with 17 booked: the reserve does not grow
    # past it, and gives back the 2 blocks over it.
    await scripts.renew("p3", "a", [], view="[0,0,0,0,0,0,0,0]", cap=15)
    assert await scripts.reserve("p1", "a", cap=40, target=100, share=1) == (5, 10)
    assert await scripts.booked("a") == 15
    # A smaller target shrinks it at once; 0 gives it back whole.
    assert await scripts.reserve("p1", "a", cap=40, target=2) == (2, 10)
    assert await scripts.reserve("p1", "a", cap=40, target=0) == (0, 10)
    assert await scripts.lease("a", "p1:reserve") is None
    assert (await scripts.booked("a"), await scripts.booked("a", "p1")) == (10, 0)


async def test_a_take_moves_blocks_from_the_reserve_to_the_request_lease_once(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    assert await scripts.reserve("p1", "a", cap=30, target=12) == (12, 0)
    assert await scripts.reserve("p1", "a", cap=30, takes=[("p1:1", 5), ("p1:2", 4)]) == (3, 0)
    assert await scripts.booked("a") == 12  # the total did not move
    assert (await scripts.lease("a", "p1:1"), await scripts.lease("a", "p1:2")) == ("p1 5", "p1 4")
    # Sent again (its answer was lost): nothing changes.
    assert await scripts.reserve("p1", "a", cap=30, takes=[("p1:1", 5)]) == (3, 0)
    assert await scripts.booked("a") == 12
    # The request's lease is an ordinary lease: released like one, its blocks leave the total.
    await scripts.release("p1", "a", [("p1:1", 0)])
    assert await scripts.booked("a") == 7
    # More than the reserve holds (it expired or was given back meanwhile): the rest is
    # booked as a renewal books a running request, and the reserve is gone.
    assert await scripts.reserve("p1", "a", cap=30, takes=[("p1:3", 6)]) == (0, 0)
    assert await scripts.lease("a", "p1:reserve") is None
    assert await scripts.booked("a") == 4 + 6
    # Takes first, then the new size, in one call.
    assert await scripts.reserve("p1", "a", cap=30, target=5, share=1, takes=[("p1:4", 1)]) == (5, 0)
    assert await scripts.booked("a") == 4 + 6 + 1 + 5


async def test_a_reserve_that_is_not_renewed_expires_like_a_lease(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    scripts = Scripts(client, redis_prefix)
    assert await scripts.reserve("p1", "a", cap=30, target=8, ttl_ms=100) == (8, 0)
    assert await scripts.booked("a", "p1") == 8
    await asyncio.sleep(0.25)
    # Any call on the backend sweeps it.
    assert await scripts.book("p2", {"a": 30}, [("p2:1", [("a", 30)])]) == ["a"]
    assert (await scripts.booked("a"), await scripts.booked("a", "p1")) == (30, 0)


async def test_a_publication_renews_the_holders_scrape_lease_and_is_placed_when_its_scrape_ended(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    keys = KeyNames(redis_prefix).scrape("a")
    turn = client.register_script(_script("scrape_turn"))
    publish = client.register_script(_script("scrape_publish"))
    assert await turn(keys=keys, args=["p1", 1_000]) == [1]
    # Only the lease's holder publishes.
    assert await publish(keys=keys, args=["p2", 5, "from p2", TTL_MS, TTL_MS, 0]) == 0
    assert await client.exists(keys[1]) == 0
    assert await publish(keys=keys, args=["p1", 5, "from p1", TTL_MS, 30_000, 400]) == 1
    # Renewed for the ttl sent, far past the turn's second.
    assert 29_000 < await client.pttl(keys[0]) <= 30_000
    kind, _stamp, age_ms, took_ms, text = await turn(keys=keys, args=["p2", 1_000])
    assert (int(kind), took_ms, text) == (2, b"5", b"from p1")
    # The scrape ended 0.4 s before the publication reached the server: that is its age.
    assert 400 <= int(age_ms) < 1_400
