"""The gateway's HTTP protocol serves generation POSTs itself (router/gateway/protocol.py): on the wire it
must behave as uvicorn's ASGI path did, keep HTTP/1.1's connection rules, release on disconnect, respect
backpressure and the head limits, leave what it does not take to uvicorn, and drain on shutdown."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

import httpx
import pytest
import uvicorn
from fastpath_support import (
    Recording,
    address,
    connection,
    post,
    raw_socket,
    read_chunk,
    read_head,
    read_response,
    recording,
)
from gateway_support import MODEL, emulator, ranks_settled, router
from test_hardening_support import assert_error, engine_idle, wait_ready

from router.config import Settings
from router.gateway import create_app
from router.gateway.shutdown import GracefulServer

pytestmark = pytest.mark.anyio

COMP = "/v1/completions"
SMALL = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
STREAM = {**SMALL, "stream": True}


def long_stream(tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True}


async def test_keep_alive_and_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    proto = recording()
    with emulator(dp_size=2) as emu:
        async with router(backends=[f"sglang={emu.url}"], http=proto) as url, connection(url) as (r, w):
            # Four requests in one write: the second waits for the first's answer, a GET goes to uvicorn.
            health = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
            w.write(post(COMP, STREAM) + post(COMP, SMALL) + health + post("/generate", {"text": "x"}))
            stream = await read_response(r)
            plain = await read_response(r)
            got_health = await read_response(r)
            generate = await read_response(r)
            assert stream[0] == 200 and stream[2].endswith(b"data: [DONE]\n\n"), stream
            names = [name for name, _ in stream[1]]
            assert names[-5:] == [
                "content-type", "cache-control", "x-accel-buffering", "x-kvrouter-rank", "transfer-encoding"
            ], names  # fmt: skip
            assert plain[0] == 200 and b'"choices"' in plain[2], plain
            assert [n for n, _ in plain[1]][-3:] == ["x-kvrouter-rank", "content-length", "content-type"]
            assert got_health[0] == 200
            assert generate[0] == 200 and b'"meta_info"' in generate[2], generate
            # Keep-alive: the same connection serves again once idle.
            w.write(post(COMP, SMALL))
            assert (await read_response(r))[0] == 200
            assert proto.direct == 4
            # Connection: close is honoured: answered, then closed.
            w.write(post(COMP, SMALL, extra="Connection: close\r\n"))
            status, headers, _ = await read_response(r)
            assert status == 200 and ("connection", "close") in headers
            assert await r.read() == b""
            assert all(row["reserved_tokens"] == 0 for row in await ranks_settled(url))


async def test_a_client_leaving_mid_stream_releases_its_reservation() -> None:
    proto = recording()
    with emulator(dp_size=2, time_scale=1.0) as emu:
        async with router(backends=[f"sglang={emu.url}"], http=proto) as url:
            async with connection(url) as (r, w):
                w.write(post(COMP, long_stream(400)))
                status, headers = await read_head(r)
                assert status == 200 and headers["transfer-encoding"] == "chunked"
                assert b"data: " in await read_chunk(r)
                rows = (await httpx.AsyncClient().get(url + "/ranks")).json()["backends"][0]["ranks"]
                assert sum(row["inflight"] for row in rows) == 1
            rows = await ranks_settled(url)
            assert all(row["reserved_tokens"] == 0 and row["inflight"] == 0 for row in rows), rows
            async with httpx.AsyncClient() as http:
                await engine_idle(http, emu.url)  # the engine aborted the stream too
                metrics = (await http.get(url + "/metrics")).text
            assert "kvrouter_client_disconnects_total 1.0" in metrics
            assert proto.direct == 1


async def test_a_huge_body_is_refused_unread_and_an_overflowing_chunked_body_keeps_the_connection() -> None:
    proto = recording()
    with emulator(dp_size=1) as emu:
        async with router(backends=[f"sglang={emu.url}"], http=proto, max_body_bytes=2048) as url:
            async with connection(url) as (r, w):
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1073741824\r\n\r\n{")
                status, headers, body = await read_response(r)
                assert status == 413 and b"request_too_large" in body
                assert ("connection", "close") in headers
                assert await r.read() == b""  # closed without waiting for the gigabyte
            async with connection(url) as (r, w):
                chunks = b"".join(b"3e8\r\n" + b"x" * 1000 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
                w.write(chunks)
                status, headers, body = await read_response(r)
                assert status == 413 and b"request_too_large" in body
                w.write(post(COMP, SMALL))  # the rest was read and dropped: the connection is usable
                assert (await read_response(r))[0] == 200
            assert proto.direct == 3


async def test_a_slow_reader_backs_the_stream_up_within_bounds() -> None:
    proto = recording(small_sndbuf=True)
    with emulator(dp_size=1) as emu:
        async with router(backends=[f"sglang={emu.url}"], http=proto) as url:
            loop = asyncio.get_running_loop()
            with raw_socket(url, rcvbuf_bytes=4096) as sock:  # read only when asked (no reader task)
                await loop.sock_connect(sock, address(url))
                await loop.sock_sendall(sock, post(COMP, long_stream(3000)))
                streaming: list[Recording] = []
                for _ in range(1000):  # the client reads nothing: the router's transport must pause
                    streaming = [p for p in proto.protocols if p._running is not None]
                    if streaming and streaming[0].flow.write_paused:
                        break
                    await asyncio.sleep(0.01)
                assert streaming and streaming[0].flow.write_paused
                buffered = streaming[0].transport.get_write_buffer_size()
                # The transport's high-water mark (64 KiB) plus one upstream read (aiohttp buffers 128 KiB).
                assert buffered <= 64 * 1024 + 128 * 1024 + 4096, buffered
                rest = b""
                while not rest.endswith(b"0\r\n\r\n"):
                    data = await loop.sock_recv(sock, 1 << 16)
                    assert data, rest[-300:]
                    rest += data
                assert rest.count(b"data: {") >= 3000 and b"data: [DONE]" in rest
            assert all(row["reserved_tokens"] == 0 for row in await ranks_settled(url))


async def test_http10_expect_continue_and_query_strings_fall_back_to_uvicorn() -> None:
    proto = recording()
    with emulator(dp_size=1) as emu:
        async with router(backends=[f"sglang={emu.url}"], http=proto) as url:
            async with connection(url) as (r, w):
                w.write(post(COMP, SMALL, version="1.0"))
                status, _, body = await read_response(r)
                assert status == 200 and b'"choices"' in body
            async with connection(url) as (r, w):
                whole = post(COMP, SMALL, extra="Expect: 100-continue\r\n")
                head, _, data = whole.partition(b"\r\n\r\n")
                w.write(head + b"\r\n\r\n")
                assert await r.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
                w.write(data)
                assert (await read_response(r))[0] == 200
                w.write(post(COMP + "?x=1", SMALL))
                assert (await read_response(r))[0] == 200
            assert proto.direct == 0


async def test_head_limits_still_apply_to_generation_routes() -> None:
    proto = recording(head_timeout_s=0.3)
    async with router(
        ready=False, backends=["sglang=http://127.0.0.1:9"], http=proto, max_header_bytes=4096
    ) as url:
        async with httpx.AsyncClient() as http:
            resp = await http.post(url + COMP, json=SMALL, headers={"x-big": "a" * 8000})
            assert_error(resp, 431, "request_header_too_large")
        async with connection(url) as (r, w):
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
            late = await asyncio.wait_for(r.read(), 5)
            assert late.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in late, late
        assert proto.direct == 0


async def test_sigterm_lets_an_inflight_stream_finish_and_refuses_new_work() -> None:
    with emulator(dp_size=1, time_scale=0.5) as emu:
        settings = Settings(port=0, reconcile_interval_s=0.1, backends=[f"sglang={emu.url}"])
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=0, log_level="warning", loop="asyncio",
            http=recording(), timeout_graceful_shutdown=5,
        )  # fmt: skip
        server = GracefulServer(config, grace_s=30, settle_s=1)
        # On its own thread: uvicorn re-raises a signal it handled in the main thread once it has exited.
        thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
        thread.start()
        while not server.started:
            assert thread.is_alive()
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        await wait_ready(url)
        async with httpx.AsyncClient() as http, connection(url) as (r, w):
            w.write(post(COMP, long_stream(40)))
            assert (await read_head(r))[0] == 200
            first = await read_chunk(r)
            server.handle_exit(signal.SIGTERM, None)
            for _ in range(500):
                resp = await http.get(url + "/ready")
                if resp.status_code == 503:
                    break
                await asyncio.sleep(0.01)
            assert_error(await http.post(url + COMP, json=SMALL), 503, "shutting_down")
            rest = first
            while not rest.endswith(b"data: [DONE]\n\n"):
                chunk = await read_chunk(r)
                assert chunk, rest[-300:]
                rest += chunk
            assert b'"error"' not in rest and b'"finish_reason":"length"' in rest, rest[-300:]
            assert await read_chunk(r) == b""  # the last chunk, then the connection closes
            assert await r.read() == b""
        await asyncio.to_thread(thread.join, 20)
        assert not thread.is_alive()
        assert server.drain_report is not None
        assert server.drain_report.inflight_at_start == 1 and server.drain_report.cut_after_grace == 0


async def test_uvicorns_own_protocol_gives_the_same_answers() -> None:
    """The pure-ASGI path (the app under stock httptools): same statuses, headers in the same order."""
    proto = recording()
    cases: list[tuple[str, bytes]] = [
        ("plain", post(COMP, SMALL)),
        ("stream", post(COMP, STREAM)),
        ("bad json", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\n{"),
        ("no key", post(COMP, {**SMALL, "model": "nope"})),
    ]
    with emulator(dp_size=1) as emu:
        backends = [f"sglang={emu.url}"]
        async with (
            router(backends=backends, http=proto) as fast,
            router(backends=backends, http="httptools") as stock,
        ):
            for name, raw in cases:
                answers = []
                for url in (fast, stock):
                    async with connection(url) as (r, w):
                        w.write(raw)
                        status, headers, body = await read_response(r)
                    answers.append((status, [n for n, _ in headers], body if status != 200 else body[:6]))
                assert answers[0] == answers[1], (name, answers)
    assert proto.direct == len(cases)
