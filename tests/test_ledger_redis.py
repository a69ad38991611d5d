"""Redis ledger behaviour beyond the shared contract: replicas, dead owners, outages, round trips.

Tests that kill or freeze Redis start their own redis-server (loadtest/bench/redis_proc.py); the others
share the session server and isolate themselves by namespace.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from loadtest.bench.redis_proc import RedisServer, redis_server_binary
from router.ledger.base import LedgerUnavailable, RankUsage
from router.ledger.factory import build_ledger
from router.ledger.redis import RedisLedger
from router.placement.snapshot import RankKey

A = RankKey("sg", 0)
B = RankKey("sg", 1)
CAPS = {A: 100, B: 100}

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A redis-server this test may kill, restart or freeze."""
    if redis_server_binary() is None:
        pytest.skip("SKIPPED LOUDLY: no redis-server binary on PATH; install it to run the Redis tests")
    with RedisServer() as server:
        yield server


@pytest.fixture
async def ledgers(anyio_backend: str) -> AsyncIterator[list[RedisLedger]]:
    made: list[RedisLedger] = []
    yield made
    for ledger in made:
        await ledger.close()


def make(made: list[RedisLedger], url: str, ns: str | None = None, **options: object) -> RedisLedger:
    options.setdefault("socket_timeout_s", 2.0)  # a loaded CI machine must not look like a Redis outage
    ledger = RedisLedger.from_url(url, namespace=ns or f"t{random.getrandbits(48):x}", **options)  # type: ignore[arg-type]
    made.append(ledger)
    return ledger


def all_zero(usage: dict[RankKey, RankUsage]) -> bool:
    return all(u.reserved_tokens == u.inflight == u.generated_tokens == 0 for u in usage.values())


async def test_reserve_and_release_are_one_round_trip_each(
    redis_url: str, ledgers: list[RedisLedger]
) -> None:
    ledger = make(ledgers, redis_url)
    await ledger.register(CAPS)
    await ledger.reserve("warm", [A], 1)  # first use may load scripts (NOSCRIPT → EVAL)
    await ledger.renew(["warm"])
    await ledger.release("warm")
    await ledger.usage()
    counts = []
    for step in ("reserve", "renew", "release", "usage"):
        before = ledger.round_trips
        if step == "reserve":
            assert await ledger.reserve("r1", [A, B], 150 - 60) == A
        elif step == "renew":
            await ledger.renew(["r1", "r2", "r3"])
        elif step == "release":
            assert await ledger.release("r1")
        else:
            assert all_zero(await ledger.usage())
        counts.append(ledger.round_trips - before)
    assert counts == [1, 1, 1, 1]


async def test_two_replicas_never_over_commit(redis_url: str, ledgers: list[RedisLedger]) -> None:
    one = make(ledgers, redis_url, "shared-a")
    two = make(ledgers, redis_url, "shared-a")
    await one.register(CAPS)
    await two.register(CAPS)
    calls = [(one if i % 2 else two).reserve(f"q{i}", [A, B], 7) for i in range(80)]
    placed = [r for r in await asyncio.gather(*calls) if r is not None]
    assert len(placed) == 2 * (100 // 7)
    usage = await one.usage()
    assert usage == await two.usage()
    assert all(u.reserved_tokens == 98 for u in usage.values())
    with pytest.raises(ValueError):
        await two.reserve("q1", [A], 1)  # q1 is held by the other replica: still one reservation per id
    assert await two.release("q1") is True  # any replica may release; exactly once
    assert await one.release("q1") is False


async def test_a_dead_replicas_reservations_come_back_within_the_ttl(
    redis_url: str, ledgers: list[RedisLedger]
) -> None:
    ttl_s = 0.5
    survivor = make(ledgers, redis_url, "dead-owner", lease_ttl_s=ttl_s)
    doomed = RedisLedger.from_url(redis_url, namespace="dead-owner", lease_ttl_s=ttl_s)
    await doomed.register(CAPS)
    for i in range(3):
        assert await doomed.reserve(f"d{i}", [A], 30) == A
    await doomed.close()  # the replica is gone: nobody renews or releases its reservations
    died_at = time.monotonic()
    assert (await survivor.usage())[A].reserved_tokens == 90
    for _ in range(100):  # poll the shared view, as another replica's placement would
        if not (await survivor.usage())[A].reserved_tokens:
            break
        await asyncio.sleep(0.05)
    waited_s = time.monotonic() - died_at
    assert all_zero(await survivor.usage())
    assert ttl_s * 0.8 <= waited_s <= ttl_s + 1.5
    assert await survivor.reserve("fresh", [A], 100) == A


async def test_fail_closed_refuses_while_down_and_leaks_nothing(
    own_server: RedisServer, ledgers: list[RedisLedger]
) -> None:
    ledger = make(ledgers, own_server.url, retry_after_s=0.05)
    await ledger.register(CAPS)
    assert await ledger.reserve("before", [A], 40) == A
    assert await ledger.reserve("spans", [A], 40) == A
    own_server.stop()
    with pytest.raises(LedgerUnavailable):
        await ledger.reserve("during", [A, B], 10)
    with pytest.raises(LedgerUnavailable):
        await ledger.usage()
    trips = ledger.round_trips
    with pytest.raises(LedgerUnavailable):
        await ledger.reserve("during2", [A], 10)  # circuit open: refused without waiting on Redis
    assert ledger.round_trips == trips
    assert await ledger.release("before") is True  # never raises: queued until Redis is back
    assert ledger.pending_releases == 1
    own_server.start()  # empty: no persistence
    await asyncio.sleep(0.06)
    assert await ledger.reserve("after", [A], 60) == A  # ranks and "spans" were written back first
    assert (await ledger.usage())[A].reserved_tokens == 100
    assert await ledger.release("spans") and await ledger.release("after")
    await ledger.renew([])  # flushes the queued release
    assert ledger.pending_releases == 0
    assert all_zero(await ledger.usage())


async def test_fail_open_serves_the_local_share_then_reconciles(
    own_server: RedisServer, ledgers: list[RedisLedger]
) -> None:
    ledger = make(ledgers, own_server.url, failure_mode="fail_open", replicas=2, retry_after_s=0.05)
    await ledger.register(CAPS)
    assert await ledger.reserve("r1", [A], 40) == A  # in Redis
    own_server.stop()
    assert await ledger.reserve("r2", [A], 20) is None  # share of A: 100 // 2 - 40 held = 10
    assert await ledger.reserve("r2", [A, B], 20) == B  # local share of B
    assert ledger.local_reserves == 2
    usage = await ledger.usage()
    assert (usage[A].capacity_tokens, usage[A].reserved_tokens, usage[B].reserved_tokens) == (50, 40, 20)
    assert await ledger.release("r1") is True  # queued for Redis; frees this replica's share of A
    assert await ledger.reserve("r3", [A], 50) == A
    assert await ledger.reserve("gone", [B], 5) == B
    assert await ledger.release("gone") is True  # ended locally: never reaches Redis
    own_server.start()
    await asyncio.sleep(0.06)
    usage = await ledger.usage()  # first trip back: local reservations written into Redis
    assert {k: u.reserved_tokens for k, u in usage.items()} == {A: 50, B: 20}
    assert usage[A].capacity_tokens == 100
    got = await ledger.get("r2")
    assert got is not None and got.key == B
    assert await ledger.release("r2") and await ledger.release("r3")
    assert await ledger.release("r3") is False
    await ledger.expire()
    assert all_zero(await ledger.usage()) and ledger.pending_releases == 0


async def churn(ledger: RedisLedger, worker: int, stop: asyncio.Event) -> int:
    """Reserve, hold briefly, release, until told to stop; returns how many were refused by an outage."""
    refused = 0
    for n in range(10_000):
        if stop.is_set():
            return refused
        rid = f"w{worker}-{n}"
        try:
            key = await ledger.reserve(rid, [A, B], random.randint(1, 20))
        except LedgerUnavailable:
            refused += 1
            await asyncio.sleep(0.01)
            continue
        await asyncio.sleep(0.005)
        if key is not None:
            await ledger.release(rid)  # False if Redis restarted empty before it was written back
    return refused


@pytest.mark.parametrize("mode", ["fail_closed", "fail_open"])
async def test_restart_mid_load_leaks_nothing(
    own_server: RedisServer, ledgers: list[RedisLedger], mode: str
) -> None:
    replicas = [
        make(ledgers, own_server.url, "load", failure_mode=mode, replicas=2, retry_after_s=0.05)
        for _ in range(2)
    ]
    for ledger in replicas:
        await ledger.register(CAPS)
    stop = asyncio.Event()
    workers = [asyncio.create_task(churn(replicas[i % 2], i, stop)) for i in range(16)]
    await asyncio.sleep(0.3)
    await asyncio.to_thread(own_server.restart)
    await asyncio.sleep(0.4)
    stop.set()
    refused = sum(await asyncio.gather(*workers))
    for ledger in replicas:
        await ledger.renew([])  # the gateway's lease loop: flushes releases queued during the outage
    usage = await replicas[0].usage()
    assert all_zero(usage), usage
    assert all(u.capacity_tokens == 100 for u in usage.values())
    if mode == "fail_open":
        assert refused == 0 and sum(r.local_reserves for r in replicas) > 0
    else:
        assert refused > 0 and sum(r.local_reserves for r in replicas) == 0


async def test_a_hung_redis_costs_one_timeout_then_fails_fast(
    own_server: RedisServer, ledgers: list[RedisLedger]
) -> None:
    ledger = make(ledgers, own_server.url, socket_timeout_s=0.1, retry_after_s=0.3)
    await ledger.register(CAPS)
    own_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable):
            await ledger.reserve("slow", [A], 10)
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable):
            await ledger.usage()
        assert time.monotonic() - started < 0.05  # circuit open: no second timeout
    finally:
        own_server.resume()
    await asyncio.sleep(0.35)
    assert await ledger.reserve("ok", [A], 10) == A
    assert await ledger.release("ok")
    assert all_zero(await ledger.usage())


async def test_factory_builds_each_store(redis_url: str) -> None:
    ledger = build_ledger(redis_url, failure_mode="fail-open", namespace="factory", replicas=3)
    assert isinstance(ledger, RedisLedger) and ledger.failure_mode == "fail_open"
    await ledger.register({A: 10})
    assert await ledger.reserve("f", [A], 10) == A and await ledger.release("f")
    await ledger.close()
    for bad in ({"failure_mode": "maybe"}, {"replicas": 0}, {"namespace": "a}b"}, {"lease_ttl_s": 0}):
        with pytest.raises(ValueError):
            build_ledger(redis_url, **bad)  # type: ignore[arg-type]
