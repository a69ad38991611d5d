"""Conservation under faults, and admission holding load the engine would otherwise preempt."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import orjson
import pytest
from gateway_support import MODEL, emulator, get_json, ranks_settled, router

pytestmark = pytest.mark.anyio

CUT_AFTER_TOKENS = 20  # the emulator cuts every stream at this many tokens ("drop": connection reset)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, tally: dict[str, int]) -> None:
    """Ends normally, by the client leaving mid-stream (~20 %), or by the upstream dying (~5 %)."""
    fate = rng.random()
    dies = fate < 0.05
    leaves = 0.05 <= fate < 0.25
    tokens = CUT_AFTER_TOKENS + 10 if dies else rng.randint(2, 12)
    body = {"model": MODEL, "prompt": "p" * rng.randint(1, 200), "max_tokens": tokens,
            "stream": dies or leaves or rng.random() < 0.5, "emulator_output_tokens": tokens}  # fmt: skip
    route = "/v1/completions" if rng.random() < 0.5 else "/v1/chat/completions"
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    async with session.post(url + route, data=orjson.dumps(body)) as resp:
        assert resp.status == 200, await resp.text()
        if leaves:
            await resp.content.readany()
            resp.close()  # the client goes away mid-stream
            tally["left"] += 1
            return
        data = await resp.read()
    if dies:
        assert b'"error"' in data and data.rstrip().endswith(b"data: [DONE]")
        tally["died"] += 1
    else:
        tally["ok"] += 1


async def test_conservation_under_disconnects_and_upstream_deaths() -> None:
    with emulator(dp_size=4, kv_tokens_per_rank=50_000) as emu:
        async with router(backends=[f"sglang={emu.url}"]) as url:
            async with aiohttp.ClientSession() as session:
                cut = {"abort_after_tokens": CUT_AFTER_TOKENS, "abort_mode": "drop"}
                await session.post(emu.url + "/_emulator/faults", json=cut)
                rng = random.Random(7)
                tally = {"ok": 0, "left": 0, "died": 0}
                sem = asyncio.Semaphore(16)

                async def bounded() -> None:
                    async with sem:
                        await one(session, url, rng, tally)

                await asyncio.gather(*(bounded() for _ in range(1000)))
            assert sum(tally.values()) == 1000 and tally["left"] > 150 and tally["died"] > 25, tally
            rows = await ranks_settled(url)
            assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows), rows
            for _ in range(100):
                stats = await get_json(emu.url + "/_emulator/stats")
                if stats["inflight"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats["inflight"] == 0 and stats["orphaned_requests"] == 0, stats
            metrics = await get_json(url + "/ranks")
            assert metrics["backends"][0]["ranks"][0]["healthy"] is True


async def _burst(session: aiohttp.ClientSession, url: str, n: int, pin: bool) -> None:
    async def go(i: int) -> None:
        body = {"model": MODEL, "prompt": [1] * 100, "max_tokens": 300, "emulator_output_tokens": 300}
        if pin:  # round robin straight to the engine
            body["routed_dp_rank"] = i % 2
        async with session.post(url + "/v1/completions", data=orjson.dumps(body)) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()

    await asyncio.gather(*(go(i) for i in range(n)))


async def test_admission_prevents_the_preemptions_round_robin_causes() -> None:
    # Two ranks of 2,000 tokens; 24 requests of 400 tokens each: 3x what fits at once.
    settings = {"dp_size": 2, "kv_tokens_per_rank": 2000, "time_scale": 0.02}
    async with aiohttp.ClientSession() as session:
        with emulator(**settings) as direct:
            await _burst(session, direct.url, 24, pin=True)
            assert (await get_json(direct.url + "/_emulator/stats"))["preemptions_total"] > 0
        with emulator(**settings) as emu:
            async with router(backends=[f"sglang={emu.url}"], queue_timeout_s=60) as url:
                await _burst(session, url, 24, pin=False)
                stats = await get_json(emu.url + "/_emulator/stats")
                assert stats["preemptions_total"] == 0 and sum(stats["requests_per_rank"]) == 24, stats
                assert all(r["reserved_tokens"] == 0 for r in await ranks_settled(url))
