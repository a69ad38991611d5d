"""Refusals: 400/401/404/413/429/503 with OpenAI error bodies, no backend touched, the ledger untouched."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from gateway_support import MODEL, emulator, get_json, ranks_settled, router

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


async def test_bad_requests_never_reach_a_backend() -> None:
    with emulator(kv_tokens_per_rank=4096, max_model_len=8192) as emu:
        async with router(backends=[f"sglang={emu.url}"], max_body_bytes=2048) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                post = http.post
                chat = "/v1/chat/completions"
                msgs = [{"role": "user", "content": "hi"}]
                junk = await post(chat, content=b"{not json", headers={"content-type": "application/json"})
                assert_error(junk, 400, "invalid_json")
                assert_error(await post(chat, json=[1, 2]), 400)
                assert assert_error(await post(chat, json={"messages": msgs}), 400)["param"] == "model"
                assert assert_error(await post(chat, json={"model": MODEL}), 400)["param"] == "messages"
                assert (
                    assert_error(await post("/v1/completions", json={"model": MODEL}), 400)["param"]
                    == "prompt"
                )
                bad_n = {"model": MODEL, "prompt": "x", "n": 0}
                assert assert_error(await post("/v1/completions", json=bad_n), 400)["param"] == "n"
                assert_error(
                    await post(chat, json={"model": "gpt-4", "messages": msgs}), 404, "model_not_found"
                )
                big = {"model": MODEL, "prompt": "x" * 4000}
                assert_error(await post("/v1/completions", json=big), 413, "request_too_large")
                too_long = {"model": MODEL, "prompt": list(range(9000))}
                assert_error(await post("/v1/completions", json=too_long, headers={}), 413)
            async with (
                router(backends=[f"sglang={emu.url}"]) as url2,
                httpx.AsyncClient(base_url=url2) as http,
            ):
                too_long = {"model": MODEL, "prompt": list(range(9000))}
                assert_error(
                    await http.post("/v1/completions", json=too_long), 400, "context_length_exceeded"
                )
                # Fits the context window (8192) but no rank's 4,096-token pool: refused, not queued.
                too_big = {"model": MODEL, "prompt": list(range(3000)), "max_tokens": 3000}
                assert_error(await http.post("/v1/completions", json=too_big), 400, "too_large")
                assert_error(await http.get("/v1/nowhere"), 404)
                metrics = (await http.get("/metrics")).text
                assert 'kvrouter_rejections_total{reason="too_large"} 1.0' in metrics
                rows = await ranks_settled(url2)
            assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows)
            assert (await get_json(emu.url + "/_emulator/requests"))["finished"] == []


async def test_api_keys() -> None:
    with emulator() as emu:
        async with (
            router(backends=[f"sglang={emu.url}"], api_keys=["k1", "k2"]) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            assert_error(await http.post("/v1/completions", json=body), 401, "invalid_api_key")
            bad = {"Authorization": "Bearer k3"}
            assert_error(await http.post("/v1/completions", json=body, headers=bad), 401)
            assert_error(await http.get("/v1/models"), 401)
            ok = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer k2"})
            assert ok.status_code == 200
            assert (await http.get("/health")).status_code == 200


async def test_queue_full_429_and_deadline_503_while_a_stream_holds_the_pool() -> None:
    # One rank of 1,000 tokens in real time: a 900-token stream holds it for seconds.
    with emulator(dp_size=1, kv_tokens_per_rank=1000, time_scale=1.0) as emu:
        opts = {"queue_max": 1, "queue_timeout_s": 0.5}
        async with (
            router(backends=[f"sglang={emu.url}"], **opts) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            hold = {
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 900,
                "stream": True,
                "emulator_output_tokens": 900,
            }
            async with http.stream("POST", "/v1/completions", json=hold) as stream:
                assert stream.status_code == 200
                chunks = stream.aiter_bytes()  # kept referenced: a dropped iterator closes the stream
                await chunks.__anext__()  # first chunk: the reservation is held
                small = {"model": MODEL, "prompt": "x", "max_tokens": 200}
                waiting = asyncio.create_task(http.post("/v1/completions", json=small))
                await asyncio.sleep(0.1)
                full = await http.post("/v1/completions", json=small)
                assert_error(full, 429, "queue_full")
                assert full.headers["retry-after"] == "1"
                assert_error(await waiting, 503, "queue_timeout")
                ranks = (await get_json(url + "/ranks"))["backends"][0]["ranks"]
                assert ranks[0]["inflight"] == 1
            # The client closed the stream: the reservation and the engine's request are both gone.
            rows = await ranks_settled(url)
            assert rows[0]["reserved_tokens"] == 0 and rows[0]["inflight"] == 0
            for _ in range(100):
                if (await get_json(emu.url + "/_emulator/stats"))["inflight"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await get_json(emu.url + "/_emulator/stats"))["inflight"] == 0
