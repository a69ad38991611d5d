"""A scripted HTTP/1.1 server on 127.0.0.1 for the upstream client's tests (no tests here).

Each accepted connection runs the test's handler with a :class:`Peer` (read one request, write raw bytes,
wait for the client's EOF), so every case is exact to the byte: chunk boundaries, early closes, silence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

WAIT_BOUND_S = 10.0  # every wait on a condition gives up (and fails) after this


class Peer:
    """The server's end of one connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.eof = False

    async def request(self) -> tuple[bytes, bytes] | None:
        """The next request's head and body; None when the client closed the connection."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof = True
            return None
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await self.reader.readexactly(length)
        return head, body

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def wait_eof(self) -> None:
        """Until the client closes its end (b"" or a reset)."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self.eof = True


Handler = Callable[[Peer], Awaitable[None]]


class Upstream:
    """Counts connections: ``accepted`` ever, ``open`` now (closed by either side), and the requests seen."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.accepted = 0
        self.open = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.peers: list[Peer] = []
        self.port = 0

    def url(self, path: str = "/v1/chat/completions") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        peer = Peer(reader, writer)
        self.peers.append(peer)
        try:
            await self._handler(peer)
            # the handler is done: wait for the client to close, unless this side closes (handler said so)
            if not writer.is_closing():
                await peer.wait_eof()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.open -= 1

    async def recorded(self, peer: Peer) -> tuple[bytes, bytes] | None:
        req = await peer.request()
        if req is not None:
            self.requests.append(req)
        return req


@contextlib.asynccontextmanager
async def upstream(handler: Callable[[Upstream, Peer], Awaitable[None]]) -> AsyncIterator[Upstream]:
    box: list[Upstream] = []

    async def run(peer: Peer) -> None:
        await handler(box[0], peer)

    up = Upstream(run)
    box.append(up)
    server = await asyncio.start_server(up._on_connection, "127.0.0.1", 0)
    up.port = server.sockets[0].getsockname()[1]
    try:
        yield up
    finally:
        server.close()
        for peer in up.peers:
            peer.writer.close()
        await server.wait_closed()


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``predicate()`` holds; fail naming ``what`` if it never does."""
    loop = asyncio.get_running_loop()
    give_up_s = loop.time() + WAIT_BOUND_S
    while not predicate():
        if loop.time() > give_up_s:
            pytest.fail(f"never happened: {what}")
        await asyncio.sleep(0.005)


def json_answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
        % (status.encode(), len(body), extra)
        + body
    )


def chunked(pieces: list[bytes], content_type: bytes = b"text/event-stream") -> tuple[bytes, list[bytes]]:
    """A chunked response's head, and each piece framed as one chunk (the last one ends the body)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % content_type
    frames = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]
    frames.append(b"0\r\n\r\n")
    return head, frames


def keep_answering(body: bytes) -> Callable[[Upstream, Peer], Awaitable[None]]:
    """A handler answering every request on the connection with ``body`` (keep-alive)."""

    async def handler(up: Upstream, peer: Peer) -> None:
        while await up.recorded(peer) is not None:
            await peer.send(json_answer(body))

    return handler


BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]
