"""The upstream client against arbitrary TCP segmentation (Hypothesis splits the answer's bytes at random
points and the server writes them separately) and against the project's emulated SGLang/vLLM engines."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import orjson
import pytest
from emulator_fixtures import StartEmulator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_upstream_client_support import Peer, Upstream, chunked, upstream

from router.upstream import UpstreamClient

HEADERS = [(b"content-type", b"application/json")]
events = st.lists(st.binary(min_size=1, max_size=300), min_size=0, max_size=8)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


async def exchange_twice(answers: list[list[bytes]]) -> tuple[list[bytes], int]:
    """Two requests on one kept-alive connection; each answer is written piece by piece."""

    async def handler(up: Upstream, peer: Peer) -> None:
        for pieces in answers:
            await up.recorded(peer)
            for piece in pieces:
                await peer.send(piece)
                await asyncio.sleep(0.001)  # likely a separate segment and a separate read

    bodies = []
    async with upstream(handler) as up:
        client = UpstreamClient()
        for _ in answers:
            resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=10.0)
            chunks = []
            while chunk := await resp.read_chunk():
                chunks.append(chunk)
            bodies.append(b"".join(chunks))
            resp.release()
        await client.close()
        return bodies, up.accepted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stream=events,
    plain=st.binary(max_size=2000),
    cuts=st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=12),
)
def test_any_segmentation_yields_the_same_bodies(stream: list[bytes], plain: bytes, cuts: list[int]) -> None:
    head, frames = chunked(stream)
    sse = head + b"".join(frames)
    fixed = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(plain) + plain
    answers = [split(sse, cuts), split(fixed, [c * 7 for c in cuts])]
    bodies, connections = asyncio.run(asyncio.wait_for(exchange_twice(answers), 20.0))
    assert bodies == [b"".join(stream), plain]
    assert connections == 1


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_emulated_engines_answer_and_stream_through_one_connection(
    start_emulator: StartEmulator, engine: str
) -> None:
    emu = start_emulator(engine, dp_size=1)
    async with httpx.AsyncClient(base_url=emu.url) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
    url = emu.url + "/v1/chat/completions"
    client = UpstreamClient()
    for stream in (False, True, False):
        body = orjson.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "stream": stream,
            }
        )
        resp = await client.post(url, body, HEADERS, timeout_s=30.0)
        assert resp.status == 200
        if stream:
            assert "text/event-stream" in resp.content_type
            chunks = []
            while chunk := await resp.read_chunk():
                chunks.append(chunk)
            text = b"".join(chunks)
            assert text.count(b"data: {") >= 8
            assert text.rstrip().endswith(b"data: [DONE]")
        else:
            answer = orjson.loads(await resp.read())
            assert answer["usage"]["completion_tokens"] == 8
        resp.release()
    sizes = list(client.pool_sizes().values())
    assert sizes == [(1, 1)]  # uvicorn kept the one connection alive across all three
    await client.close()
