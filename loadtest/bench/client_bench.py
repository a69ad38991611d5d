"""``python -m loadtest.bench.client_bench``: the data path's upstream client (router/upstream) against
aiohttp configured as the gateway configures it (router/gateway/runtime.py), in one process on uvloop.

Both clients call the same loopback upstream: nginx serving the fixed SGLang chat answer (or, without
nginx, the raw-asyncio stand-in in loadtest/bench/sse_upstream.py) at c=8 and c=64, and the lockstep SSE
stand-in for streams. Rounds alternate the order (A B, then B A) and every figure is the median over the
rounds with the min-max spread. Per variant: requests (or events) per second, and the bench process's CPU
time per request (or per read), which is the client's own cost since the upstream is another process.
Wrap a run in the bench lock: ``flock /tmp/kvbench.lock python -m loadtest.bench.client_bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp
import orjson
from yarl import URL

from router.upstream import UpstreamClient

from .procs import Proc, free_port
from .stats import Spread, load_average
from .upstream import Payloads, capture_payloads, nginx_proc

TIMEOUT_S = 600.0  # the gateway's default request_timeout_s
CHAT = "/v1/chat/completions"
EVENT_MARK = b"data: {"
# The gateway's aiohttp settings before router/upstream (runtime.py), kept here so the comparison
# outlives the swap.
AIOHTTP_SKIPPED_HEADERS = ("User-Agent", "Accept", "Accept-Encoding")


class Variant(Protocol):
    name: str

    async def json(self, url: str, body: bytes, rid: str) -> int: ...

    async def stream(self, url: str, body: bytes, rid: str) -> tuple[int, int]: ...

    async def close(self) -> None: ...


class AiohttpVariant:
    """As runtime.py's Gateway.start and proxy.py's _attempt/_read_start used it."""

    name = "aiohttp"

    def __init__(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=AIOHTTP_SKIPPED_HEADERS,
        )
        self._timeout = aiohttp.ClientTimeout(total=TIMEOUT_S, sock_connect=5.0)
        self._urls: dict[str, URL] = {}

    def _url(self, url: str) -> URL:
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = URL(url)
        return parsed

    async def json(self, url: str, body: bytes, rid: str) -> int:
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        resp = await self._session.post(self._url(url), data=body, headers=headers, timeout=self._timeout)
        try:
            return len(await resp.read())
        finally:
            resp.release()

    async def stream(self, url: str, body: bytes, rid: str) -> tuple[int, int]:
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        resp = await self._session.post(self._url(url), data=body, headers=headers, timeout=self._timeout)
        events = reads = 0
        try:
            while chunk := await resp.content.readany():
                events += chunk.count(EVENT_MARK)
                reads += 1
        finally:
            resp.release()
        return events, reads

    async def close(self) -> None:
        await self._session.close()


class LeanVariant:
    name = "router.upstream"

    def __init__(self) -> None:
        self._client = UpstreamClient(connect_timeout_s=5.0, max_idle_per_origin=256, idle_timeout_s=60.0)

    async def json(self, url: str, body: bytes, rid: str) -> int:
        headers = [(b"content-type", b"application/json"), (b"x-request-id", rid.encode())]
        resp = await self._client.post(url, body, headers, timeout_s=TIMEOUT_S)
        try:
            return len(await resp.read())
        finally:
            resp.release()

    async def stream(self, url: str, body: bytes, rid: str) -> tuple[int, int]:
        headers = [(b"content-type", b"application/json"), (b"x-request-id", rid.encode())]
        resp = await self._client.post(url, body, headers, timeout_s=TIMEOUT_S)
        events = reads = 0
        try:
            while chunk := await resp.read_chunk():
                events += chunk.count(EVENT_MARK)
                reads += 1
        finally:
            resp.release()
        return events, reads

    async def close(self) -> None:
        await self._client.close()


@dataclass
class Sample:
    """One timed window of one variant: completed units (requests or events), socket reads, wall, CPU."""

    units: int
    reads: int
    wall_s: float
    cpu_s: float


@dataclass
class Results:
    samples: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)

    def add(self, case: str, variant: str, sample: Sample) -> None:
        self.samples.setdefault((case, variant), []).append(sample)


async def _window(
    workers: int, duration_s: float, one: Callable[[int], Awaitable[tuple[int, int]]]
) -> Sample:
    """``workers`` loops calling ``one`` until the window closes; in-flight calls finish and count."""
    stop = False
    units = reads = 0

    async def loop(worker: int) -> None:
        nonlocal units, reads
        i = 0
        while not stop:
            u, r = await one(worker * 1_000_000 + i)
            units += u
            reads += r
            i += 1

    gc.collect()
    start_s, cpu0_s = time.perf_counter(), time.process_time()
    tasks = [asyncio.create_task(loop(w)) for w in range(workers)]
    await asyncio.sleep(duration_s)
    stop = True
    await asyncio.gather(*tasks)
    return Sample(units, reads, time.perf_counter() - start_s, time.process_time() - cpu0_s)


async def _paired(
    results: Results, case: str, variants: list[Variant], rounds: int, duration_s: float,
    make: Callable[[Variant], Callable[[int], Awaitable[tuple[int, int]]]], workers: int,
) -> None:  # fmt: skip
    for v in variants:  # warm-up: pools filled, code paths hot
        await _window(workers, min(0.5, duration_s), make(v))
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            sample = await _window(workers, duration_s, make(v))
            results.add(case, v.name, sample)
            rate = sample.units / sample.wall_s
            print(f"  {case:<14} round {r + 1} {v.name:<16} {rate:>10,.0f}/s", flush=True)


async def _bench(json_url: str, sse_url: str, payloads: Payloads, args: argparse.Namespace) -> Results:
    results = Results()
    variants: list[Variant] = [LeanVariant(), AiohttpVariant()]
    body = payloads.chat_request()
    answer_bytes = len(payloads.bodies[CHAT])
    stream_body = payloads.chat_request(stream=True, max_tokens=args.stream_tokens)

    def json_call(v: Variant) -> Callable[[int], Awaitable[tuple[int, int]]]:
        async def one(i: int) -> tuple[int, int]:
            if await v.json(json_url, body, f"r{i}") != answer_bytes:  # both read the whole answer
                raise RuntimeError(f"{v.name}: a short answer from {json_url}")
            return 1, 1

        return one

    def stream_call(v: Variant) -> Callable[[int], Awaitable[tuple[int, int]]]:
        async def one(i: int) -> tuple[int, int]:
            return await v.stream(sse_url, stream_body, f"s{i}")

        return one

    try:
        for c in args.concurrency:
            await _paired(results, f"json c={c}", variants, args.rounds, args.duration_s, json_call, c)
        if args.streams:
            case = f"sse {args.streams} streams"
            await _paired(results, case, variants, args.rounds, args.duration_s, stream_call, args.streams)
    finally:
        for v in variants:
            await v.close()
    return results


def report(results: Results, upstream: str) -> str:
    one, five, _ = load_average()
    lines = [
        f"upstream: {upstream}; uvloop; load average {one:.1f}/{five:.1f}; medians (min-max)",
        "",
        "| case | client | units/s | CPU µs/unit | CPU µs/read | units/read |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (case, variant), samples in results.samples.items():
        rate = Spread.of([s.units / s.wall_s for s in samples])
        per_unit = Spread.of([1e6 * s.cpu_s / max(1, s.units) for s in samples])
        per_read = Spread.of([1e6 * s.cpu_s / max(1, s.reads) for s in samples])
        batch = Spread.of([s.units / max(1, s.reads) for s in samples])
        lines.append(
            f"| {case} | {variant} | {rate.fmt()} | {per_unit.fmt(1)} | {per_read.fmt(1)} | {batch.fmt(2)} |"
        )
    lines += [
        "",
        "units: requests for json, SSE events for sse; a read is one body read call returning data.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (default 3)")
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds per window (default 3)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64], help="default: 8 64")
    parser.add_argument(
        "--streams", type=int, default=100, help="concurrent SSE streams; 0 skips (default 100)"
    )
    parser.add_argument("--stream-tokens", type=int, default=200, help="events per stream (default 200)")
    parser.add_argument("--step-ms", type=float, default=2.0, help="SSE stand-in's step (default 2 ms)")
    parser.add_argument("--no-nginx", action="store_true", help="serve the JSON answer from the stand-in too")
    parser.add_argument("--out", type=Path, help="also write the Markdown table here")
    args = parser.parse_args(argv)

    payloads = capture_payloads()
    log_dir = Path(tempfile.mkdtemp(prefix="kvbench-client-"))
    static = log_dir / "static.json"
    static.write_bytes(orjson.dumps({k: v.decode() for k, v in payloads.bodies.items()}))
    sse_port = free_port()
    sse_base = f"http://127.0.0.1:{sse_port}"
    sse_argv = [sys.executable, "-m", "loadtest.bench.sse_upstream", "--port", str(sse_port),
                "--step-ms", f"{args.step_ms:g}", "--static", str(static)]  # fmt: skip
    nginx = None if args.no_nginx else shutil.which("nginx")
    with Proc("client-bench-sse", sse_argv, ready_url=sse_base + "/v1/models", log_dir=log_dir):
        if nginx is not None:
            proc, json_base = nginx_proc(nginx, payloads, log_dir)
            with proc:
                results = _run(json_base + CHAT, sse_base + CHAT, payloads, args)
            upstream = "nginx (JSON), raw-asyncio SSE stand-in"
        else:
            results = _run(sse_base + CHAT, sse_base + CHAT, payloads, args)
            upstream = "raw-asyncio stand-in (JSON and SSE)"
    table = report(results, upstream)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


def _run(json_url: str, sse_url: str, payloads: Payloads, args: argparse.Namespace) -> Results:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_bench(json_url, sse_url, payloads, args))
    return uvloop.run(_bench(json_url, sse_url, payloads, args))


if __name__ == "__main__":
    main()
