"""What the shared ledgers (shared memory, Redis) cost per request and per call, against the in-process one.

One request, as the gateway does it: ``usage()`` (the snapshot), the default placement policy, ``reserve``
on the policy's candidates, and later ``release`` (a window of requests stays in flight, so the ranks are
not empty). Each store runs several times; medians are reported, with Redis round trips per request.
Then each ledger call alone, in µs (median of runs). A redis-server is started on a free loopback port.

    python -m loadtest.bench.ledger_bench [--requests 2000] [--runs 5] [--concurrency 1,32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from loadtest.bench.redis_proc import RedisServer, redis_server_binary
from router.ledger.base import Ledger, RankUsage
from router.ledger.memory import InMemoryLedger
from router.ledger.redis import RedisLedger
from router.ledger.shm import SharedMemoryLedger
from router.ledger.shm_file import create_ledger_file, remove_ledger_file
from router.placement import DEFAULT_POLICY, get_policy
from router.placement.policies import Policy
from router.placement.snapshot import RankKey, RankView, RequestShape, Snapshot

RANK_CAPACITY_TOKENS = 510_276  # DeepSeek-V3, 8×H200, DP-attention + EP8 (the seed's figure)
IN_FLIGHT_PER_WORKER = 16


@dataclass(frozen=True)
class Result:
    store: str
    concurrency: int
    median_us: float  # one request's placement + reserve + release, median over requests and runs
    requests_per_s: float  # median over runs of requests / wall time (all workers)
    round_trips_per_request: float


def snapshot(keys: Sequence[RankKey], usage: dict[RankKey, RankUsage], tick: int) -> Snapshot:
    views = []
    for key in keys:
        u = usage[key]
        views.append(RankView(key, u.capacity_tokens, reserved_tokens=u.reserved_tokens, inflight=u.inflight))
    return Snapshot(tuple(views), tick=tick)


async def worker(
    ledger: Ledger, policy: Policy, keys: Sequence[RankKey], wid: int, requests: int, latencies_s: list[float]
) -> None:
    held: deque[str] = deque()
    for n in range(requests):
        started = time.perf_counter()
        shape = RequestShape(prompt_tokens=1000 + (n * 7919) % 3000, output_tokens=500, entropy=n)
        chosen = policy(snapshot(keys, await ledger.usage(), n), shape)
        rid = f"b{wid}-{n}"
        if await ledger.reserve(rid, [keys[i] for i in chosen], shape.reserve_tokens(1)) is not None:
            held.append(rid)
        if len(held) > IN_FLIGHT_PER_WORKER:
            await ledger.release(held.popleft())
        latencies_s.append(time.perf_counter() - started)
    while held:
        await ledger.release(held.popleft())


async def one_run(
    ledger: Ledger, ranks: int, requests: int, concurrency: int, latencies_s: list[float]
) -> float:
    """Requests per second for ``requests`` placements + reserves + releases over ``concurrency`` workers."""
    keys = [RankKey("dsv3", r) for r in range(ranks)]
    await ledger.register(dict.fromkeys(keys, RANK_CAPACITY_TOKENS))
    policy = get_policy(DEFAULT_POLICY)
    per_worker = requests // concurrency
    started = time.perf_counter()
    await asyncio.gather(
        *(worker(ledger, policy, keys, w, per_worker, latencies_s) for w in range(concurrency))
    )
    elapsed_s = time.perf_counter() - started
    usage = await ledger.usage()
    assert all(u.reserved_tokens == 0 for u in usage.values()), "bench leaked reservations"
    return per_worker * concurrency / elapsed_s


def make_ledger(store: str, url: str | None, namespace: str, files: list[str]) -> Ledger:
    if store == "memory":
        return InMemoryLedger()
    if store == "shm":
        files.append(create_ledger_file())
        return SharedMemoryLedger(files[-1])
    assert url is not None
    return RedisLedger.from_url(url, namespace=namespace, socket_timeout_s=2.0)


async def measure(store: str, url: str | None, args: argparse.Namespace, concurrency: int) -> Result:
    latencies_s: list[float] = []
    rates: list[float] = []
    trips: list[float] = []
    files: list[str] = []
    for run in range(args.runs):
        ledger = make_ledger(store, url, f"bench{run}c{concurrency}", files)
        try:
            await one_run(ledger, args.ranks, 100, concurrency, [])  # warm-up: connections, scripts
            before = ledger.round_trips if isinstance(ledger, RedisLedger) else 0
            rates.append(await one_run(ledger, args.ranks, args.requests, concurrency, latencies_s))
            if isinstance(ledger, RedisLedger):
                trips.append((ledger.round_trips - before) / (args.requests // concurrency * concurrency))
        finally:
            await ledger.close()
            for path in files:
                remove_ledger_file(path)
    return Result(
        store,
        concurrency,
        statistics.median(latencies_s) * 1e6,
        statistics.median(rates),
        statistics.median(trips) if trips else 0.0,
    )


def report(results: list[Result]) -> str:
    lines = [
        "| store | concurrency | µs per request (median) | requests/s (median run) | Redis trips / request |"
    ]
    lines.append("|---|---|---|---|---|")
    for r in results:
        lines.append(
            f"| {r.store} | {r.concurrency} | {r.median_us:.0f} | {r.requests_per_s:,.0f} |"
            f" {r.round_trips_per_request:.2f} |"
        )
    for c in sorted({r.concurrency for r in results}):
        mem = next(r for r in results if r.store == "memory" and r.concurrency == c)
        for other in (r for r in results if r.store != "memory" and r.concurrency == c):
            # Above one worker, a request's time includes waiting for the others on the one event loop.
            latency = (
                f"{other.median_us / mem.median_us:.1f}× the median time per request, " if c == 1 else ""
            )
            lines.append(
                f"\nconcurrency {c}: {other.store} vs in-process: {latency}"
                f"{mem.requests_per_s / other.requests_per_s:.1f}× fewer requests/s"
            )
    return "\n".join(lines)


OPS = ("reserve", "add_generated", "grow", "shrink", "release", "usage", "renew")


async def per_call_us(ledger: Ledger, ranks: int, calls: int) -> dict[str, float]:
    """µs per call of each operation, one after another on one ledger (``calls`` requests, 8 ranks)."""
    keys = [RankKey("dsv3", r) for r in range(ranks)]
    await ledger.register(dict.fromkeys(keys, RANK_CAPACITY_TOKENS))
    rids = [f"op{i}" for i in range(calls)]
    steps: dict[str, Callable[[int], Awaitable[object]]] = {
        "reserve": lambda i: ledger.reserve(rids[i], [keys[i % ranks], keys[(i + 1) % ranks]], 100),
        "add_generated": lambda i: ledger.add_generated(rids[i], 3),
        "grow": lambda i: ledger.grow(rids[i], 16),
        "shrink": lambda i: ledger.shrink(rids[i], 8),
        "release": lambda i: ledger.release(rids[i]),
        "usage": lambda i: ledger.usage(),
        "renew": lambda i: ledger.renew(rids[i : i + 1]),
    }
    out: dict[str, float] = {}
    for op in OPS:
        started = time.perf_counter()
        for i in range(calls):
            await steps[op](i)
        out[op] = (time.perf_counter() - started) / calls * 1e6
    return out


async def per_call_table(url: str, args: argparse.Namespace) -> str:
    runs: dict[str, list[dict[str, float]]] = {}
    files: list[str] = []
    try:
        for run in range(args.runs):
            for store in ("memory", "shm", "redis"):
                ledger = make_ledger(store, url, f"ops{run}", files)
                try:
                    await per_call_us(ledger, args.ranks, 100)  # warm-up
                    runs.setdefault(store, []).append(await per_call_us(ledger, args.ranks, args.requests))
                finally:
                    await ledger.close()
    finally:
        for path in files:
            remove_ledger_file(path)
    lines = [f"\nµs per call, one caller, {args.ranks} ranks (median of {args.runs} runs):\n"]
    lines += ["| store | " + " | ".join(OPS) + " |", "|---|" + "---:|" * len(OPS)]
    for store, samples in runs.items():
        cells = [f"{statistics.median(s[op] for s in samples):.1f}" for op in OPS]
        lines.append(f"| {store} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def ping_us(url: str, pings: int = 1000) -> float:
    """Median bare round trip (PING) on this machine now: the floor under every Redis ledger call."""
    client = aioredis.Redis.from_url(url)
    try:
        samples = []
        for _ in range(pings):
            started = time.perf_counter()
            await client.ping()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1e6
    finally:
        await client.aclose()


async def main_async(args: argparse.Namespace) -> str:
    levels = [int(c) for c in args.concurrency.split(",")]
    results = [await measure("memory", None, args, c) for c in levels]
    results += [await measure("shm", None, args, c) for c in levels]
    with RedisServer() as server:
        results += [await measure("redis", server.url, args, c) for c in levels]
        rtt_us = await ping_us(server.url)
        ops = await per_call_table(server.url, args)
    return f"{report(results)}\n\nRedis PING round trip (median, same client library): {rtt_us:.0f} µs\n{ops}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--concurrency", default="1,32", help="comma-separated worker counts")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.runs < 1 or args.ranks < 1:
        parser.error("--requests, --runs and --ranks must be >= 1")
    if redis_server_binary() is None:
        print("redis-server not found on PATH: install it to run this benchmark", file=sys.stderr)
        return 2
    try:
        print(asyncio.run(main_async(args)))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
