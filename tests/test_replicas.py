"""Several router replicas, one truth: real ``kvrouter serve`` processes sharing one Redis ledger in front of
one emulated engine whose capacity the offered load exceeds.

What is proved end to end (the ledger-level behaviour is in tests/test_ledger_redis.py):
* two replicas never over-commit the engine together (zero preemptions, no rank over capacity) and leave
  every rank at zero reserved, in Redis and in both replicas' /ranks;
* a replica killed with SIGKILL mid-load loses its reservations within the lease TTL, and the other one
  keeps serving;
* ``--workers 2`` with Redis serves, and every worker's /ranks reads the same truth; given two ledgers
  (Redis and a shared-memory file) it refuses to start. Without Redis, tests/test_workers_shm.py.
Redis outages are in tests/test_replicas_redis.py; the helpers in tests/test_replicas_support.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from emulator_fixtures import StartEmulator
from test_replicas_support import (
    KVROUTER,
    MODEL,
    EngineWatch,
    Replica,
    Tally,
    completion_body,
    engine_request_ids,
    engine_stats,
    keep_loading,
    rank_rows,
    replicas,
    serve_args,
    settled,
    stream_one,
    watching,
)

from loadtest.bench.redis_proc import RedisServer, redis_server_binary
from loadtest.emulator.host import EmulatorThread
from router.config import ConfigError, load_settings
from router.ledger.redis import RedisLedger

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.timeout(60)]

DP_SIZE = 4
RANK_TOKENS = 2000
PROMPT_TOKENS = 100
OUTPUT_TOKENS = 300  # 400 tokens a request: 5 fit a rank, 20 the engine
LEASE_TTL_S = 2.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own (some tests kill or restart it)."""
    if redis_server_binary() is None:
        pytest.skip("SKIPPED LOUDLY: no redis-server binary on PATH; install it to run the replica tests")
    with RedisServer() as server:
        yield server


@pytest.fixture
def engine(start_emulator: StartEmulator) -> EmulatorThread:
    # time_scale 0.05: a 300-token answer streams for about half a second, so loads overlap and wait.
    return start_emulator("sglang", dp_size=DP_SIZE, kv_tokens_per_rank=RANK_TOKENS, time_scale=0.05)


def args_for(engine: EmulatorThread, redis: RedisServer, namespace: str, *extra: str) -> list[str]:
    return serve_args(engine.url, redis.url, "--lease-ttl", str(LEASE_TTL_S), "--queue-timeout", "30",
                      "--replicas", "2", "--ledger-namespace", namespace, *extra)  # fmt: skip


async def spread_load(
    session: aiohttp.ClientSession, urls: list[str], n: int, tally: Tally, rng: random.Random
) -> None:
    """``n`` concurrent streams, alternating replicas, output lengths jittered so they end apart."""

    async def go(i: int) -> None:
        await asyncio.sleep(rng.random() * 0.2)
        await stream_one(
            session, urls[i % len(urls)], tally, PROMPT_TOKENS, OUTPUT_TOKENS - rng.randint(0, 50)
        )

    await asyncio.gather(*(go(i) for i in range(n)))


def assert_engine_clean(watch: EngineWatch, stats: dict[str, object]) -> None:
    assert watch.samples > 10, watch
    assert not watch.over_capacity, watch.over_capacity[:5]
    assert stats["preemptions_total"] == 0, stats


async def test_two_replicas_share_the_engine_without_over_commit(
    redis: RedisServer, engine: EmulatorThread, tmp_path: Path
) -> None:
    ns = "two-replicas"
    with replicas([args_for(engine, redis, ns)] * 2, tmp_path) as (a, b):
        urls = [a.url, b.url]
        tally = Tally()
        async with aiohttp.ClientSession() as session:
            async with watching(session, engine.url, redis.url, ns) as watch:
                t0 = time.monotonic()
                await spread_load(session, urls, 48, tally, random.Random(1))
                elapsed_s = time.monotonic() - t0
            stats = await engine_stats(session, engine.url)
            usage, rows = await settled(session, redis.url, ns, urls)
        print(
            f"48 streams via 2 replicas in {elapsed_s:.1f} s, {watch.samples} samples; engine peaks "
            f"{watch.peak_used_tokens}, reserved peaks {watch.peak_reserved_tokens}"
        )
        assert tally.ok == 48 and not tally.errors, tally
        assert_engine_clean(watch, stats)
        assert sum(stats["requests_per_rank"]) == 48, stats  # type: ignore[arg-type]
        # The load really exceeded capacity: both replicas together filled every rank's reservations to
        # within one request of its capacity (19,200 tokens offered at once against 8,000).
        full_tokens = RANK_TOKENS - PROMPT_TOKENS - OUTPUT_TOKENS
        assert all(v > full_tokens for v in watch.peak_reserved_tokens.values()), watch.peak_reserved_tokens
        assert len(watch.peak_reserved_tokens) == DP_SIZE
        assert len(usage) == DP_SIZE and all(v == (0, 0) for v in usage.values()), usage
        for replica_rows in rows:
            assert len(replica_rows) == DP_SIZE
            assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in replica_rows), rows


async def test_a_replica_killed_mid_load_loses_its_reservations_within_the_ttl(
    redis: RedisServer, engine: EmulatorThread, tmp_path: Path
) -> None:
    ns = "kill-9"
    a_prompt_tokens = PROMPT_TOKENS + 1  # tells A's requests apart on the engine
    with replicas([args_for(engine, redis, ns)] * 2, tmp_path) as (a, b):
        a_tally, b_tally = Tally(), Tally()
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        ledger = RedisLedger.from_url(redis.url, namespace=ns, socket_timeout_s=2.0)
        async with aiohttp.ClientSession() as session, watching(session, engine.url, redis.url, ns) as watch:
            try:
                # 12 + 12 concurrent streams of ~400 tokens against 20 that fit: both replicas keep a queue.
                load_a = asyncio.create_task(
                    keep_loading(session, a.url, a_tally, stop_a, 12, a_prompt_tokens, OUTPUT_TOKENS)
                )
                load_b = asyncio.create_task(
                    keep_loading(session, b.url, b_tally, stop_b, 12, PROMPT_TOKENS, OUTPUT_TOKENS)
                )
                await asyncio.sleep(1.5)
                held = await engine_request_ids(session, engine.url, a_prompt_tokens)
                a.kill9()
                killed_at_s = time.monotonic()
                stop_a.set()
                b_ok_at_kill = b_tally.ok
                # Right after the kill A's reservations are still in Redis: nobody released them...
                present = [rid for rid in held if await ledger.get(rid) is not None]
                assert present, (held, a_tally)
                # ... and they are gone once their lease runs out (no renewal from a dead process).
                while any([await ledger.get(rid) is not None for rid in present]):
                    assert time.monotonic() - killed_at_s < LEASE_TTL_S + 1.0, "lease not reclaimed"
                    await asyncio.sleep(0.02)
                reclaim_s = time.monotonic() - killed_at_s
                b_ok_at_reclaim = b_tally.ok
                await asyncio.sleep(1.0)  # B keeps serving after the reclaim too
                stop_b.set()
                await asyncio.gather(load_a, load_b)
            finally:
                stop_a.set()
                stop_b.set()
                await ledger.close()
            stats = await engine_stats(session, engine.url)
            usage, rows = await settled(session, redis.url, ns, [b.url])
        after = b_tally.ok - b_ok_at_kill
        print(f"kill -9 with {len(present)} reservations held: reclaimed {reclaim_s:.2f} s later "
              f"(TTL {LEASE_TTL_S} s); B served {b_ok_at_kill} before, {after} after")  # fmt: skip
        assert reclaim_s <= LEASE_TTL_S + 0.3
        refused = (b_tally.statuses, b_tally.reasons(), b.log_tail())
        assert not b_tally.errors and set(b_tally.statuses) == {200}, refused
        assert b_ok_at_reclaim > b_ok_at_kill and b_tally.ok > b_ok_at_reclaim, b_tally
        assert_engine_clean(watch, stats)
        assert all(v == (0, 0) for v in usage.values()), usage
        assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows[0]), rows


def worker_pids(replica: Replica) -> list[int]:
    pid = replica.proc.pid
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def test_workers_share_one_ledger_through_redis(
    redis: RedisServer, start_emulator: StartEmulator, tmp_path: Path
) -> None:
    # Four long streams of 1,600 tokens against four 2,000-token ranks: exactly one fits each rank.
    emu = start_emulator("sglang", dp_size=DP_SIZE, kv_tokens_per_rank=RANK_TOKENS, time_scale=0.2)
    args = serve_args(emu.url, redis.url, "--workers", "2", "--ledger-namespace", "workers")
    with replicas([args], tmp_path) as (router,):
        assert len(worker_pids(router)) >= 2, router.log_tail()  # two workers (and a resource tracker)
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        async with aiohttp.ClientSession() as session:
            try:
                chat = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8
                )
                assert chat.choices[0].message.content and chat.usage is not None
                streams = [
                    await session.post(router.url + "/v1/completions", data=completion_body(100, 1500))
                    for _ in range(DP_SIZE)
                ]
                for resp in streams:
                    assert resp.status == 200 and await resp.content.readany()  # placed and streaming
                # Whichever worker answers (a new connection each time), it reads the same Redis truth.
                for _ in range(8):
                    async with aiohttp.ClientSession() as fresh:
                        rows = await rank_rows(fresh, router.url)
                    assert sorted(r["inflight"] for r in rows) == [1] * DP_SIZE, rows
                    assert {r["reserved_tokens"] for r in rows} == {1600}, rows
                    assert {r["capacity_tokens"] for r in rows} == {RANK_TOKENS}, rows
                for resp in streams:
                    resp.close()  # the client leaves: the worker that placed it releases it
            finally:
                await client.close()
            usage, (rows,) = await settled(session, redis.url, "workers", [router.url])
        assert len(usage) == DP_SIZE and all(v == (0, 0) for v in usage.values()), usage
        assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows), rows


def test_workers_with_two_ledgers_refuse_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["KVROUTER_LEDGER_PATH"] = "/dev/shm/kvrouter-test-never-created"
    args = [KVROUTER, "serve", "--workers", "2", "--backend", "sglang=http://127.0.0.1:9",
            "--redis-url", "redis://127.0.0.1:9/0"]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvrouter: error:") and "redis" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"ledger_namespace": "a b"}, "ledger_namespace: ledger namespace must be"),
        ({"ledger_namespace": "{x}"}, "ledger_namespace: ledger namespace must be"),
        ({"replicas": 0}, "replicas:"),
        (
            {"workers": 2, "redis_url": "redis://r", "ledger_path": "/x"},
            "settings: ledger_path and redis_url",
        ),
    ],
)
def test_replica_settings_refuse_bad_values_in_one_line(flags: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(backends=["sglang=http://127.0.0.1:9"], **flags)
    assert str(info.value).startswith(needle) and "\n" not in str(info.value), str(info.value)
