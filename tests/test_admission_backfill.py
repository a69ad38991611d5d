"""Backfill behind a blocked head of the line, through the real gateway and the emulator: a request that
needs a whole rank claims one and waits for it to drain; small requests keep going to the other ranks."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson
import pytest
from gateway_support import MODEL, emulator, get_json, ranks_settled, router

pytestmark = pytest.mark.anyio

POOL_TOKENS = 4_000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _body(prompt_tokens: int, max_tokens: int, stream: bool = False) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "prompt": [1] * prompt_tokens,
            "max_tokens": max_tokens,
            "stream": stream,
            "emulator_output_tokens": max_tokens,
        }
    )


async def _small(session: aiohttp.ClientSession, url: str) -> int:
    async with session.post(url + "/v1/completions", data=_body(50, 2)) as resp:
        await resp.read()
        return resp.status


async def _huge(session: aiohttp.ClientSession, url: str) -> int:
    async with session.post(url + "/v1/completions", data=_body(3_900, 20)) as resp:
        await resp.read()
        return resp.status


async def test_a_request_waiting_for_a_whole_rank_does_not_block_small_ones() -> None:
    # Real time, so each long user (1,000 output tokens) holds its rank until the test hangs up.
    with emulator(dp_size=4, kv_tokens_per_rank=POOL_TOKENS, time_scale=1.0) as emu:
        async with router(backends=[f"sglang={emu.url}"], queue_timeout_s=30) as url:
            async with aiohttp.ClientSession() as session:
                async with contextlib.AsyncExitStack() as holders:
                    for _ in range(4):
                        resp = await holders.enter_async_context(
                            session.post(url + "/v1/completions", data=_body(100, 1_000, stream=True))
                        )
                        assert resp.status == 200
                        await resp.content.readany()  # placed and streaming
                    rows = (await get_json(url + "/ranks"))["backends"][0]["ranks"]
                    assert [r["inflight"] for r in rows] == [1, 1, 1, 1], rows
                    huge = asyncio.create_task(_huge(session, url))  # fits only an empty rank
                    await asyncio.sleep(0.3)
                    assert not huge.done()
                    statuses = await asyncio.wait_for(
                        asyncio.gather(*(_small(session, url) for _ in range(12))), 10
                    )
                    assert statuses == [200] * 12 and not huge.done()
                    per_rank = (await get_json(emu.url + "/_emulator/stats"))["requests_per_rank"]
                    # The claimed rank kept its long user only; the small ones went to the other three.
                    assert sorted(per_rank)[0] == 1 and sorted(per_rank)[1] > 1, per_rank
                # The long users hung up: the claimed rank drains and the huge request is served.
                assert await asyncio.wait_for(huge, 15) == 200
            assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in await ranks_settled(url))
