"""The Ledger contract (router/ledger/base.py), one suite run against every store.

The Redis store runs against a real redis-server started on a free port (tests/conftest.py); every test
gets its own namespace on that server; the shared-memory store gets its own file per ledger. Time: the
memory and shared-memory stores use an injected clock advanced instantly, the Redis store leases use the
server's clock, so its lease tests really sleep (short TTLs).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from router.ledger.base import Ledger, RankUsage
from router.ledger.memory import InMemoryLedger
from router.ledger.shm import SharedMemoryLedger
from router.ledger.shm_file import create_ledger_file, remove_ledger_file
from router.placement.snapshot import RankKey

A = RankKey("sg", 0)
B = RankKey("sg", 1)
C = RankKey("vl", 0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Harness:
    """Builds ledgers of one store kind and moves time forward for their leases."""

    kind: str
    redis_url: str | None
    advance: Callable[[float], Awaitable[None]]
    built: list[Ledger] = field(default_factory=list)
    clock_s: list[float] = field(default_factory=lambda: [1000.0])
    files: list[str] = field(default_factory=list)

    def make(self, lease_ttl_s: float = 30.0) -> Ledger:
        ledger: Ledger
        if self.kind == "memory":
            ledger = InMemoryLedger(lease_ttl_s=lease_ttl_s, clock=lambda: self.clock_s[0])
        elif self.kind == "shm":
            path = create_ledger_file()
            self.files.append(path)
            ledger = SharedMemoryLedger(path, lease_ttl_s=lease_ttl_s, clock=lambda: self.clock_s[0])
        else:
            from router.ledger.redis import RedisLedger

            assert self.redis_url is not None
            ns = f"t{random.getrandbits(48):x}"
            # Generous timeout: the contract is not about timeouts, and loaded CI machines stall.
            ledger = RedisLedger.from_url(
                self.redis_url, namespace=ns, lease_ttl_s=lease_ttl_s, socket_timeout_s=2.0
            )
        self.built.append(ledger)
        return ledger


@pytest.fixture(params=["memory", "shm", "redis"])
async def harness(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Harness]:
    kind: str = request.param
    url: str | None = None
    if kind == "redis":
        url = request.getfixturevalue("redis_url")

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(seconds)

    h = Harness(kind, url, sleep)
    if kind in ("memory", "shm"):

        async def tick(seconds: float) -> None:
            h.clock_s[0] += seconds

        h.advance = tick
    yield h
    for ledger in h.built:
        await ledger.close()
    for path in h.files:
        remove_ledger_file(path)


async def registered(h: Harness, lease_ttl_s: float = 30.0, capacity_tokens: int = 100) -> Ledger:
    ledger = h.make(lease_ttl_s)
    await ledger.register({A: capacity_tokens, B: capacity_tokens, C: capacity_tokens})
    return ledger


def reserved(usage: dict[RankKey, RankUsage]) -> dict[RankKey, int]:
    return {k: u.reserved_tokens for k, u in usage.items()}


pytestmark = pytest.mark.anyio


async def test_usage_lists_every_registered_rank_at_zero(harness: Harness) -> None:
    ledger = await registered(harness)
    usage = await ledger.usage()
    assert usage == {k: RankUsage(capacity_tokens=100) for k in (A, B, C)}
    assert isinstance(ledger, Ledger)


async def test_reserve_takes_first_candidate_that_fits(harness: Harness) -> None:
    ledger = await registered(harness)
    assert await ledger.reserve("r1", [A, B], 80) == A
    assert await ledger.reserve("r2", [A, B], 30) == B  # A has 20 left: falls through in order
    assert await ledger.reserve("r3", [B, A], 20) == B  # order is the caller's, not the ledger's
    assert await ledger.reserve("r4", [A, B], 60) is None  # fits nowhere
    assert await ledger.reserve("r5", [A], 20) == A  # exactly full is allowed
    usage = await ledger.usage()
    assert reserved(usage) == {A: 100, B: 50, C: 0}
    assert (usage[A].inflight, usage[B].inflight, usage[C].inflight) == (2, 2, 0)
    got = await ledger.get("r2")
    assert got is not None and (got.key, got.tokens) == (B, 30)
    assert await ledger.get("r4") is None


async def test_refuses_over_capacity_and_changes_nothing(harness: Harness) -> None:
    ledger = await registered(harness)
    assert await ledger.reserve("big", [A, B, C], 101) is None
    assert await ledger.reserve("none", [], 1) is None
    assert set(reserved(await ledger.usage()).values()) == {0}
    assert await ledger.release("big") is False


async def test_bad_calls_raise_and_never_double_count(harness: Harness) -> None:
    ledger = await registered(harness)
    assert await ledger.reserve("r1", [A], 10) == A
    with pytest.raises(ValueError):
        await ledger.reserve("r1", [B], 10)  # one reservation per request id
    with pytest.raises(ValueError):
        await ledger.reserve("r2", [RankKey("nope", 9)], 10)
    with pytest.raises(ValueError):
        await ledger.reserve("r3", [A], 0)
    with pytest.raises(ValueError):
        await ledger.grow("r1", -5)
    usage = await ledger.usage()
    assert reserved(usage) == {A: 10, B: 0, C: 0}
    assert usage[A].inflight == 1


async def test_concurrent_reserves_never_exceed_capacity(harness: Harness) -> None:
    ledger = await registered(harness, capacity_tokens=500)
    results = await asyncio.gather(*(ledger.reserve(f"q{i}", [A, B], 10) for i in range(150)))
    placed = [r for r in results if r is not None]
    assert len(placed) == 100  # exactly 2 × 500 / 10 fit, the other 50 lost the race cleanly
    usage = await ledger.usage()
    assert reserved(usage) == {A: 500, B: 500, C: 0}
    assert usage[A].inflight + usage[B].inflight == 100


async def test_release_exactly_once(harness: Harness) -> None:
    ledger = await registered(harness)
    await ledger.reserve("r1", [A], 40)
    await ledger.add_generated("r1", 7)
    firsts = await asyncio.gather(*(ledger.release("r1") for _ in range(5)))
    assert sorted(firsts) == [False, False, False, False, True]
    assert await ledger.release("r1") is False
    assert await ledger.release("never") is False
    assert (await ledger.usage())[A] == RankUsage(capacity_tokens=100)
    assert await ledger.get("r1") is None


async def test_grow_and_shrink(harness: Harness) -> None:
    ledger = await registered(harness)
    await ledger.reserve("r1", [A], 50)
    await ledger.reserve("r2", [A], 30)
    assert await ledger.grow("r1", 20) is True  # 100 / 100
    assert await ledger.grow("r1", 1) is False  # full: unchanged
    assert reserved(await ledger.usage())[A] == 100
    assert await ledger.shrink("r2", 10) is True
    assert await ledger.grow("r1", 10) is True
    assert await ledger.shrink("r2", 1000) is True  # clamped at zero, never negative
    got = await ledger.get("r1")
    assert got is not None and got.tokens == 80
    assert reserved(await ledger.usage())[A] == 80
    assert await ledger.grow("ghost", 1) is False
    assert await ledger.shrink("ghost", 1) is False
    assert await ledger.release("r2") and await ledger.release("r1")
    assert reserved(await ledger.usage())[A] == 0


async def test_generated_tokens_are_counted_and_given_back(harness: Harness) -> None:
    ledger = await registered(harness)
    await ledger.reserve("r1", [B], 50)
    await ledger.reserve("r2", [B], 10)
    await ledger.add_generated("r1", 5)
    await ledger.add_generated("r1", 3)
    await ledger.add_generated("r2", 2)
    await ledger.add_generated("ghost", 9)
    assert (await ledger.usage())[B].generated_tokens == 10
    got = await ledger.get("r1")
    assert got is not None and got.generated_tokens == 8
    await ledger.release("r1")
    assert (await ledger.usage())[B].generated_tokens == 2


async def test_leases_expire_and_capacity_comes_back(harness: Harness) -> None:
    ledger = await registered(harness, lease_ttl_s=0.4)
    for i, key in enumerate((A, B, B)):
        assert await ledger.reserve(f"r{i}", [key], 30) == key
    await harness.advance(0.6)
    assert await ledger.expire() == 3
    assert await ledger.expire() == 0
    usage = await ledger.usage()
    assert set(reserved(usage).values()) == {0} and {u.inflight for u in usage.values()} == {0}
    assert await ledger.release("r0") is False  # reclaimed already: releasing is a no-op
    assert await ledger.get("r1") is None


async def test_expired_leases_are_reclaimed_without_an_expire_call(harness: Harness) -> None:
    ledger = await registered(harness, lease_ttl_s=0.4)
    await ledger.reserve("old", [A], 100)
    await harness.advance(0.6)
    assert await ledger.reserve("new", [A], 100) == A  # the dead lease no longer holds A
    assert reserved(await ledger.usage())[A] == 100


async def test_renew_keeps_reservations_alive(harness: Harness) -> None:
    ledger = await registered(harness, lease_ttl_s=0.6)
    await ledger.reserve("kept", [A], 10)
    await ledger.reserve("dropped", [B], 10)
    for _ in range(100):  # renew "kept" every TTL/4 until "dropped" has expired: no timing guesswork
        await ledger.renew(["kept", "ghost"])
        await harness.advance(0.15)
        if await ledger.get("dropped") is None:
            break
    assert await ledger.get("dropped") is None
    assert await ledger.get("kept") is not None
    assert reserved(await ledger.usage()) == {A: 10, B: 0, C: 0}
    await ledger.renew([])


async def test_capacity_change_applies_to_new_reservations(harness: Harness) -> None:
    ledger = await registered(harness)
    await ledger.reserve("r1", [A], 80)
    await ledger.register({A: 50})
    assert await ledger.reserve("r2", [A], 1) is None  # held 80 > new capacity 50: nothing new fits
    assert (await ledger.usage())[A] == RankUsage(capacity_tokens=50, reserved_tokens=80, inflight=1)
    await ledger.register({A: 200})
    assert await ledger.reserve("r3", [A], 120) == A
    assert await ledger.release("r1") and await ledger.release("r3")
    assert (await ledger.usage())[A] == RankUsage(capacity_tokens=200)


async def test_zero_after_any_mix_of_operations(harness: Harness) -> None:
    ledger = await registered(harness, capacity_tokens=300)
    rng = random.Random(7)
    live: list[str] = []
    for i in range(120):
        op = rng.random()
        if op < 0.5 or not live:
            rid = f"m{i}"
            if await ledger.reserve(rid, rng.sample([A, B, C], 2), rng.randint(1, 80)) is not None:
                live.append(rid)
        elif op < 0.65:
            await ledger.grow(rng.choice(live), rng.randint(0, 40))
        elif op < 0.75:
            await ledger.shrink(rng.choice(live), rng.randint(0, 40))
        elif op < 0.85:
            await ledger.add_generated(rng.choice(live), rng.randint(0, 9))
        else:
            assert await ledger.release(live.pop(rng.randrange(len(live))))
        usage = await ledger.usage()
        assert all(0 <= u.reserved_tokens <= u.capacity_tokens for u in usage.values())
    await asyncio.gather(*(ledger.release(rid) for rid in live))
    usage = await ledger.usage()
    assert all(u == RankUsage(capacity_tokens=300) for u in usage.values()), usage
