"""The output-length predictor shared by router replicas through a real redis-server (conftest ``redis_url``):
deltas pushed and the shared state pulled in one Lua script, replicas converging on one answer, the key
cap, failures that leave the local predictor working, and two gateways learning from each other."""

from __future__ import annotations

import asyncio
import math
import random
import uuid

import httpx
import pytest
import redis.asyncio as aioredis
from gateway_support import emulator, ranks_settled, router
from redis.exceptions import RedisError
from test_reservation_gateway import PROMPT_IDS, generate

from router.reservation.histogram import bin_of, bin_upper_tokens
from router.reservation.predictor import Predictor, RequestKey
from router.reservation.shared import GLOBAL_LEVEL, PredictorShare, SharedPredictor
from router.units import round_up

pytestmark = pytest.mark.anyio
KEY = RequestKey("/v1/chat/completions", "m", 1500)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def namespace() -> str:
    return f"rg-{uuid.uuid4().hex[:10]}"


def lengths(rng: random.Random, mean: float, n: int) -> list[int]:
    mu = math.log(mean) - 0.125
    return [max(1, round(rng.lognormvariate(mu, 0.5))) for _ in range(n)]


def assert_same_state(a: Predictor, b: Predictor) -> None:
    da, db = a.to_dict()["keys"], b.to_dict()["keys"]
    assert da.keys() == db.keys()
    for level, bins in da.items():
        assert bins.keys() == db[level].keys(), level
        for i, count in bins.items():
            assert count == pytest.approx(db[level][i], rel=1e-9), (level, i)


async def test_two_replicas_converge_on_the_state_of_one_router_that_saw_everything(redis_url: str) -> None:
    ns, rng = namespace(), random.Random(3)
    a, b, central = SharedPredictor(), SharedPredictor(), Predictor()
    share_a = PredictorShare.from_url(redis_url, a, namespace=ns)
    share_b = PredictorShare.from_url(redis_url, b, namespace=ns)
    try:
        for _ in range(3):  # rounds: each replica learns its own traffic, then they exchange
            seen_a, seen_b = lengths(rng, 100, 150), lengths(rng, 400, 150)
            for n in seen_a:
                a.observe(KEY, n)
            for n in seen_b:
                b.observe(KEY, n)
            assert a.quantile_tokens(KEY) < b.quantile_tokens(KEY)
            await share_a.sync()
            await share_b.sync()
            for n in seen_a + seen_b:  # the order the shared copy saw them in
                central.observe(KEY, n)
        await share_a.sync()  # a last pull: a now also holds b's newest delta
        for q in (0.1, 0.5, 0.9, 0.99):
            assert a.quantile_tokens(KEY, q) == b.quantile_tokens(KEY, q) == central.quantile_tokens(KEY, q)
        assert_same_state(a, b)
        assert_same_state(a, central)
        assert share_a.syncs == 4 and share_b.syncs == 3
    finally:
        await share_a.close()
        await share_b.close()


async def test_observations_made_during_an_exchange_are_kept(redis_url: str) -> None:
    a, central = SharedPredictor(), Predictor()
    share = PredictorShare.from_url(redis_url, a, namespace=namespace())
    try:
        for n in (50, 60, 70):
            a.observe(KEY, n)
            central.observe(KEY, n)
        sync = asyncio.create_task(share.sync())
        await asyncio.sleep(0)  # the script is on its way; this one arrives meanwhile
        a.observe(KEY, 900)
        central.observe(KEY, 900)
        await sync
        assert_same_state(a, central)
        await share.sync()  # pushed now, exactly once
        assert_same_state(a, central)
    finally:
        await share.close()


async def test_shared_keys_are_capped_and_the_rest_stays_local(redis_url: str) -> None:
    ns, p = namespace(), SharedPredictor()
    share = PredictorShare(
        aioredis.Redis.from_url(redis_url, decode_responses=True), p, namespace=ns, max_keys=3
    )
    try:
        for i in range(20):  # untrusted hints: 20 keys of their own
            p.observe(RequestKey("/v1/chat/completions", "m", 1500, f"hint{i}"), 40 + i)
        shared_keys = await share.sync()
        assert shared_keys == 3  # the cap (the global key is always among them)
        async with aioredis.Redis.from_url(redis_url, decode_responses=True) as r:
            stored = await r.hgetall(share.key)
        assert len(stored) == 3 and GLOBAL_LEVEL in stored
        assert len(p) == 20 + 3  # local keys past the cap are kept: 20 hints, bucket, route+model, global
        assert RequestKey("/v1/chat/completions", "m", 1500, "hint19").levels()[0] in p.to_dict()["keys"]
        other = SharedPredictor()
        await PredictorShare(share._client, other, namespace=ns, max_keys=3).sync()
        assert len(other) == 3  # what another replica pulls: the shared keys only
    finally:
        await share.close()


async def test_an_unreachable_redis_leaves_the_local_predictor_working() -> None:
    p = SharedPredictor()
    share = PredictorShare.from_url("redis://127.0.0.1:1", p, timeout_s=0.2)
    try:
        for n in lengths(random.Random(5), 80, 40):
            p.observe(KEY, n)
        before = p.quantile_tokens(KEY)
        with pytest.raises((RedisError, OSError)):
            await share.sync()
        delta = p.take_delta()  # kept for the next exchange: everything observed so far
        assert delta.weight(KEY) == pytest.approx(p.weight(KEY))
        p.put_back(delta)
        run = asyncio.create_task(share.run(0.02))
        await asyncio.sleep(0.2)
        assert not run.done()  # failures are logged, the loop goes on
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        assert share.failures >= 2 and share.syncs == 0
        assert p.quantile_tokens(KEY) == before
    finally:
        await share.close()


async def test_a_replica_reserves_what_another_replica_learned(redis_url: str) -> None:
    """Two gateways on one Redis (ledger and predictor): traffic through A teaches B, whose first request
    of that kind reserves the learned median instead of the cold prior."""
    page, prompt = 16, len(PROMPT_IDS)
    common = {"reservation_mode": "predicted", "redis_url": redis_url, "ledger_namespace": namespace(),
              "reservation_share_interval_s": 0.05}  # fmt: skip
    with emulator(dp_size=1, kv_tokens_per_rank=32768, time_scale=0.2, page_size=page) as emu:
        backends = [f"sglang={emu.url}"]
        async with (
            router(backends=backends, **common) as url_a,
            router(backends=backends, **common) as url_b,
            httpx.AsyncClient(base_url=url_a, timeout=30) as a,
            httpx.AsyncClient(base_url=url_b, timeout=30) as b,
        ):
            assert await asyncio.gather(*(generate(a, 1280, 16) for _ in range(24))) == [16] * 24
            async with aioredis.Redis.from_url(redis_url, decode_responses=True) as r:
                for _ in range(200):  # until A has pushed all 24 answers (n, first of each entry)
                    entries = await r.hvals(f"kvr:{{{common['ledger_namespace']}}}:pred")
                    if max((int(e.split()[0]) for e in entries), default=0) >= 24:
                        break
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # and B has pulled them (every 0.05 s)
            held: list[int] = []

            async def look(generated: int) -> None:
                if not held:  # the first event: a few tokens at most, far from any growth
                    held.append((await b.get("/ranks")).json()["backends"][0]["ranks"][0]["reserved_tokens"])

            assert await generate(b, 1280, 16, look) == 16
            assert held == [round_up(prompt + bin_upper_tokens(bin_of(16)), page)]
            assert all(r["reserved_tokens"] == 0 for r in await ranks_settled(url_b))
