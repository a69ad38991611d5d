"""The gateway end to end over loopback: openai client → router (uvicorn, in-process) → SGLang emulator."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from gateway_support import MODEL, emulator, emulator_finished, get_json, ranks_settled, router

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def served_rank(finished: list[dict[str, Any]], rid: str) -> int:
    match = [r for r in finished if r["rid"] == rid]
    assert len(match) == 1, (rid, finished)
    return int(match[0]["rank"])


def router_rank(headers: httpx.Headers) -> int:
    return int(headers["x-kvrouter-rank"].rsplit("@", 1)[1])


async def test_openai_routes_stream_and_not_run_where_the_router_placed_them() -> None:
    with emulator() as emu:
        async with router(backends=[f"sglang={emu.url}"]) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            placed: dict[str, int] = {}
            msgs = [{"role": "user", "content": "hello"}]
            extra = {"emulator_output_tokens": 6}
            for _ in range(3):
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=msgs, max_tokens=6, extra_body=extra
                )  # type: ignore[call-overload]
                chat = raw.parse()
                assert chat.choices[0].message.content and chat.usage is not None
                assert chat.usage.completion_tokens == 6
                placed[chat.id] = router_rank(raw.headers)
                raw_c = await client.completions.with_raw_response.create(
                    model=MODEL, prompt="once upon", max_tokens=4, extra_body=extra
                )
                placed[raw_c.parse().id] = router_rank(raw_c.headers)
            async with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=msgs, max_tokens=6, stream=True, extra_body=extra
            ) as resp:  # type: ignore[call-overload]
                rank = router_rank(resp.headers)
                ids, text = set(), ""
                async for chunk in await resp.parse():
                    ids.add(chunk.id)
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                assert text and len(ids) == 1
                placed[ids.pop()] = rank
            stream = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=3, stream=True, extra_body=extra
            )
            assert [c async for c in stream]
            await client.close()
            finished = (await get_json(emu.url + "/_emulator/requests?finished=100"))["finished"]
            for rid, rank in placed.items():
                assert served_rank(finished, rid) == rank
            assert len(placed) == 7
            rows = await ranks_settled(url)
            assert all(r["reserved_tokens"] == 0 and r["inflight"] == 0 for r in rows)


async def test_generate_route_and_client_pins_are_ignored() -> None:
    with emulator() as emu:
        async with router(backends=[f"sglang={emu.url}"]) as url, httpx.AsyncClient(base_url=url) as http:
            # An out-of-range pin would be a 400 (or a crash on old SGLang) if it reached the engine.
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 3}, "routed_dp_rank": 99,
                    "data_parallel_rank": 99, "rid": "client-chosen"}  # fmt: skip
            resp = await http.post("/generate", json=body, headers={"X-Data-Parallel-Rank": "99"})
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert out["meta_info"]["completion_tokens"] == 3 and out["meta_info"]["id"] != "client-chosen"
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                    "data_parallel_rank": -1, "stream": True}  # fmt: skip
            resp = await http.post("/v1/chat/completions", json=chat, headers={"X-data-parallel-rank": "7"})
            assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
            finished = await emulator_finished(emu.url, 2)
            assert all(0 <= r["rank"] < 4 for r in finished) and len(finished) == 2
            assert (await ranks_settled(url))[0]["reserved_tokens"] == 0


async def test_down_rank_is_retried_elsewhere_before_the_first_byte() -> None:
    with emulator(dp_size=2) as emu:
        async with router(backends=[f"sglang={emu.url}"], policy="round_robin") as url:
            async with httpx.AsyncClient() as http:
                await http.post(emu.url + "/_emulator/faults", json={"down_ranks": [0]})
                body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "emulator_output_tokens": 2}
                for stream in (False, True, False, True):
                    resp = await http.post(url + "/v1/completions", json={**body, "stream": stream})
                    assert resp.status_code == 200, resp.text
                    assert router_rank(resp.headers) == 1
                metrics = (await http.get(url + "/metrics")).text
            assert "kvrouter_upstream_retries_total" in metrics
            assert all(r["reserved_tokens"] == 0 for r in await ranks_settled(url))


async def test_info_routes() -> None:
    with emulator() as emu:
        async with router(backends=[f"sglang={emu.url}"]) as url, httpx.AsyncClient(base_url=url) as http:
            models = (await http.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/ready")).json()["ready"] is True
            ranks = (await http.get("/ranks")).json()
            backend = ranks["backends"][0]
            assert set(backend) == {"name", "engine", "url", "ranks"} and backend["engine"] == "sglang"
            assert set(backend["ranks"][0]) == {
                "rank", "capacity_tokens", "reserved_tokens", "inflight", "engine_used_tokens", "healthy"
            }  # fmt: skip
            text = (await http.get("/metrics")).text
            names = ("rank_capacity_tokens", "rank_reserved_tokens", "rank_engine_used_tokens",
                     "rank_inflight_requests", "queue_depth", "ttft_seconds",
                     "request_duration_seconds")  # fmt: skip
            for name in names:
                assert f"kvrouter_{name}" in text
            assert 'backend="sglang-0",rank="3"' in text


async def test_not_ready_without_a_reachable_backend() -> None:
    async with (
        router(ready=False, backends=["sglang=http://127.0.0.1:9"]) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        assert (await http.get("/health")).status_code == 200
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json()["backends"]["sglang-0"]["discovered"] is False
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "not_ready"
