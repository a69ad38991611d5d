"""The data path's upstream client (router/upstream) against real loopback servers: framing, streaming and
the keep-alive pool. Faults (timeouts, drops, cancellation, backpressure) are in test_upstream_client_faults.
Every test runs on the asyncio loop and on uvloop (the router's loop)."""

from __future__ import annotations

import asyncio

import pytest
from test_upstream_client_support import (
    BACKENDS,
    Peer,
    Upstream,
    chunked,
    eventually,
    json_answer,
    keep_answering,
    upstream,
)

from router.upstream import UpstreamClient, UpstreamResponse

pytestmark = pytest.mark.anyio
JSON_HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"r1")]
ANSWER = b'{"id":"1","choices":[{"message":{"content":"hi"}}],"usage":{"completion_tokens":16}}'


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


async def post(client: UpstreamClient, up: Upstream, body: bytes = b'{"a":1}') -> UpstreamResponse:
    return await client.post(up.url(), body, JSON_HEADERS, timeout_s=10.0)


async def test_request_is_one_well_formed_http11_post() -> None:
    async with upstream(keep_answering(ANSWER)) as up:
        client = UpstreamClient()
        resp = await client.post(up.url("/generate?x=1"), b'{"text":"a"}', JSON_HEADERS, timeout_s=5.0)
        await resp.read()
        resp.release()
        await client.close()
    head, body = up.requests[0]
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /generate?x=1 HTTP/1.1"
    assert f"host: 127.0.0.1:{up.port}".encode() in lines
    assert b"content-type: application/json" in lines
    assert b"x-request-id: r1" in lines
    assert b"content-length: 12" in lines
    assert body == b'{"text":"a"}'


async def test_content_length_answer_with_status_and_headers() -> None:
    async with upstream(keep_answering(ANSWER)) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        assert resp.status == 200
        assert resp.content_type == "application/json"
        assert resp.header("Content-Length") == str(len(ANSWER))
        assert resp.header("x-missing") is None
        assert await resp.read() == ANSWER
        assert resp.at_eof
        assert await resp.read_chunk() == b""
        resp.release()
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (1, 1)
        await client.close()


async def test_chunked_answer_is_decoded() -> None:
    pieces = [b"data: one\n\n", b"data: two\n\n", b"x" * 70_000]
    head, frames = chunked(pieces, b"application/json")

    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(head + b"".join(frames))

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        assert await resp.read() == b"".join(pieces)
        resp.release()
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (1, 1)  # a chunked body ends in-band
        await client.close()


async def test_sse_chunks_reach_the_reader_as_they_are_sent() -> None:
    """The server sends the next event only after the reader got the previous one: the reader cannot
    be handed a batch, so each read_chunk must return exactly the event that was sent."""
    events = [b'data: {"n":%d}\n\n' % i for i in range(5)]
    head, frames = chunked(events)
    got_one = asyncio.Event()

    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(head)
        for frame in frames[:-1]:
            got_one.clear()
            await peer.send(frame)
            await got_one.wait()
        await peer.send(frames[-1])

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        seen = []
        while chunk := await resp.read_chunk():
            seen.append(chunk)
            got_one.set()
        assert seen == events
        assert resp.at_eof
        resp.release()
        await client.close()


async def test_chunks_already_buffered_come_back_joined_in_one_read() -> None:
    events = [b"data: %d\n\n" % i for i in range(50)]
    head, frames = chunked(events)

    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(head + b"".join(frames))  # one write: several parser chunks per socket read

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        chunks = []
        while chunk := await resp.read_chunk():
            chunks.append(chunk)
        assert b"".join(chunks) == b"".join(events)
        assert len(chunks) < len(events)
        resp.release()
        await client.close()


async def test_keep_alive_serves_sequential_requests_on_one_connection() -> None:
    async with upstream(keep_answering(ANSWER)) as up:
        client = UpstreamClient()
        for i in range(20):
            resp = await post(client, up, b'{"i":%d}' % i)
            assert await resp.read() == ANSWER
            resp.release()
        assert up.accepted == 1
        assert [body for _, body in up.requests] == [b'{"i":%d}' % i for i in range(20)]
        await client.close()
        await eventually(lambda: up.open == 0, "the server saw the connection close")


async def test_a_connection_the_server_closes_while_idle_leaves_the_pool() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(json_answer(ANSWER))  # says keep-alive, then closes anyway (idle timeout)
        peer.writer.close()

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        await resp.read()
        resp.release()
        origin = ("127.0.0.1", up.port)
        await eventually(lambda: client.pool_sizes()[origin] == (0, 0), "the closed connection was dropped")
        resp = await post(client, up)  # a new connection
        assert await resp.read() == ANSWER
        resp.release()
        assert up.accepted == 2
        await client.close()


async def test_keep_alive_race_is_retried_once_on_a_new_connection() -> None:
    """The engine closes a kept-alive connection just as the next request goes out: no byte of an answer
    came back, so the request is sent again on a new connection without the caller noticing."""

    async def handler(up: Upstream, peer: Peer) -> None:
        if up.accepted == 1:
            await up.recorded(peer)
            await peer.send(json_answer(b'{"first":1}'))
            await up.recorded(peer)  # the second request, which this connection drops unanswered
            peer.writer.close()
            return
        await keep_answering(ANSWER)(up, peer)

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        assert await resp.read() == b'{"first":1}'
        resp.release()
        resp = await post(client, up, b'{"second":2}')
        assert await resp.read() == ANSWER
        resp.release()
        assert up.accepted == 2
        assert [body for _, body in up.requests] == [b'{"a":1}', b'{"second":2}', b'{"second":2}']
        await client.close()


async def test_connection_close_answers_are_not_pooled() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        while await up.recorded(peer) is not None:
            await peer.send(json_answer(ANSWER, extra=b"connection: close\r\n"))

    async with upstream(handler) as up:
        client = UpstreamClient()
        for _ in range(3):
            resp = await post(client, up)
            assert await resp.read() == ANSWER
            resp.release()
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        assert up.accepted == 3
        await eventually(lambda: up.open == 0, "the server saw every connection close")
        await client.close()


async def test_a_body_without_length_ends_when_the_server_closes() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\npart one, ")
        await peer.send(b"part two")
        peer.writer.close()

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        assert await resp.read() == b"part one, part two"
        resp.release()
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        await client.close()


async def test_an_interim_100_answer_is_skipped() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(b"HTTP/1.1 100 Continue\r\nx-interim: 1\r\n\r\n" + json_answer(ANSWER))

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        assert resp.status == 200 and resp.header("x-interim") is None
        assert await resp.read() == ANSWER
        resp.release()
        await client.close()


async def test_error_details_are_read_up_to_max_bytes() -> None:
    big = b"E" * 20_000
    answers = [json_answer(big, "500 Internal Server Error"), json_answer(b'{"e":"bad"}', "400 Bad Request")]

    async def handler(up: Upstream, peer: Peer) -> None:
        while await up.recorded(peer) is not None:
            await peer.send(answers[len(up.requests) - 1])

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await post(client, up)
        assert resp.status == 500
        assert await resp.read(max_bytes=4096) == b"E" * 4096
        resp.close()  # the rest is not wanted
        resp = await post(client, up)
        assert resp.status == 400
        assert await resp.read(max_bytes=4096) == b'{"e":"bad"}'
        resp.release()
        assert up.accepted == 2
        await client.close()


async def test_100_parallel_requests_leave_no_connection_behind() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        while await up.recorded(peer) is not None:
            await asyncio.sleep(0.01)  # overlap: the pool must open several connections
            await peer.send(json_answer(ANSWER))

    async with upstream(handler) as up:
        client = UpstreamClient(max_idle_per_origin=64)
        origin = ("127.0.0.1", up.port)

        async def one(i: int) -> bytes:
            resp = await post(client, up, b'{"i":%d}' % i)
            try:
                return await resp.read()
            finally:
                resp.release()

        for _ in range(2):
            assert await asyncio.gather(*(one(i) for i in range(100))) == [ANSWER] * 100
            idle, open_ = client.pool_sizes()[origin]
            assert idle == open_ <= 64  # nothing busy; the rest over the idle cap was closed

            def server_matches(n: int = open_) -> bool:
                return up.open == n

            await eventually(server_matches, "the server holds as many connections as the pool")
        assert len(up.requests) == 200
        await client.close()
        await eventually(lambda: up.open == 0, "the server saw every connection close")
        assert client.pool_sizes() == {}


async def test_idle_connections_expire() -> None:
    async with upstream(keep_answering(ANSWER)) as up:
        client = UpstreamClient(idle_timeout_s=0.05)
        resp = await post(client, up)
        await resp.read()
        resp.release()
        await eventually(lambda: up.open == 0, "the idle connection was closed by the client")
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        await client.close()


async def test_only_plain_http_urls_are_accepted() -> None:
    client = UpstreamClient()
    with pytest.raises(ValueError, match="https"):
        await client.post("https://127.0.0.1:1/x", b"", [])
    with pytest.raises(ValueError, match="http://host:port/path"):
        await client.post("ftp://127.0.0.1/x", b"", [])
    with pytest.raises(ValueError, match="line break"):
        await client.post("http://127.0.0.1:1/x", b"", [(b"x-a", b"1\r\nx-b: 2")])
    await client.close()
