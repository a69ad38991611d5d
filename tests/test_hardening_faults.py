"""Faults against the emulator: ranks dying mid-stream, backends refusing connections, slow ranks, clients
vanishing, overload. Each ends with the ledger at zero and the engine holding nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from gateway_support import MODEL, emulator
from test_hardening_support import assert_error, engine_idle, free_port, ledger_zero, rank_rows, serve_router

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def chat(tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "emulator_output_tokens": tokens, "stream": stream}  # fmt: skip


async def wait_for(probe: Any, timeout_s: float = 5.0, every_s: float = 0.02) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not await probe():
        assert time.monotonic() < deadline_s, "condition not met in time"
        await asyncio.sleep(every_s)


async def test_ranks_dying_mid_stream_are_tripped_skipped_and_recover_without_restart() -> None:
    with emulator(dp_size=2) as emu:
        opts = {"backends": [f"sglang={emu.url}"], "policy": "round_robin", "probe_interval_s": 0.2}
        async with serve_router(**opts) as url, httpx.AsyncClient(timeout=10) as http:
            cut = {"abort_after_tokens": 3, "abort_mode": "drop"}
            await http.post(emu.url + "/_emulator/faults", json=cut)
            for _ in range(6):  # round robin: three deaths on each rank
                resp = await http.post(url + CHAT, json=chat(40))
                assert resp.status_code == 200
                events = [e for e in resp.text.split("\n\n") if e.strip()]
                assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-2:]
            await ledger_zero(http, url)
            await engine_idle(http, emu.url)
            # Both ranks' breakers are open: nothing is usable, the router says so and refuses at once.
            assert not any(r["healthy"] for r in await rank_rows(http, url))
            ready = await http.get(url + "/ready")
            assert ready.status_code == 503 and ready.json()["ready"] is False
            before = len((await http.get(emu.url + "/_emulator/requests?finished=1000")).json()["finished"])
            resp = await http.post(url + CHAT, json=chat(4, stream=False))
            assert_error(resp, 503, "no_healthy_rank")
            # The engine heals: the probes close the breakers, traffic flows again, no restart.
            await http.post(emu.url + "/_emulator/faults", json={"abort_after_tokens": None})

            async def healthy() -> bool:
                return all(r["healthy"] for r in await rank_rows(http, url))

            await wait_for(healthy)
            assert (await http.get(url + "/ready")).status_code == 200
            for _ in range(4):
                assert (await http.post(url + CHAT, json=chat(4, stream=False))).status_code == 200
            finished = (await http.get(emu.url + "/_emulator/requests?finished=1000")).json()["finished"]
            assert {r["rank"] for r in finished[before:] if r["rid"].endswith("-0")} == {0, 1}
            await ledger_zero(http, url)


async def test_a_down_rank_is_skipped_once_detected_and_used_again_when_back() -> None:
    with emulator(dp_size=2) as emu:
        opts = {"backends": [f"sglang={emu.url}"], "policy": "round_robin", "probe_interval_s": 0.2}
        async with serve_router(**opts) as url, httpx.AsyncClient(timeout=10) as http:
            await http.post(emu.url + "/_emulator/faults", json={"down_ranks": [1]})
            for _ in range(6):  # "DP rank 1 is not active." before the first byte: retried on rank 0
                resp = await http.post(url + COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                assert resp.status_code == 200 and resp.headers["x-kvrouter-rank"].endswith("@0"), resp.text

            async def rank1_out() -> bool:
                return not (await rank_rows(http, url))[1]["healthy"]

            await wait_for(rank1_out)
            metrics = (await http.get(url + "/metrics")).text
            retries = _counter(metrics, "kvrouter_upstream_retries_total")
            for _ in range(6):  # skipped now: no attempt on rank 1, so no retry either
                resp = await http.post(url + COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                assert resp.status_code == 200
            assert (
                _counter((await http.get(url + "/metrics")).text, "kvrouter_upstream_retries_total")
                == retries
            )
            await http.post(emu.url + "/_emulator/faults", json={"down_ranks": []})

            async def rank1_back() -> bool:
                return bool((await rank_rows(http, url))[1]["healthy"])

            await wait_for(rank1_back)
            ranks = set()
            for _ in range(4):
                resp = await http.post(url + COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                ranks.add(resp.headers["x-kvrouter-rank"])
            assert len(ranks) == 2
            await ledger_zero(http, url)


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


async def test_a_backend_refusing_connections_is_retried_on_another_and_rediscovered() -> None:
    port = free_port()
    with emulator(dp_size=2) as healthy:
        a = emulator(dp_size=2, port=port)
        emu_a = a.__enter__()
        try:
            backends = [f"sglang=http://127.0.0.1:{port}", f"sglang={healthy.url}"]
            opts = {"backends": backends, "policy": "round_robin", "probe_interval_s": 0.2}
            async with serve_router(**opts) as url, httpx.AsyncClient(timeout=10) as http:
                a.__exit__(None, None, None)  # backend A goes away: connections refused
                for _ in range(8):
                    resp = await http.post(url + COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                    assert resp.status_code == 200, resp.text
                    assert resp.headers["x-kvrouter-rank"].startswith("sglang-1@")
                await ledger_zero(http, url)

                async def a_out() -> bool:
                    return not any(r["healthy"] for r in (await rank_rows(http, url))[:2])

                await wait_for(a_out)
                with emulator(dp_size=2, port=port) as back:  # A restarts on the same address

                    async def a_back() -> bool:
                        return all(r["healthy"] for r in await rank_rows(http, url))

                    await wait_for(a_back)
                    seen = set()
                    for _ in range(8):
                        resp = await http.post(
                            url + COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 2}
                        )
                        seen.add(resp.headers["x-kvrouter-rank"].split("@")[0])
                    assert seen == {"sglang-0", "sglang-1"}
                    await ledger_zero(http, url)
                    await engine_idle(http, back.url)
        finally:
            del emu_a


async def test_a_slow_backend_times_out_while_the_other_keeps_serving() -> None:
    with (
        emulator(dp_size=1, time_scale=1.0, faults=_slow()) as slow,
        emulator(dp_size=1) as fast,
    ):
        backends = [f"sglang={slow.url}", f"sglang={fast.url}"]
        opts = {"backends": backends, "policy": "round_robin", "request_timeout_s": 0.6}
        async with serve_router(**opts) as url, httpx.AsyncClient(timeout=10) as http:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "emulator_output_tokens": 4}
            started = time.monotonic()
            stuck = [asyncio.create_task(http.post(url + COMP, json=body)) for _ in range(4)]
            # While the slow rank holds its requests, /health and the fast backend answer at once.
            lags = []
            for _ in range(10):
                t0 = time.monotonic()
                assert (await http.get(url + "/health")).status_code == 200
                lags.append(time.monotonic() - t0)
            answers = await asyncio.gather(*stuck)
            elapsed_s = time.monotonic() - started
            codes = sorted(r.status_code for r in answers)
            assert codes == [200, 200, 504, 504], [r.text for r in answers]
            assert all(
                r.json()["error"]["code"] == "upstream_timeout" for r in answers if r.status_code == 504
            )
            assert elapsed_s < 3.0 and max(lags) < 0.25, (elapsed_s, lags)
            await ledger_zero(http, url)


def _slow() -> Any:
    from loadtest.emulator.faults import Faults

    return Faults(slow_ranks={0: 1000.0})  # each lockstep step takes ~1000x its calibrated time


async def test_clients_vanishing_while_queued_or_waiting_release_everything() -> None:
    # One 1,000-token rank in real time: a 900-token stream holds it while the others wait or vanish.
    with emulator(dp_size=1, kv_tokens_per_rank=1000, time_scale=1.0) as emu:
        async with serve_router(backends=[f"sglang={emu.url}"], queue_timeout_s=10) as url:
            async with aiohttp.ClientSession() as session:
                hold = {"model": MODEL, "prompt": "x", "max_tokens": 900, "stream": True,
                        "emulator_output_tokens": 900}  # fmt: skip
                async with session.post(url + COMP, data=orjson.dumps(hold)) as stream:
                    await stream.content.readany()
                    queued = [
                        asyncio.create_task(session.post(url + COMP, data=orjson.dumps(
                            {"model": MODEL, "prompt": "x", "max_tokens": 300})))
                        for _ in range(3)
                    ]  # fmt: skip

                    async def depth(n: int) -> bool:
                        text = await (await session.get(url + "/metrics")).text()
                        return f"kvrouter_queue_depth {n}" in text or f"kvrouter_queue_depth {n}.0" in text

                    await wait_for(lambda: depth(3))
                    for task in queued:  # the clients give up while waiting in line
                        task.cancel()
                    for task in queued:
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                    await wait_for(lambda: depth(0))
                    async with httpx.AsyncClient() as http:
                        rows = await rank_rows(http, url)
                        assert rows[0]["inflight"] == 1 and rows[0]["reserved_tokens"] > 0
                # The holder left mid-stream too.
            async with httpx.AsyncClient() as http:
                await ledger_zero(http, url)
                await engine_idle(http, emu.url)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


async def test_overload_is_refused_fast_with_bounded_queue_and_flat_memory() -> None:
    # One 2,000-token rank; each request reserves 400 output tokens but stops after 20 (real time):
    # about four run at once, eight may wait 0.3 s, everything else is refused at once.
    with emulator(dp_size=1, kv_tokens_per_rank=2000, time_scale=1.0) as emu:
        opts = {"backends": [f"sglang={emu.url}"], "queue_max": 8, "queue_timeout_s": 0.3}
        async with serve_router(**opts) as url:
            body = orjson.dumps(
                {"model": MODEL, "prompt": "x", "max_tokens": 400, "emulator_output_tokens": 20}
            )
            connector = aiohttp.TCPConnector(limit=200)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one() -> tuple[int, str | None]:
                    async with session.post(url + COMP, data=body) as resp:
                        await resp.read()
                        return resp.status, resp.headers.get("Retry-After")

                async def burst() -> dict[int, int]:
                    results = await asyncio.gather(*(one() for _ in range(300)))
                    for status, retry_after in results:
                        assert status in (200, 429, 503), status
                        assert status == 200 or retry_after == "1"
                    return {s: sum(1 for r, _ in results if r == s) for s in (200, 429, 503)}

                await burst()  # warm-up: connection pools, caches, interned strings
                before = rss_bytes()
                tallies = [await burst() for _ in range(3)]
                growth = rss_bytes() - before
            for tally in tallies:
                assert tally[429] > 200 and tally[200] >= 4, tally  # refused at once, not piled up
            assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over three bursts: {tallies}"
            async with httpx.AsyncClient() as http:
                await ledger_zero(http, url)
                metrics = (await http.get(url + "/metrics")).text
                assert "kvrouter_queue_depth 0" in metrics
                await engine_idle(http, emu.url)


async def test_a_line_that_formed_once_does_not_hold_back_newcomers_when_there_is_room() -> None:
    # Handing the line on costs a loop wake-up per waiter; under load a line that newcomers always joined
    # never drained, and the soak saw ~half its requests refused 429 with the ranks idle.
    from router.gateway.waitqueue import WaitQueue

    queue = WaitQueue(max_waiting=4, timeout_s=2.0, poll_s=10.0)  # no polling: only wake-ups move it
    room = {"free": 0}

    async def attempt() -> str | None:
        if room["free"] <= 0:
            return None
        room["free"] -= 1
        return "placed"

    first = asyncio.create_task(queue.admit(attempt))
    await asyncio.sleep(0)
    second = asyncio.create_task(queue.admit(attempt))
    await asyncio.sleep(0)
    assert queue.depth == 2  # the head found no room: the next one lines up behind it (FIFO)
    room["free"] = 10
    first.cancel()  # its client leaves; the line is handed on to the second waiter...
    await asyncio.sleep(0)
    assert queue.depth == 1 and not second.done()  # ...which has not run yet (a loop wake-up away)
    # A newcomer is placed at once, not behind a head that has not even looked for room yet.
    assert await queue.admit(attempt) == "placed" and not second.done()
    assert await second == "placed" and queue.depth == 0


async def test_a_blocked_head_is_not_overtaken_by_small_newcomers() -> None:
    from router.gateway.waitqueue import QueueTimeout, WaitQueue

    queue = WaitQueue(max_waiting=4, timeout_s=0.3, poll_s=0.05)
    room = {"free": 3}

    def needs(tokens: int) -> Any:
        async def attempt() -> str | None:
            if room["free"] < tokens:
                return None
            room["free"] -= tokens
            return f"{tokens}"

        return attempt

    big = asyncio.create_task(queue.admit(needs(5)))
    await asyncio.sleep(0)
    small = asyncio.create_task(queue.admit(needs(1)))  # would fit now, but the head is blocked
    await asyncio.sleep(0.1)
    assert room["free"] == 3 and not small.done()
    room["free"] = 6
    queue.wake()
    assert await big == "5" and await small == "1"
    with pytest.raises(QueueTimeout):
        await queue.admit(needs(100))
