"""``kvrouter serve --workers 2`` without Redis: its workers share one ledger in shared memory.

Real processes end to end: the router (two uvicorn workers) in front of an emulated 4-rank engine whose
capacity the offered load exceeds. What is proved:
* both workers serve, every request succeeds, the engine never runs over capacity nor preempts, and the
  ledger (read from its file while the load runs) never books a rank past its capacity;
* reserved tokens come back to zero in the file and in /ranks, and the file is removed when serve exits;
* a worker killed with SIGKILL mid-load (uvicorn starts another) loses its reservations: they come back
  without waiting for the lease TTL, and the load finishes without errors.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from emulator_fixtures import StartEmulator
from observability_support import per_worker_requests
from test_replicas_support import (
    Replica,
    Tally,
    engine_stats,
    rank_rows,
    replicas,
    serve_args,
    stream_one,
    watch_engine,
)

from loadtest.emulator.host import EmulatorThread
from router.ledger.base import RankUsage
from router.ledger.shm import SharedMemoryLedger

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

DP_SIZE = 4
RANK_TOKENS = 2000
PROMPT_TOKENS = 100
OUTPUT_TOKENS = 300  # 400 tokens a request: 5 fit a rank, 20 the engine
STREAMS = 48
SETTLE_S = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(start_emulator: StartEmulator) -> EmulatorThread:
    # time_scale 0.05: a 300-token answer streams for about half a second, so loads overlap and wait.
    return start_emulator("sglang", dp_size=DP_SIZE, kv_tokens_per_rank=RANK_TOKENS, time_scale=0.05)


def exists(path: str) -> bool:
    return Path(path).exists()


def worker_pids(router: Replica) -> list[int]:
    pid = router.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def settled_zero(session: aiohttp.ClientSession, router: Replica, path: str) -> None:
    """Wait (bounded) until the file and /ranks both say zero reserved and in flight on every rank."""
    ledger = SharedMemoryLedger(path)
    deadline_s = time.monotonic() + SETTLE_S
    try:
        while True:
            usage = await ledger.usage()
            rows = await rank_rows(session, router.url)
            file_zero = len(usage) == DP_SIZE and all(u == RankUsage(RANK_TOKENS) for u in usage.values())
            rows_zero = all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows)
            if file_zero and rows_zero and len(rows) == DP_SIZE:
                return
            assert time.monotonic() < deadline_s, (usage, rows, router.log_tail())
            await ledger.expire()
            await asyncio.sleep(0.1)
    finally:
        await ledger.close()


async def spread_load(session: aiohttp.ClientSession, url: str, n: int, tally: Tally) -> None:
    """``n`` concurrent streams (one connection each: the kernel hands them to either worker)."""
    rng = random.Random(3)

    async def go() -> None:
        await asyncio.sleep(rng.random() * 1.5)
        await stream_one(session, url, tally, PROMPT_TOKENS, OUTPUT_TOKENS - rng.randint(0, 50))

    await asyncio.gather(*(go() for _ in range(n)))


def router_args(engine: EmulatorThread) -> list[str]:
    return serve_args(engine.url, None, "--workers", "2", "--lease-ttl", "30", "--queue-timeout", "30")


async def test_two_workers_share_capacity_without_redis(
    engine: EmulatorThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, metrics_dir = str(tmp_path / "ledger"), tmp_path / "metrics"
    monkeypatch.setenv("KVROUTER_LEDGER_PATH", path)  # where serve creates it (default: /dev/shm)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    with replicas([router_args(engine)], tmp_path) as (router,):
        tally = Tally()
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            reader = SharedMemoryLedger(path)  # a reader with a slot of its own, like a worker
            async with watch_engine(session, engine.url, reader) as watch:
                for waves in range(1, 5):  # the kernel picks the worker: rarely, one takes a whole wave
                    await spread_load(session, router.url, STREAMS, tally)
                    if min(per_worker_requests(metrics_dir, tmp_path / f"wave{waves}")) > 0:
                        break
            stats = await engine_stats(session, engine.url)
            await settled_zero(session, router, path)
        workers = per_worker_requests(metrics_dir, tmp_path)
        print(f"{waves} x {STREAMS} streams, per worker {workers}, ledger peaks {watch.peak_reserved_tokens}")
        assert tally.ok == waves * STREAMS and not tally.errors, (tally, router.log_tail())
        assert watch.samples > 10 and not watch.over_capacity, watch.over_capacity[:5]
        assert stats["preemptions_total"] == 0, stats
        assert len(workers) == 2 and min(workers) > 0 and sum(workers) == waves * STREAMS, workers
        # The load really exceeded capacity: both workers together filled every rank to within one request.
        full_tokens = RANK_TOKENS - PROMPT_TOKENS - OUTPUT_TOKENS
        assert len(watch.peak_reserved_tokens) == DP_SIZE
        assert all(v > full_tokens for v in watch.peak_reserved_tokens.values()), watch.peak_reserved_tokens
        assert exists(path)
    assert not exists(path)  # serve removed its ledger at exit


async def test_a_worker_killed_mid_load_gives_its_reservations_back(
    engine: EmulatorThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "ledger")
    monkeypatch.setenv("KVROUTER_LEDGER_PATH", path)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))
    with replicas([router_args(engine)], tmp_path) as (router,):
        pids = worker_pids(router)
        tally = Tally()
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            reader = SharedMemoryLedger(path)  # a reader with a slot of its own, like a worker
            async with watch_engine(session, engine.url, reader) as watch:
                load = asyncio.create_task(spread_load(session, router.url, STREAMS, tally))
                deadline_s = time.monotonic() + SETTLE_S
                while not (holding := [p for p, t in (await reader.workers()).items() if t and p in pids]):
                    assert time.monotonic() < deadline_s, "no worker ever held a reservation"
                    await asyncio.sleep(0.05)
                victim, held_tokens = holding[0], (await reader.workers())[holding[0]]
                os.kill(victim, signal.SIGKILL)
                await load
            stats = await engine_stats(session, engine.url)
            # The killed worker's reservations come back well within the 30 s lease TTL (it is reaped as
            # soon as its pid is gone), and its replacement serves.
            await settled_zero(session, router, path)
            ok_before = tally.ok
            await spread_load(session, router.url, 8, tally)
        print(f"killed worker {victim} holding {held_tokens} tokens: {tally.ok} ok, {len(tally.errors)} cut")
        assert not watch.over_capacity and stats["preemptions_total"] == 0, (watch.over_capacity[:5], stats)
        assert tally.ok == ok_before + 8
        # Streams on the killed worker were cut (a client-side error); every other request succeeded.
        assert tally.errors and tally.ok + len(tally.errors) == STREAMS + 8, (
            tally.statuses,
            tally.errors[:3],
        )
