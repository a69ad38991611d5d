"""The long-prefill gate through the real gateway and the emulator: a long prompt is held in the router's
queue (not in the engine) while short requests keep being served, and is then served itself (its hold is
bounded, and its queue deadline is extended by it, so the hold never turns into a 503)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from gateway_support import MODEL, emulator, get_json, ranks_settled, router

from router.placement.prefill_gate import prefill_s

pytestmark = pytest.mark.anyio

LONG_PROMPT_TOKENS = 4_000
PROMPT_TOKENS = 6_000
# Held ~5 x 0.9 s (prefill_s(6,000)): longer than the queue deadline below, shorter than the test's bound.
HOLD_STRETCH = 5.0
QUEUE_TIMEOUT_S = 2.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _body(prompt_tokens: int, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "prompt": [1] * prompt_tokens,
            "max_tokens": max_tokens,
            "emulator_output_tokens": max_tokens,
        }
    )


async def _post(session: aiohttp.ClientSession, url: str, prompt_tokens: int, max_tokens: int) -> int:
    async with session.post(url + "/v1/completions", data=_body(prompt_tokens, max_tokens)) as resp:
        await resp.read()
        return resp.status


async def test_a_long_prompt_is_held_in_the_router_while_short_ones_are_served() -> None:
    hold_s = HOLD_STRETCH * prefill_s(PROMPT_TOKENS)
    assert hold_s > QUEUE_TIMEOUT_S
    policy = f"lockstep:long_prompt_tokens={LONG_PROMPT_TOKENS},hold_stretch={HOLD_STRETCH}"
    with emulator(dp_size=4, kv_tokens_per_rank=20_000) as emu:
        async with router(
            backends=[f"sglang={emu.url}"], policy=policy, queue_timeout_s=QUEUE_TIMEOUT_S
        ) as url:
            async with aiohttp.ClientSession() as session:
                long = asyncio.create_task(_post(session, url, PROMPT_TOKENS, 4))
                for _ in range(100):  # until the gateway holds it in its queue
                    async with session.get(url + "/metrics") as resp:
                        if "kvrouter_queue_depth 1.0" in await resp.text():
                            break
                    await asyncio.sleep(0.02)
                assert not long.done()
                statuses = await asyncio.wait_for(
                    asyncio.gather(*(_post(session, url, 50, 2) for _ in range(12))), 10
                )
                assert statuses == [200] * 12
                stats = await get_json(emu.url + "/_emulator/stats")
                # Every short request reached the engine; the long one did not: it is held in the router.
                assert sum(stats["requests_per_rank"]) == 12 and not long.done(), stats
                # Held past the plain queue deadline, yet served: the hold is bounded and not a timeout.
                assert await asyncio.wait_for(long, hold_s + 10) == 200
            stats = await get_json(emu.url + "/_emulator/stats")
            assert sum(stats["requests_per_rank"]) == 13 and stats["preemptions_total"] == 0
            assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in await ranks_settled(url))
