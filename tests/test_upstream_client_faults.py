"""The upstream client when things go wrong: refused connections, silence past the deadline, drops
mid-body, the router cutting or dropping a stream, a cancelled caller, and a reader slower than the engine.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from test_upstream_client_support import BACKENDS, Peer, Upstream, chunked, eventually, upstream

from router.upstream import HIGH_WATER_BYTES, UpstreamClient, UpstreamConnectError, UpstreamReadError

pytestmark = pytest.mark.anyio
HEADERS = [(b"content-type", b"application/json")]
BOUND_S = 10.0  # outer bound on any single await here: a hang fails the test instead of the suite


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens on it once the socket is closed


async def silent(up: Upstream, peer: Peer) -> None:
    """Reads the request, never answers, waits for the client to go."""
    await up.recorded(peer)
    await peer.wait_eof()


async def test_a_refused_connection_is_a_connect_error() -> None:
    client = UpstreamClient(connect_timeout_s=2.0)
    with pytest.raises(UpstreamConnectError, match=r"connect to 127\.0\.0\.1"):
        await client.post(f"http://127.0.0.1:{closed_port()}/generate", b"{}", HEADERS, timeout_s=5.0)
    await client.close()


async def test_a_server_that_never_answers_times_out_and_is_dropped() -> None:
    async with upstream(silent) as up:
        client = UpstreamClient()
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(TimeoutError):
                await client.post(up.url(), b"{}", HEADERS, timeout_s=0.2)
        await eventually(lambda: up.peers[0].eof, "the server saw the connection close")
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        await client.close()


async def test_the_deadline_covers_the_body_too() -> None:
    """Like aiohttp's ClientTimeout(total=...): a stream that stalls past the deadline raises on read."""

    async def handler(up: Upstream, peer: Peer) -> None:
        head, frames = chunked([b"data: 1\n\n", b"data: 2\n\n"])
        await up.recorded(peer)
        await peer.send(head + frames[0])
        await peer.wait_eof()

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=0.3)
        assert await resp.read_chunk() == b"data: 1\n\n"
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(TimeoutError):
                await resp.read_chunk()
        await eventually(lambda: up.peers[0].eof, "the server saw the connection close")
        resp.close()
        await client.close()


async def test_a_complete_answer_outlives_its_deadline() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await peer.wait_eof()

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=0.05)
        await eventually(lambda: resp.at_eof or resp.buffered_bytes == 2, "the body arrived")
        await asyncio.sleep(0.1)  # past the deadline: the exchange had already ended, nothing times out
        assert await resp.read() == b"ok"
        resp.release()
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (1, 1)
        await client.close()


async def test_a_connection_dropped_mid_body_is_a_read_error() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        peer.writer.close()

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=5.0)
        with pytest.raises(UpstreamReadError, match="closed the connection"):
            await resp.read()
        resp.release()  # a broken response is never pooled
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        await client.close()


async def test_a_fresh_connection_closed_before_any_answer_is_not_retried() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        peer.writer.close()

    async with upstream(handler) as up:
        client = UpstreamClient()
        with pytest.raises(UpstreamReadError):
            await client.post(up.url(), b"{}", HEADERS, timeout_s=5.0)
        assert up.accepted == 1  # the request may have reached the engine: no blind resend
        await client.close()


async def test_garbage_instead_of_http_is_a_read_error() -> None:
    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await peer.wait_eof()

    async with upstream(handler) as up:
        client = UpstreamClient()
        with pytest.raises(UpstreamReadError, match="malformed"):
            await client.post(up.url(), b"{}", HEADERS, timeout_s=5.0)
        await eventually(lambda: up.peers[0].eof, "the client dropped the connection")
        await client.close()


async def stream_head(up: Upstream, peer: Peer) -> None:
    """Answers with a stream's head and one event, then holds the stream open."""
    head, frames = chunked([b"data: 1\n\n"])
    await up.recorded(peer)
    await peer.send(head + frames[0])
    await peer.wait_eof()


async def test_fail_wakes_a_pending_read() -> None:
    async with upstream(stream_head) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=None)
        assert await resp.read_chunk() == b"data: 1\n\n"
        reader = asyncio.create_task(resp.read_chunk())
        await eventually(lambda: resp._waiter is not None, "the read is pending")
        cut = UpstreamReadError("cut by the router's shutdown")
        resp.fail(cut)
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(UpstreamReadError) as caught:
                await reader
        assert caught.value is cut
        resp.close()
        await eventually(lambda: up.peers[0].eof, "the server saw the connection close")
        await client.close()


async def test_close_mid_stream_makes_the_server_see_eof() -> None:
    async with upstream(stream_head) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=None)
        await resp.read_chunk()
        resp.close()
        await eventually(lambda: up.peers[0].eof, "the server saw EOF (an engine aborts the request)")
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        with pytest.raises(UpstreamReadError):
            await resp.read_chunk()
        await client.close()


async def test_a_caller_cancelled_while_waiting_for_headers_leaves_nothing_open() -> None:
    async with upstream(silent) as up:
        client = UpstreamClient()
        task = asyncio.create_task(client.post(up.url(), b"{}", HEADERS, timeout_s=None))
        await eventually(lambda: len(up.requests) == 1, "the request reached the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: up.peers[0].eof, "the server saw the connection close")
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        await client.close()


async def test_a_caller_cancelled_during_a_read_leaves_nothing_open() -> None:
    async with upstream(stream_head) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=None)
        await resp.read_chunk()
        task = asyncio.create_task(resp.read_chunk())
        await eventually(lambda: resp._waiter is not None, "the read is pending")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: up.peers[0].eof, "the server saw the connection close")
        resp.release()
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (0, 0)
        await client.close()


async def test_client_close_wakes_a_pending_read() -> None:
    async with upstream(stream_head) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=None)
        await resp.read_chunk()
        reader = asyncio.create_task(resp.read_chunk())
        await eventually(lambda: resp._waiter is not None, "the read is pending")
        await client.close()
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(UpstreamReadError):
                await reader
        await eventually(lambda: up.peers[0].eof, "the server saw the connection close")


async def test_a_slow_reader_stops_the_socket_reads_and_memory_stays_bounded() -> None:
    total_bytes = 32 * 1024 * 1024
    piece = b"z" * 65536
    sent = [0]

    async def handler(up: Upstream, peer: Peer) -> None:
        await up.recorded(peer)
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total_bytes)
        while sent[0] < total_bytes:
            await peer.send(piece)  # drain() blocks once the client stops reading
            sent[0] += len(piece)
        await peer.wait_eof()

    async with upstream(handler) as up:
        client = UpstreamClient()
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=None)
        await eventually(lambda: resp.buffered_bytes > HIGH_WATER_BYTES, "the buffer filled")
        await asyncio.sleep(0.2)  # time for more reads to happen if the socket were still read
        bound_bytes = HIGH_WATER_BYTES + 1024 * 1024  # the mark plus what one socket read can add
        assert resp.buffered_bytes <= bound_bytes
        assert sent[0] < total_bytes  # the server is held back by TCP, not buffered here
        received = 0
        while chunk := await resp.read_chunk():
            assert set(chunk) == {ord("z")}
            received += len(chunk)
        assert received == total_bytes
        resp.release()
        assert client.pool_sizes()[("127.0.0.1", up.port)] == (1, 1)
        await client.close()


async def test_an_ended_answer_released_unread_past_the_mark_is_reused_reading() -> None:
    """The socket read that ended the message also crossed the high-water mark, so reading was paused;
    the connection must read again when it is reused."""

    async def handler(up: Upstream, peer: Peer) -> None:
        while await up.recorded(peer) is not None:
            await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"b" * 100)

    async with upstream(handler) as up:
        client = UpstreamClient(high_water_bytes=10)
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=5.0)
        await eventually(lambda: resp.buffered_bytes == 100, "the body arrived")
        resp.release()  # ended, never read
        resp = await client.post(up.url(), b"{}", HEADERS, timeout_s=5.0)
        assert await resp.read() == b"b" * 100
        resp.release()
        assert up.accepted == 1
        await client.close()


async def test_a_connect_that_ends_after_the_client_closed_is_dropped() -> None:
    async with upstream(silent) as up:
        client = UpstreamClient()
        task = asyncio.create_task(client.post(up.url(), b"{}", HEADERS, timeout_s=5.0))
        await asyncio.sleep(0)  # the connect is under way
        await client.close()
        with pytest.raises((UpstreamConnectError, UpstreamReadError)):
            await task
        await eventually(lambda: up.open == 0, "the server saw every connection close")
