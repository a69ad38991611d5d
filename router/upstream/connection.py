"""One kept-alive HTTP/1.1 connection to an engine: an asyncio Protocol around httptools' response parser.

One exchange at a time (no pipelining). The parser is created once per connection and parses every
response on it; its callbacks hand the status, headers and decoded body pieces to the current
:class:`UpstreamResponse`. A body with neither Content-Length nor chunked encoding ends when the engine
closes the connection (httptools has no "finish" call, so :meth:`connection_lost` completes it).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import httptools

from .errors import UpstreamReadError

if TYPE_CHECKING:
    from .pool import Pool
    from .response import UpstreamResponse

_NO_BODY_STATUSES = (204, 304)


class Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self.high_water_bytes = pool.high_water_bytes
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.paused = False
        self.keep_alive = False
        self.reused = False  # served a response before: a failure with no byte may be the keep-alive race
        self.idle_since_s = 0.0
        self.pooled = False  # in its pool's idle list
        self._interim = False  # a 1xx answer is being parsed: the real one follows
        self._framed = False  # Content-Length or chunked: the body does not end at EOF

    # -- asyncio.Protocol --------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes nobody asked for on an idle connection: it is out of step, drop it
            self.close()
            return
        resp.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp.on_error(UpstreamReadError(f"malformed HTTP response: {exc}"))
            self.close()
            return
        resp.after_feed()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.lost(self)
        resp = self.response
        if resp is None:
            return
        if resp.status and not self._framed and exc is None and not self._interim:
            resp.on_complete()  # the body was delimited by the close
            self.keep_alive = False
            resp.after_feed()
            return
        reason = f"connection lost: {exc!r}" if exc is not None else "the engine closed the connection"
        resp.on_error(UpstreamReadError(reason))

    # -- httptools callbacks -----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        resp = self.response
        if resp is not None and resp.status:  # a second answer to one request: the stream is out of step
            raise UpstreamReadError("unexpected bytes after the response")
        self._framed = False
        if resp is not None:
            resp.headers = []  # drops a 1xx answer's headers

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp.headers.append((name, value))
            lowered = name.lower()
            if lowered == b"content-length":
                self._framed = True  # else the body ends when the engine closes
            elif lowered == b"transfer-encoding" and b"chunked" in value.lower():
                self._framed = True

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._interim = True
            return
        if status in _NO_BODY_STATUSES:
            self._framed = True
        self.keep_alive = self._parser.should_keep_alive()
        resp.status = status

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp.on_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        resp = self.response
        if resp is not None:
            resp.on_complete()

    # -- the client's side -------------------------------------------------------------------------------

    def send(self, response: UpstreamResponse, data: bytes) -> None:
        self.response = response
        assert self.transport is not None
        self.transport.write(data)

    def pause(self) -> None:
        if not self.closed and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def recycle(self) -> None:
        """The response ended and was released: idle again, back to the pool."""
        self.response = None
        self.reused = True
        if self.paused:  # the last read filled the buffer past the mark and ended the message
            self.resume()
        self._pool.put(self)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pool.lost(self)
        if self.transport is not None:
            self.transport.close()
