"""The data path's exchange straight on the asyncio transport (no ASGI messages, no per-request tasks but
the one serving it).

The HTTP protocol (router/gateway/protocol.py) feeds it the parser's callbacks (:meth:`feed`,
:meth:`message_complete`, :meth:`lost`); the proxy reads and answers through the :class:`Exchange`
methods. On the wire it answers as uvicorn's httptools protocol does: its default headers (server, date)
first, ``connection: close`` when the connection will close, a stream as chunked transfer-encoding. A
whole answer is one ``transport.write`` (head and body), a stream's head goes out with its first chunk,
each chunk is one write. Writes wait only while the transport is paused (the client's socket is backed
up), which bounds what a slow reader can make the router buffer.

It is duck-typed as uvicorn's ``RequestResponseCycle`` where uvicorn's protocol looks at ``self.cycle``
(``response_complete``, ``keep_alive``), so pipelining, ``shutdown()`` and the keep-alive timer stay
uvicorn's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.backends.base import Route

from .exchange import ClientLeft, Exchange, Headers, too_large

if TYPE_CHECKING:
    from .proxy import Proxy

# A body the answer did not need (e.g. refused with 401 or 413 first) is read and dropped up to this many
# bytes so the connection stays usable and the client reads the answer (closing with unread bytes makes
# the kernel reset the connection); past it the connection is closed.
DISCARD_LIMIT_BYTES = 1024 * 1024
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class DirectExchange(Exchange):
    __slots__ = (
        "_complete",
        "_declared",
        "_discarded",
        "_limit",
        "_overflow",
        "_parts",
        "_pending",
        "_proto",
        "_size",
        "_started",
        "_waiter",
        "disconnected",
        "keep_alive",
        "proxy",
        "response_complete",
        "route",
    )

    def __init__(
        self,
        proto: HttpToolsProtocol,
        proxy: Proxy,
        route: Route,
        headers: dict[str, str],
        keep_alive: bool,
        declared_bytes: int | None,
    ) -> None:
        super().__init__(headers)
        self.proxy = proxy
        self.route = route
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self._proto = proto
        self._declared = declared_bytes
        self._parts: list[bytes] = []
        self._size = 0
        self._limit: int | None = None  # known once the handler asks for the body
        self._overflow = False
        self._complete = False  # the request message (body) has ended
        self._waiter: asyncio.Future[None] | None = None
        self._started = False
        self._pending = b""  # a stream's head, sent with its first chunk
        self._discarded = 0

    # -- from the parser ---------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self.response_complete:  # answered already: drop what is left of the body, within bounds
            self._discarded += len(data)
            if self._discarded > DISCARD_LIMIT_BYTES:
                self._proto.transport.close()
            return
        if self._overflow:
            return
        self._size += len(data)
        if self._limit is not None and self._size > self._limit:
            self._overflow = True  # 413: keep none of it, read no more until the answer is out
            self._parts.clear()
            self._proto.flow.pause_reading()
            self._wake()
            return
        self._parts.append(data)
        if self._waiter is None and self._size > HIGH_WATER_LIMIT:
            self._proto.flow.pause_reading()  # nobody reads yet (a pipelined request): as uvicorn does

    def message_complete(self) -> None:
        self._complete = True
        self._wake()

    def lost(self) -> None:
        """The connection closed: wake a body read, cancel a watched task."""
        if self.response_complete:
            return
        self.disconnected = True
        self._wake()
        self._client_left()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- for the proxy -----------------------------------------------------------------------------------

    async def body(self, max_bytes: int) -> bytes:
        declared = self._declared
        if declared is not None and declared > max_bytes:
            if declared - self._size > DISCARD_LIMIT_BYTES:
                self.keep_alive = False  # too much to read and drop: answer, then close
            raise too_large(max_bytes)
        self._limit = max_bytes
        if self._size > max_bytes:
            self.feed(b"")  # the overflow path: drop the parts, stop reading
        while not (self._complete or self._overflow or self.disconnected):
            self._proto.flow.resume_reading()
            self._waiter = self._proto.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.disconnected:
            raise ClientLeft
        if self._overflow:
            raise too_large(max_bytes)
        parts = self._parts
        self._parts = []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.unwatch()
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        await self._writable()
        if not self.disconnected:
            self._proto.transport.write(self._head(status, headers, chunked=False) + body)
        self._done()

    async def start(self, status: int, headers: Headers) -> None:
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        self._pending = self._head(status, headers, chunked=True)

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        await self._writable()
        if not self.disconnected:
            self._proto.transport.write(b"".join((self._pending, b"%x\r\n" % len(chunk), chunk, b"\r\n")))
            self._pending = b""

    async def end(self, chunk: bytes = b"") -> None:
        self.unwatch()
        await self._writable()
        if not self.disconnected:
            framed = (b"%x\r\n" % len(chunk), chunk, b"\r\n") if chunk else ()
            self._proto.transport.write(b"".join((self._pending, *framed, _LAST_CHUNK)))
            self._pending = b""
        self._done()

    def watch(self) -> None:
        super().watch()
        if self.disconnected:  # gone before the watch began: as the ASGI listener would see at once
            self._client_left()

    # -- for the protocol --------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    def fail(self) -> None:
        """The handler raised: a plain 500 if nothing was sent yet (as uvicorn), and the connection closes."""
        transport = self._proto.transport
        if not self._started and not self.disconnected and not transport.is_closing():
            self._started = True
            body = b"Internal Server Error"
            headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")]
            self.keep_alive = False
            transport.write(self._head(500, headers, chunked=False) + body)
        self.response_complete = True
        transport.close()

    # -- internals ---------------------------------------------------------------------------------------

    async def _writable(self) -> None:
        flow = self._proto.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()  # the transport's buffer is past its high-water mark: the client is slow

    def _head(self, status: int, headers: Headers, chunked: bool) -> bytes:
        parts = [STATUS_LINE[status]]
        for name, value in self._proto.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(_CLOSE)
        if chunked:
            parts.append(_CHUNKED)
        parts.append(b"\r\n")
        return b"".join(parts)

    def _done(self) -> None:
        self.response_complete = True
        if self.disconnected:
            return
        proto = self._proto
        if not self.keep_alive:
            proto.transport.close()
        # Resumes reading (what is left of an unread body is dropped by feed), then starts the next
        # pipelined request or arms the keep-alive timer.
        proto.on_response_complete()
