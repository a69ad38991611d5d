"""Bad input never crashes anything, never reaches an engine it could hurt, and never leaks capacity.

Every malformed request gets a 4xx with the OpenAI error body and no traceback, and the ledger is checked
at zero after each one. Client rank pins are proven stripped against an engine that dies on a bad rank.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import orjson
import pytest
from gateway_support import MODEL, emulator
from test_hardening_support import assert_error, ledger_zero, serve_router

from router.gateway.errors import upstream_error_body
from router.gateway.limits import limited_http_protocol

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (name, route, body, status, code or None): refused by the router itself, no engine touched.
ROUTER_REFUSES: list[tuple[str, str, Any, int, str | None]] = [
    ("json array", CHAT, [1, 2], 400, "invalid_request"),
    ("json null", CHAT, None, 400, "invalid_request"),
    ("missing model", CHAT, {"messages": MSGS}, 400, "invalid_request"),
    ("model not a string", COMP, {"model": 5, "prompt": "x"}, 400, "invalid_request"),
    ("missing messages", CHAT, {"model": MODEL}, 400, None),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, None),
    ("messages not a list", CHAT, {"model": MODEL, "messages": "hi"}, 400, None),
    ("message not an object", CHAT, {"model": MODEL, "messages": [1]}, 400, None),
    ("content a number", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, None),
    ("missing prompt", COMP, {"model": MODEL}, 400, None),
    ("prompt a number", COMP, {"model": MODEL, "prompt": 5}, 400, None),
    ("prompt empty list", COMP, {"model": MODEL, "prompt": []}, 400, None),
    ("prompt bad token ids", COMP, {"model": MODEL, "prompt": [-1, 10**20]}, 400, None),
    ("max_tokens negative", COMP, {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, None),
    ("max_tokens huge", COMP, {"model": MODEL, "prompt": "x", "max_tokens": 10**30}, 400, None),
    ("max_tokens a string", COMP, {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, None),
    ("max_tokens a bool", COMP, {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, None),
    ("max_tokens past the pool", COMP, {"model": MODEL, "prompt": "x", "max_tokens": 7000}, 400, "too_large"),
    ("n huge", COMP, {"model": MODEL, "prompt": "x", "n": 10**9}, 400, None),
    ("n zero", COMP, {"model": MODEL, "prompt": "x", "n": 0}, 400, None),
    ("n a string", COMP, {"model": MODEL, "prompt": "x", "n": "2"}, 400, None),
    ("prompt past the context", COMP, {"model": MODEL, "prompt": list(range(9000))}, 400, None),
    ("unknown model", CHAT, {"model": "gpt-4", "messages": MSGS}, 404, "model_not_found"),
    ("stream a string", COMP, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "invalid_request"),
    ("/generate stream a number", "/generate", {"text": "x", "stream": 1}, 400, "invalid_request"),
    ("stream_options a string", COMP, {"model": MODEL, "prompt": "x", "stream": True, "stream_options": "x"},
     400, "invalid_request"),
    ("stream_options a list", CHAT, {"model": MODEL, "messages": MSGS, "stream": True, "stream_options": [1]},
     400, "invalid_request"),
    ("include_usage a string", CHAT, {"model": MODEL, "messages": MSGS, "stream": True,
                                      "stream_options": {"include_usage": "yes"}}, 400, "invalid_request"),
    ("/generate no text", "/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, None),
    ("/generate sampling_params a string", "/generate", {"text": "x", "sampling_params": "x"}, 400, None),
    ("/generate max_new_tokens negative", "/generate",
     {"text": "x", "sampling_params": {"max_new_tokens": -3}}, 400, None),
    ("/generate unknown model", "/generate", {"model": "nope", "text": "x"}, 404, "model_not_found"),
]  # fmt: skip

RAW_JUNK: list[tuple[str, bytes]] = [
    ("malformed json", b"{not json"),
    ("binary junk", b"\xff\xfe\x00\x01\x80garbage"),
    ("invalid utf-8 in a string", b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}'),
    ("lone surrogate escape", b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}'),
    ("empty body", b""),
    ("nested 100k deep", b"[" * 100_000 + b"]" * 100_000),
    ("number overflows a double", b'{"model": "m", "prompt": "x", "max_tokens": 1e400}'),
    ("NaN", b'{"model": "m", "prompt": "x", "max_tokens": NaN}'),
    ("form encoded", b"model=x&prompt=y"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_every_bad_request_is_a_clean_4xx_and_leaves_the_ledger_at_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    with emulator(kv_tokens_per_rank=4096, max_model_len=8192) as emu:
        async with (
            serve_router(backends=[f"sglang={emu.url}"]) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            for name, route, body, status, code in ROUTER_REFUSES:
                resp = await http.post(route, content=json.dumps(body))  # orjson refuses ints > 64 bits
                assert_error(resp, status, code), name
                await ledger_zero(http, url, timeout_s=0.5)
            for name, raw in RAW_JUNK:
                resp = await http.post(COMP, content=raw, headers={"content-type": "application/json"})
                assert assert_error(resp, 400)["code"] in ("invalid_json", "invalid_request"), name
            assert (await http.get(emu.url + "/_emulator/requests")).json()["finished"] == []
            # Unicode that is valid JSON is fine: served, not refused.
            odd = {"model": MODEL, "prompt": "héllo \u0000 \U0001f600 \u202e \ufeff", "max_tokens": 2}
            assert (await http.post(COMP, json=odd)).status_code == 200
            # Refused by the engine (not the router): still the one error shape, still released.
            engine_says_no = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}  # batched: emulator 400
            assert_error(await http.post(COMP, json=engine_says_no), 400)
            await ledger_zero(http, url)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


async def test_routes_methods_and_sizes() -> None:
    with emulator() as emu:
        opts = {"backends": [f"sglang={emu.url}"], "max_body_bytes": 2048, "max_header_bytes": 4096}
        async with serve_router(**opts) as url, httpx.AsyncClient(base_url=url) as http:
            assert_error(await http.get("/v1/nowhere"), 404, "not_found")
            assert_error(await http.post("/v1/embeddings", json={}), 404)
            assert_error(await http.get(COMP), 405)
            assert_error(await http.delete("/v1/models"), 405)
            big = {"model": MODEL, "prompt": "x" * 4000}
            assert_error(await http.post(COMP, json=big), 413, "request_too_large")
            # Chunked (no content-length): counted while read, refused at the limit.

            async def chunks() -> Any:
                for _ in range(10):
                    yield b"x" * 1000

            assert_error(await http.post(COMP, content=chunks()), 413, "request_too_large")
            # A head past max_header_bytes: 431 from the HTTP parser, before the app sees it.
            resp = await http.get("/health", headers={"x-big": "a" * 8000})
            assert_error(resp, 431, "request_header_too_large")
            many = {f"x-h{i}": "v" for i in range(1000)}
            assert_error(await http.get("/health", headers=many), 431)
            assert (await http.get("/health")).status_code == 200
            await ledger_zero(http, url)


async def test_a_head_that_never_completes_is_timed_out() -> None:
    async with serve_router(
        ready=False, backends=["sglang=http://127.0.0.1:9"], http_protocol=limited_http_protocol(0.3)
    ) as url:
        host, port = url.removeprefix("http://").split(":")
        idle_r, idle_w = await asyncio.open_connection(host, int(port))  # connects, sends nothing
        slow_r, slow_w = await asyncio.open_connection(host, int(port))
        slow_w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never finishes the head
        await slow_w.drain()
        idle = await asyncio.wait_for(idle_r.read(), 3)
        slow = await asyncio.wait_for(slow_r.read(), 3)
        for w in (idle_w, slow_w):
            w.close()
            await w.wait_closed()
        assert slow.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in slow, slow
        assert idle.startswith(b"HTTP/1.1 408"), idle
        # A normal request on a fresh connection is unaffected.
        async with httpx.AsyncClient() as http:
            assert (await http.get(url + "/health")).status_code == 200


async def test_client_rank_pins_never_reach_an_engine_that_crashes_on_them() -> None:
    with emulator(dp_size=2) as emu:
        async with serve_router(backends=[f"sglang={emu.url}"]) as url, httpx.AsyncClient() as http:
            assert (
                await http.post(emu.url + "/_emulator/faults", json={"legacy_crash": True})
            ).status_code == 200
            pins = {"routed_dp_rank": 99, "data_parallel_rank": 99, "disagg_prefill_dp_rank": 99}
            header = {"X-Data-Parallel-Rank": "99", "x-data-parallel-rank": "99"}
            bodies = [
                (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 2, **pins}),
                (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 2, "stream": True, **pins}),
                (COMP, {"model": MODEL, "prompt": "x", "max_tokens": 2, **pins}),
                ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}, **pins}),
            ]
            for route, body in bodies:
                resp = await http.post(url + route, json=body, headers=header)
                assert resp.status_code == 200, resp.text
            assert not emu.crashed
            assert (await http.get(emu.url + "/health")).status_code == 200
            ranks = {r["rank"] for r in (await http.get(emu.url + "/_emulator/requests")).json()["finished"]}
            assert ranks <= {0, 1}
            await ledger_zero(http, url)
            # The fault was armed: the same pin sent straight to the engine takes it down.
            emu_url = emu.url
            with pytest.raises(httpx.TransportError):
                await http.post(emu_url + "/generate", json={"text": "x", "routed_dp_rank": 99})
                await asyncio.sleep(0.2)
                await http.get(emu_url + "/health")
            assert emu.crashed


def test_engine_error_bodies_are_rewrapped_in_the_openai_shape() -> None:
    shaped = b'{"error": {"message": "m", "type": "t", "param": null, "code": 400}}'
    assert upstream_error_body(400, shaped) is shaped
    for raw, message in [
        (b'{"object": "error", "message": "bad rank", "type": "BadRequestError", "code": 400}', "bad rank"),
        (b'{"detail": "Field required"}', "Field required"),
        (b"<html>413 Request Entity Too Large</html>", "<html>413 Request Entity Too Large</html>"),
        (b'{"error": "plain string"}', "plain string"),
        (b"", "upstream answered HTTP 400"),
    ]:
        err = orjson.loads(upstream_error_body(400, raw))["error"]
        assert err["message"] == message and err["type"] == "invalid_request_error", err
