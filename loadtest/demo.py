"""``make demo``: kvrouter in front of an emulated 8-rank DeepSeek-V3 SGLang deployment, on this machine.

No GPU and no Redis: the emulator (``kvrouter-loadtest emulate``) and the router (``kvrouter serve``) run as
child processes on free loopback ports (the router is a separate process, as in production; ``loadtest``
never imports the gateway). A short burst of mixed streaming requests goes through the router while the
per-rank table is sampled; the busiest moment is printed, then the demo keeps serving until Ctrl-C
(``--burst-only`` or ``--exit-after S`` end it on their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Annotated, Any

import aiohttp
import orjson
import typer
from rich.console import Console
from rich.table import Table

MODEL = "deepseek-ai/DeepSeek-V3"


def make_console() -> Console:
    """The terminal's width, or 110 columns when piped (so the table keeps its bars)."""
    return Console(width=None if sys.stdout.isatty() else 110)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def child(args: list[str], name: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


async def wait_ready(session: aiohttp.ClientSession, url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline_s = time.monotonic() + 30
    while time.monotonic() < deadline_s:
        for p in procs:
            if p.poll() is not None:
                err = p.stderr.read().decode(errors="replace") if p.stderr else ""
                raise RuntimeError(f"a demo process exited early:\n{err[-2000:]}")
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError("the router did not become ready within 30 s")


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random) -> int:
    prompt_words = rng.randint(300, 3000)
    output_tokens = rng.randint(100, 500)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "word " * prompt_words}],
        "max_tokens": output_tokens,
        "stream": True,
        "emulator_output_tokens": output_tokens,
    }
    async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        await resp.read()
        return resp.status


async def sample_peak(session: aiohttp.ClientSession, url: str, done: asyncio.Event) -> dict[str, Any]:
    peak: dict[str, Any] = {}
    peak_reserved = -1
    while not done.is_set():
        async with session.get(url + "/ranks") as resp:
            body = await resp.json()
        reserved = sum(r["reserved_tokens"] for b in body["backends"] for r in b["ranks"])
        if reserved > peak_reserved:
            peak, peak_reserved = body, reserved
        await asyncio.sleep(0.05)
    return peak


def rank_table(ranks_body: dict[str, Any], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "backend",
        "rank",
        "capacity",
        "reserved",
        "occupancy",
        "in flight",
        "engine used",
        "healthy",
    ):
        table.add_column(col, justify="right" if col not in ("backend", "healthy") else "left")
    for backend in ranks_body.get("backends", []):
        for r in backend["ranks"]:
            share = r["reserved_tokens"] / r["capacity_tokens"] if r["capacity_tokens"] else 0.0
            bar = "█" * round(share * 10)
            used = r["engine_used_tokens"]
            table.add_row(
                backend["name"], str(r["rank"]), f"{r['capacity_tokens']:,}", f"{r['reserved_tokens']:,}",
                f"{bar:<10} {share:6.1%}", str(r["inflight"]), "-" if used is None else f"{used:,}",
                "yes" if r["healthy"] else "NO",
            )  # fmt: skip
    return table


async def burst(console: Console, url: str, requests: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        done = asyncio.Event()
        sampler = asyncio.create_task(sample_peak(session, url, done))
        sem = asyncio.Semaphore(concurrency)

        async def bounded() -> int:
            async with sem:
                return await one_request(session, url, rng)

        t0 = time.perf_counter()
        statuses = await asyncio.gather(*(bounded() for _ in range(requests)))
        elapsed_s = time.perf_counter() - t0
        done.set()
        peak = await sampler
        async with session.get(url + "/ranks") as resp:
            after = await resp.json()
    ok = sum(1 for s in statuses if s == 200)
    console.print(rank_table(peak, "Per-rank KV occupancy at the busiest moment of the burst"))
    console.print(rank_table(after, "After the burst (every reservation released)"))
    console.print(f"{ok}/{requests} requests OK in {elapsed_s:.1f} s through the router.")


async def demo(
    console: Console, requests: int, concurrency: int, seed: int, burst_only: bool, exit_after_s: float | None
) -> None:
    emu_port, router_port = free_port(), free_port()
    emu_url, url = f"http://127.0.0.1:{emu_port}", f"http://127.0.0.1:{router_port}"
    emulate = ["loadtest.cli", "emulate", "--engine", "sglang", "--dp", "8", "--port", str(emu_port),
               "--kv-tokens-per-rank", "40000", "--page-size", "64", "--time-scale", "0.05",
               "--log-level", "warning"]  # fmt: skip
    serve = ["router.cli", "serve", "--backend", f"sglang={emu_url}", "--port", str(router_port),
             "--reconcile-interval", "0.25", "--log-level", "warning"]  # fmt: skip
    with child(emulate, "emulator") as emu, child(serve, "router") as rtr:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url, [emu, rtr])
        console.print(f"Emulated SGLang, DeepSeek-V3, 8 DP ranks: {emu_url}")
        console.print(f"kvrouter (policy lockstep):                {url}")
        await burst(console, url, requests, concurrency, seed)
        if burst_only:
            return
        console.print(
            f"\nServing until Ctrl-C. Try:\n  curl -s {url}/ranks\n  curl -s {url}/v1/chat/completions "
            f'-H \'content-type: application/json\' -d \'{{"model": "{MODEL}", "messages": '
            f'[{{"role": "user", "content": "hi"}}], "max_tokens": 16}}\''
        )
        deadline_s = time.monotonic() + exit_after_s if exit_after_s is not None else None
        while deadline_s is None or time.monotonic() < deadline_s:
            if emu.poll() is not None or rtr.poll() is not None:
                raise RuntimeError("a demo process exited")
            await asyncio.sleep(0.2)


def main(
    requests: Annotated[int, typer.Option(help="Requests in the burst.")] = 96,
    concurrency: Annotated[int, typer.Option(help="Concurrent requests in the burst.")] = 48,
    seed: Annotated[int, typer.Option(help="Seed of the request sizes.")] = 7,
    burst_only: Annotated[bool, typer.Option("--burst-only", help="Exit after the burst.")] = False,
    exit_after: Annotated[
        float | None, typer.Option(help="Keep serving this many seconds, then exit.")
    ] = None,
) -> None:
    """Router + emulated 8-rank DeepSeek-V3 deployment on localhost: a burst, the rank table, then serve."""
    console = make_console()
    if requests < 1 or concurrency < 1:
        console.print("[red]error:[/red] --requests and --concurrency must be >= 1")
        raise typer.Exit(2)
    try:
        asyncio.run(demo(console, requests, concurrency, seed, burst_only, exit_after))
    except KeyboardInterrupt:
        console.print("\nstopped.")
    except RuntimeError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


if __name__ == "__main__":
    typer.run(main)
