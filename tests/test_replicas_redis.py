"""Two real router replicas while their Redis is killed and restarted empty mid-load: the configured
failure mode holds (fail_closed refuses new requests with 503 and an OpenAI error body; fail_open keeps
serving from each replica's local share) and afterwards every rank is back to zero, in Redis and in /ranks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from emulator_fixtures import StartEmulator
from test_replicas_support import (
    Tally,
    engine_stats,
    keep_loading,
    replicas,
    serve_args,
    settled,
    stream_one,
    watching,
)

from loadtest.bench.redis_proc import RedisServer, redis_server_binary
from loadtest.emulator.host import EmulatorThread
from router.ledger.base import LedgerUnavailable, RankUsage
from router.ledger.redis import RedisLedger
from router.placement.snapshot import RankKey

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.timeout(60)]

DP_SIZE = 4
RANK_TOKENS = 2000
PROMPT_TOKENS = 100
OUTPUT_TOKENS = 300
DOWN_S = 1.5
AFTER_S = 1.5  # load kept on after Redis is back


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    if redis_server_binary() is None:
        pytest.skip("SKIPPED LOUDLY: no redis-server binary on PATH; install it to run the replica tests")
    with RedisServer() as server:
        yield server


@pytest.fixture
def engine(start_emulator: StartEmulator) -> EmulatorThread:
    return start_emulator("sglang", dp_size=DP_SIZE, kv_tokens_per_rank=RANK_TOKENS, time_scale=0.05)


async def probe(session: aiohttp.ClientSession, urls: list[str], per_replica: int) -> Tally:
    """New requests sent while Redis is down, ``per_replica`` to each replica at once."""
    tally = Tally()
    sends = [stream_one(session, url, tally, PROMPT_TOKENS, 20) for url in urls for _ in range(per_replica)]
    await asyncio.gather(*sends)
    return tally


async def until_served(session: aiohttp.ClientSession, url: str, timeout_s: float = 8.0) -> float:
    """Seconds until a new request to ``url`` succeeds (one at a time, as soon as the last was refused)."""
    started_s = time.monotonic()
    tally = Tally()
    while await stream_one(session, url, tally, PROMPT_TOKENS, 20) != 200:
        assert time.monotonic() - started_s < timeout_s, tally
        await asyncio.sleep(0.02)
    return time.monotonic() - started_s


@pytest.mark.parametrize("mode", ["fail_closed", "fail_open"])
async def test_redis_restarted_mid_load(
    mode: str, redis: RedisServer, engine: EmulatorThread, tmp_path: Path
) -> None:
    ns = f"restart-{mode}"
    args = serve_args(engine.url, redis.url, "--lease-ttl", "2", "--queue-timeout", "30", "--replicas", "2",
                      "--ledger-namespace", ns, "--ledger-failure-mode", mode)  # fmt: skip
    with replicas([args] * 2, tmp_path) as (a, b):
        urls = [a.url, b.url]
        load, stop = Tally(), asyncio.Event()
        async with aiohttp.ClientSession() as session, watching(session, engine.url) as watch:
            try:
                loads = [asyncio.create_task(keep_loading(session, url, load, stop, 12, PROMPT_TOKENS,
                                                          OUTPUT_TOKENS)) for url in urls]  # fmt: skip
                await asyncio.sleep(0.8)
                redis.stop()
                down_at_s = time.monotonic()
                await asyncio.sleep(0.3)
                during = await probe(session, urls, 4)
                await asyncio.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at_s)))
                redis.start()
                ok_at_up, up_at_s = load.ok, time.monotonic()
                served_s = await asyncio.gather(*(until_served(session, url) for url in urls))
                await asyncio.sleep(max(0.0, AFTER_S - (time.monotonic() - up_at_s)))
                ok_after = load.ok - ok_at_up
                stop.set()
                await asyncio.gather(*loads)
            finally:
                stop.set()
            stats = await engine_stats(session, engine.url)
            usage, rows = await settled(session, redis.url, ns, urls)
        preempted, peaks = stats["preemptions_total"], watch.peak_used_tokens
        print(f"{mode}: during the outage {during.statuses}, load {load.statuses}; Redis back: new requests "
              f"served after {[round(t, 2) for t in served_s]} s, {ok_after} streams done in {AFTER_S} s; "
              f"preemptions {preempted}, engine peaks {peaks}")  # fmt: skip
        assert not load.errors and not during.errors, (load.errors[:3], during.errors[:3])
        if mode == "fail_closed":
            assert during.statuses == {503: 8}, during
            for body in during.refusals:
                err = body["error"]
                assert err["code"] == "ledger_unavailable" and err["type"] == "service_unavailable_error"
                assert set(err) == {"message", "type", "param", "code"}
            assert set(load.statuses) <= {200, 503}, load.statuses
        else:
            assert during.statuses == {200: 8}, during
            assert set(load.statuses) == {200}, load.statuses
        # Back within one circuit period (1 s) plus a wait in the queue behind the load, and streams finish.
        assert max(served_s) < 3.0 and ok_after > 0, (served_s, ok_after)
        logs = [r.log_tail(8) for r in (a, b)]  # a Redis error while Redis was up shows there
        # fail_closed admits nothing Redis has not checked: no preemption. fail_open books local shares blind
        # while the replicas reconnect one by one (docs/replicas.md): a few preemptions may follow, never
        # a rank over capacity, never a leak.
        allowed = 0 if mode == "fail_closed" else 8
        assert stats["preemptions_total"] <= allowed, (stats, logs)
        assert not watch.over_capacity, (watch.over_capacity, logs)
        assert len(usage) == DP_SIZE and all(v == (0, 0) for v in usage.values()), usage
        for replica_rows in rows:
            assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in replica_rows), rows


async def test_a_restarted_redis_is_usable_after_one_circuit_period(redis: RedisServer) -> None:
    """Regression: every pooled connection outlived the restart; each failed once when load next reached it,
    re-opening the circuit each time, so a busy replica answered 503 for seconds after Redis was back."""
    ledger = RedisLedger.from_url(redis.url, namespace="pool", retry_after_s=0.2, socket_timeout_s=2.0)
    try:
        await ledger.register({RankKey("b", 0): 100})
        await asyncio.gather(*(ledger.usage() for _ in range(24)))  # a busy replica: 24 pooled connections
        redis.stop()
        redis.start()
        with pytest.raises(LedgerUnavailable):
            await ledger.usage()  # the connection in hand was the old server's
        await asyncio.sleep(0.25)
        assert await ledger.usage()  # one call after the circuit period: fine either way
        # Load comes back: 24 concurrent calls reach 24 pooled connections; none may be the old server's.
        results = await asyncio.gather(*(ledger.usage() for _ in range(24)), return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)], results
    finally:
        await ledger.close()


async def test_fail_open_shares_stay_within_capacity_when_replicas_held_unequal_parts(
    redis: RedisServer,
) -> None:
    """Regression: each replica's outage share was ``capacity // replicas`` minus its own holdings, which
    over-commits as soon as one replica held more than its half (the other then adds up to its full half).
    A share is now what the replica held at its last Redis read plus an equal slice of the room free then."""
    rank = RankKey("b", 0)
    a, b = (RedisLedger.from_url(redis.url, namespace="unequal", failure_mode="fail_open", replicas=2,
                                 retry_after_s=5.0, socket_timeout_s=2.0) for _ in range(2))  # fmt: skip
    try:
        for ledger in (a, b):
            await ledger.register({rank: 100})
        assert await a.reserve("a1", [rank], 80) == rank
        assert await b.reserve("b1", [rank], 10) == rank
        for ledger in (a, b):
            assert (await ledger.usage())[rank].reserved_tokens == 90  # each replica's last look at Redis
        redis.stop()
        # 10 tokens were free: 5 for each replica, whatever each already held.
        assert await b.reserve("b2", [rank], 6) is None
        assert await b.reserve("b2", [rank], 5) == rank
        assert await a.reserve("a2", [rank], 6) is None
        assert await a.reserve("a2", [rank], 5) == rank
        assert await a.release("a1")  # what a replica frees of its own it may book again
        assert await a.reserve("a3", [rank], 80) == rank
        assert await a.reserve("a4", [rank], 1) is None
        held = [(await ledger.usage())[rank] for ledger in (a, b)]  # degraded view: own share, own part
        assert [(u.capacity_tokens, u.reserved_tokens) for u in held] == [(85, 85), (15, 15)], held
    finally:
        for ledger in (a, b):
            await ledger.close()


async def redis_view(ledger: RedisLedger) -> dict[RankKey, RankUsage]:
    """The ledger's usage once it reads Redis again (a degraded fail_open view reports the share instead
    of the capacity; a pooled connection to the old server fails once more)."""
    for _ in range(100):
        usage = await ledger.usage()
        if all(u.capacity_tokens == 100 for u in usage.values()):
            return usage
        await asyncio.sleep(0.02)
    raise AssertionError(f"never read Redis again: {usage}")


async def test_after_an_outage_a_replica_keeps_to_its_share_until_the_others_wrote_theirs_back(
    redis: RedisServer,
) -> None:
    """Regression: Redis restarted empty; the first replica back booked against capacity minus its own
    holdings while the other's (booked locally during the outage) were not written back yet: the engine
    was over-committed for up to a second (engine preemptions in the end-to-end test)."""
    rank = RankKey("b", 0)
    opts = {"failure_mode": "fail_open", "replicas": 2, "retry_after_s": 0.05, "socket_timeout_s": 2.0}
    a, b = (RedisLedger.from_url(redis.url, namespace="settle", settle_s=30.0, **opts) for _ in range(2))  # type: ignore[arg-type]
    try:
        for ledger in (a, b):
            await ledger.register({rank: 100})
        assert await a.reserve("a1", [rank], 80) == rank
        for ledger in (a, b):
            await ledger.usage()
        redis.stop()
        assert await b.reserve("b1", [rank], 10) == rank  # booked locally: Redis learns it when b is back
        redis.start()  # empty
        assert (await redis_view(a))[rank].reserved_tokens == 80  # a is back first: Redis has only a's part
        assert await a.reserve("a2", [rank], 15) is None  # fits Redis's view, not a's share (80 + 20 // 2)
        assert await a.reserve("a2", [rank], 10) == rank
        assert a.local_reserves == 0  # booked in Redis, not locally
        assert (await redis_view(b))[rank].reserved_tokens == 100  # b is back: its local booking written back
        assert await b.reserve("b2", [rank], 1) is None
    finally:
        for ledger in (a, b):
            await ledger.close()
