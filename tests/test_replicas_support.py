"""Replica test helpers: real ``kvrouter serve`` processes, a streaming load, engine and ledger probes.

No tests here (pytest collects the module and finds none). Every process is started in its own session so a
test can end it and its workers by process group, whatever happened (see :func:`replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from loadtest.bench.redis_proc import free_port
from router.ledger.base import Ledger, LedgerUnavailable
from router.ledger.redis import RedisLedger

KVROUTER = str(Path(sys.executable).with_name("kvrouter"))
MODEL = "deepseek-ai/DeepSeek-V3"
READY_TIMEOUT_S = 25.0
STOP_TIMEOUT_S = 12.0  # above the gateway's graceful shutdown (10 s): a clean exit is tried first


@dataclass
class Replica:
    """One ``kvrouter serve`` process (and, with ``--workers``, its worker children: same process group)."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill9(self) -> None:
        """A crash: SIGKILL, no shutdown hook runs, nothing is released."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=5)

    def terminate(self) -> None:
        """Ask for a clean shutdown (the gateway releases what it still holds)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        """Terminate, wait, and kill the whole group if it does not exit in time."""
        self.terminate()
        if self.proc.poll() is not None:
            return
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


def serve_args(backend_url: str, redis_url: str | None, *extra: str) -> list[str]:
    args = [KVROUTER, "serve", "--backend", f"sglang={backend_url}", "--log-level", "warning"]
    args += ["--reconcile-interval", "0.2"]
    if redis_url is not None:  # a slow reply on a loaded 2-core test box must not look like an outage
        args += ["--redis-url", redis_url, "--ledger-timeout", "1"]
    return args + list(extra)


def spawn(args: list[str], log_dir: Path, name: str) -> Replica:
    port = free_port()
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: workers die with it
        )
    return Replica(proc, f"http://127.0.0.1:{port}", log_path)


def wait_ready(replica: Replica, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    with httpx.Client(timeout=1.0) as http:
        while time.monotonic() < deadline_s:
            if replica.proc.poll() is not None:
                raise RuntimeError(f"kvrouter exited with {replica.proc.returncode}:\n{replica.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(replica.url + "/ready").status_code == 200:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"kvrouter at {replica.url} not ready after {timeout_s} s:\n{replica.log_tail()}")


@contextlib.contextmanager
def replicas(argv: list[list[str]], log_dir: Path) -> Iterator[list[Replica]]:
    """Start one replica per argument list (all at once: they boot in parallel), wait until each is ready,
    and stop every one of them on the way out, also when the test or the startup failed."""
    started: list[Replica] = []
    try:
        for i, args in enumerate(argv):
            started.append(spawn(args, log_dir, f"replica{i}"))
        for replica in started:
            wait_ready(replica)
        yield started
    finally:
        for replica in started:
            replica.terminate()  # all at once: they shut down in parallel
        for replica in started:
            replica.stop()


# --- load -------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    refusals: list[dict[str, Any]] = field(default_factory=list)  # decoded error bodies of non-200 answers

    def reasons(self) -> set[str]:
        """The distinct refusal messages (what to print when a refusal was not expected)."""
        return {str(body.get("error", {}).get("message")) for body in self.refusals}


def completion_body(prompt_tokens: int, output_tokens: int, stream: bool = True) -> bytes:
    """A request whose reservation is exactly ``prompt_tokens + output_tokens`` (token-id prompt, fixed
    output): the engine's usage per request is then known to the token."""
    return orjson.dumps(
        {"model": MODEL, "prompt": [1] * prompt_tokens, "max_tokens": output_tokens, "stream": stream,
         "emulator_output_tokens": output_tokens}
    )  # fmt: skip


async def stream_one(
    session: aiohttp.ClientSession, url: str, tally: Tally, prompt_tokens: int, output_tokens: int
) -> int:
    """One streamed completion; returns its status. A 200 must carry the whole stream, no error event."""
    try:
        body = completion_body(prompt_tokens, output_tokens)
        async with session.post(url + "/v1/completions", data=body) as r:
            data = await r.read()
            status = r.status
    except aiohttp.ClientError as exc:
        tally.errors.append(f"{url}: {type(exc).__name__}: {exc}")
        return 0
    tally.statuses[status] = tally.statuses.get(status, 0) + 1
    if status == 200:
        if b'"error"' in data or not data.rstrip().endswith(b"data: [DONE]"):
            tally.errors.append(f"{url}: broken stream {data[-200:]!r}")
        else:
            tally.ok += 1
    else:
        tally.refusals.append(orjson.loads(data))
    return status


async def keep_loading(
    session: aiohttp.ClientSession,
    url: str,
    tally: Tally,
    stop: asyncio.Event,
    workers: int,
    prompt_tokens: int,
    output_tokens: int,
) -> None:
    """Closed loop: ``workers`` clients each send one stream after another until ``stop`` is set."""

    async def worker(i: int) -> None:
        await asyncio.sleep(0.01 * i)  # do not all arrive in the same millisecond
        while not stop.is_set():
            if await stream_one(session, url, tally, prompt_tokens, output_tokens) != 200:
                await asyncio.sleep(0.05)  # a refusal comes back at once: do not spin

    await asyncio.gather(*(worker(i) for i in range(workers)))


# --- probes -----------------------------------------------------------------------------------------------


@dataclass
class EngineWatch:
    """Samples, while load runs, the engine's per-rank use (SGLang ``/v1/loads``) and what was reserved
    together in the shared ledger (Redis, or a serve's shared memory); records every rank seen over its
    capacity by either."""

    url: str
    ledger: Ledger | None = None
    samples: int = 0
    peak_used_tokens: dict[int, int] = field(default_factory=dict)
    peak_reserved_tokens: dict[int, int] = field(default_factory=dict)
    over_capacity: list[str] = field(default_factory=list)

    async def run(self, session: aiohttp.ClientSession, period_s: float = 0.02) -> None:
        while True:
            async with session.get(self.url + "/v1/loads") as resp:
                body = orjson.loads(await resp.read())
            self.samples += 1
            for load in body["loads"]:
                rank, used, cap = load["dp_rank"], load["num_used_tokens"], load["max_total_num_tokens"]
                self.peak_used_tokens[rank] = max(self.peak_used_tokens.get(rank, 0), used)
                if used > cap:
                    self.over_capacity.append(f"engine rank {rank}: {used} > {cap}")
            if self.ledger is not None:
                with contextlib.suppress(LedgerUnavailable):  # Redis may be down on purpose
                    for key, u in (await self.ledger.usage()).items():
                        peak = self.peak_reserved_tokens.get(key.rank, 0)
                        self.peak_reserved_tokens[key.rank] = max(peak, u.reserved_tokens)
                        if u.reserved_tokens > u.capacity_tokens:
                            self.over_capacity.append(f"ledger {key}: {u.reserved_tokens} tokens reserved")
            await asyncio.sleep(period_s)


@contextlib.asynccontextmanager
async def watch_engine(
    session: aiohttp.ClientSession, engine_url: str, ledger: Ledger | None = None
) -> AsyncIterator[EngineWatch]:
    """:class:`EngineWatch` sampling while the block runs; ``ledger`` (this watch's own reader) is closed."""
    watch = EngineWatch(engine_url, ledger)
    task = asyncio.create_task(watch.run(session))
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if ledger is not None:
            await ledger.close()


@contextlib.asynccontextmanager
async def watching(
    session: aiohttp.ClientSession, engine_url: str, redis_url: str | None = None, namespace: str = "default"
) -> AsyncIterator[EngineWatch]:
    ledger = None if redis_url is None else RedisLedger.from_url(redis_url, namespace=namespace)
    async with watch_engine(session, engine_url, ledger) as watch:
        yield watch


async def engine_stats(session: aiohttp.ClientSession, engine_url: str) -> dict[str, Any]:
    async with session.get(engine_url + "/_emulator/stats") as resp:
        stats: dict[str, Any] = orjson.loads(await resp.read())
        return stats


async def engine_request_ids(session: aiohttp.ClientSession, engine_url: str, prompt_tokens: int) -> set[str]:
    """Router request ids of the requests the engine holds now with this prompt length (the router names an
    SGLang request ``<request id>-<attempt>``)."""
    async with session.get(engine_url + "/_emulator/requests?finished=0") as resp:
        body = orjson.loads(await resp.read())
    return {r["rid"].rsplit("-", 1)[0] for r in body["requests"] if r["prompt_tokens"] == prompt_tokens}


async def rank_rows(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(url + "/ranks") as resp:
        body = orjson.loads(await resp.read())
    return [row for backend in body["backends"] for row in backend["ranks"]]


async def redis_usage(redis_url: str, namespace: str) -> dict[str, tuple[int, int]]:
    """What Redis holds per rank, ``{"rank:backend": (reserved_tokens, inflight)}``, read through a ledger of
    its own on the same namespace (reading also reclaims dead leases, as any replica's read does)."""
    ledger = RedisLedger.from_url(redis_url, namespace=namespace, socket_timeout_s=2.0)
    try:
        usage = await ledger.usage()
    finally:
        await ledger.close()
    return {f"{k.rank}:{k.backend}": (u.reserved_tokens, u.inflight) for k, u in usage.items()}


async def settled(
    session: aiohttp.ClientSession, redis_url: str, namespace: str, urls: list[str], timeout_s: float = 8.0
) -> tuple[dict[str, tuple[int, int]], list[list[dict[str, Any]]]]:
    """Redis usage and every replica's /ranks once all say zero reserved and in flight (or the last seen)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        usage = await redis_usage(redis_url, namespace)
        rows = [await rank_rows(session, url) for url in urls]
        clean = bool(usage) and all(v == (0, 0) for v in usage.values())
        clean = clean and all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for rs in rows for r in rs)
        if clean or time.monotonic() > deadline_s:
            return usage, rows
        await asyncio.sleep(0.1)
