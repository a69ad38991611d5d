"""One upstream answer: status and headers, then the body as the connection delivers it.

The connection's protocol feeds the response (``on_body``, ``on_complete``, ``on_error``) and wakes one
pending read per socket read (``after_feed``), so a reader gets whatever arrived at once, joined. Past the
high-water mark the connection stops reading the socket until the reader drains the buffer: a slow
consumer bounds memory instead of growing it. The whole exchange has one deadline (``timeout_s``, like
aiohttp's ``ClientTimeout(total=...)``), cancelled once the message is complete.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .errors import UpstreamReadError

if TYPE_CHECKING:
    from .connection import Connection

HIGH_WATER_BYTES = 256 * 1024  # unread body past which the socket is no longer read
_UNBOUNDED_BYTES = 1 << 62  # read(): the caller wants the whole body in memory anyway


class UpstreamResponse:
    __slots__ = (
        "_buf",
        "_buffered_bytes",
        "_conn",
        "_done",
        "_exc",
        "_high_water_bytes",
        "_loop",
        "_released",
        "_timer",
        "_waiter",
        "got_bytes",
        "headers",
        "status",
    )

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, deadline_s: float | None) -> None:
        self._conn = conn
        self._loop = loop
        self.status = 0  # 0 until the status line and headers are complete
        self.headers: list[tuple[bytes, bytes]] = []  # as received (names in the engine's case)
        self.got_bytes = False  # any response byte arrived (a reused connection is retried only without)
        self._buf: list[bytes] = []
        self._buffered_bytes = 0
        self._done = False  # the message is complete (every body byte is in the buffer or was read)
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False
        self._high_water_bytes = conn.high_water_bytes
        self._timer = None if deadline_s is None else loop.call_at(deadline_s, self._deadline_passed)

    # -- the caller's side -------------------------------------------------------------------------------

    @property
    def content_type(self) -> str:
        """The Content-Type header, or "" if the engine sent none."""
        return self.header("content-type") or ""

    def header(self, name: str) -> str | None:
        """The first header of that name (case-insensitive), decoded as latin-1."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None

    @property
    def buffered_bytes(self) -> int:
        """Body bytes received and not read yet."""
        return self._buffered_bytes

    @property
    def at_eof(self) -> bool:
        """The body ended and every byte of it was read."""
        return self._done and not self._buf

    async def read_chunk(self) -> bytes:
        """The next body bytes as they arrived (chunked encoding decoded); b"" at the end."""
        while True:
            if self._exc is not None:
                raise self._exc
            buf = self._buf
            if buf:
                data = buf[0] if len(buf) == 1 else b"".join(buf)
                buf.clear()
                self._buffered_bytes = 0
                if self._conn.paused:
                    self._conn.resume()
                return data
            if self._done:
                return b""
            await self._wait()

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; with ``max_bytes``, at most that many bytes (an error's detail)."""
        self._high_water_bytes = _UNBOUNDED_BYTES
        if self._conn.paused:
            self._conn.resume()
        while not self._done and (max_bytes is None or self._buffered_bytes < max_bytes):
            if self._exc is not None:
                raise self._exc
            await self._wait()
        if self._exc is not None:
            raise self._exc
        data = b"".join(self._buf)
        self._buf.clear()
        self._buffered_bytes = 0
        if max_bytes is not None and len(data) > max_bytes:
            self._buf.append(data[max_bytes:])
            self._buffered_bytes = len(data) - max_bytes
            data = data[:max_bytes]
        return data

    def fail(self, exc: BaseException) -> None:
        """Make the pending read (and every later one) raise ``exc``; the caller still closes."""
        if self._exc is None:
            self._exc = exc
        self._wake()

    def release(self) -> None:
        """Done with this response: the connection goes back to the pool if the message was received to its
        end and the engine allows keep-alive, else it is closed."""
        if self._released:
            return
        self._released = True
        self._cancel_timer()
        conn = self._conn
        if self._done and self._exc is None and conn.keep_alive and not conn.closed:
            self._buf.clear()
            conn.recycle()
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection (an engine aborts a request whose connection closes)."""
        self._released = True
        self._cancel_timer()
        if self._exc is None and not self._done:
            self._exc = UpstreamReadError("the response was closed before its end")
        self._wake()
        self._conn.close()

    # -- the connection's side ---------------------------------------------------------------------------

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        except asyncio.CancelledError:
            self.close()  # the reader left mid-response: the connection cannot be reused
            raise
        finally:
            self._waiter = None

    async def wait_headers(self) -> None:
        while not self.status:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, data: bytes) -> None:
        self._buf.append(data)
        self._buffered_bytes += len(data)

    def after_feed(self) -> None:
        """One socket read was parsed: wake the reader once, and stop reading past the high-water mark."""
        self._wake()
        if self._buffered_bytes > self._high_water_bytes and not self._conn.paused:
            self._conn.pause()

    def on_complete(self) -> None:
        self._done = True
        self._cancel_timer()

    def on_error(self, exc: BaseException) -> None:
        if self._exc is None and not self._done:
            self._exc = exc
        self._wake()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline_passed(self) -> None:
        self._timer = None
        if self._done:
            return
        if self._exc is None:
            self._exc = TimeoutError("the upstream did not answer within the request timeout")
        self._wake()
        self._conn.close()
