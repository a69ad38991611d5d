"""Request-head limits at the HTTP parser, before anything reaches the app.

uvicorn's httptools protocol buffers a request head of any size (an 8 MB header or 20,000 headers are
accepted and handed to the app) and waits for a trickled head forever. :func:`limited_http_protocol`
is a subclass that answers **431** (JSON error body) once a head grows past ``max_head_bytes`` and
closes a connection whose head is not complete within ``head_timeout_s`` (slowloris), so neither memory
nor connections are held by a client that never finishes a request. Bodies are limited in the app
(``max_body_bytes``, 413), where the route is known.

The head limit comes from ``uvicorn.Config(h11_max_incomplete_event_size=...)`` (uvicorn's name for the
same limit under h11), so the class can be named by import string for ``--workers N``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import error_body


def _raw_response(status_line: bytes, body: bytes) -> bytes:
    head = (
        status_line + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    return head + body


class HeadTooLarge(Exception):
    """Raised from a parser callback; httptools turns it into a parse error, answered 431."""


class HeadLimitedHttpTools(HttpToolsProtocol):
    """httptools with a bound on request-head bytes and on the time a head may take to arrive."""

    max_head_bytes = 64 * 1024
    head_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own name for a head limit (h11's); set from Settings.max_header_bytes by `kvrouter serve`
        self.max_head_bytes = self.config.h11_max_incomplete_event_size or self.max_head_bytes
        self._head_bytes: int | None = 0  # None while a body (not a head) is being received
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads_done = 0
        self._head_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # uvicorn times out idle keep-alive, not a new connection that sends nothing

    def data_received(self, data: bytes) -> None:
        in_head = self._head_bytes is not None
        if in_head:
            self._arm_head_timer()
        heads = self._heads_done
        super().data_received(data)
        # Count only chunks in which no head completed: such a chunk is all head bytes (a chunk that
        # completed a head is within the limit by construction, and may carry body bytes).
        if in_head and heads == self._heads_done and self._head_bytes is not None:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._reject(b"HTTP/1.1 431 Request Header Fields Too Large", 431, "request_header_too_large")

    def on_headers_complete(self) -> None:
        self._heads_done += 1
        self._head_bytes = None
        self._cancel_head_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_head_bytes:  # a head that arrived whole in one read
            self._head_too_large = True
            raise HeadTooLarge  # the parser reports it as a parse error: see send_400_response
        if not self._intercept():
            super().on_headers_complete()

    def _intercept(self) -> bool:
        """A subclass may serve the request itself (router/gateway/protocol.py); False: uvicorn's ASGI."""
        return False

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._reject(b"HTTP/1.1 431 Request Header Fields Too Large", 431, "request_header_too_large")
        else:
            super().send_400_response(msg)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._next_head()

    def _next_head(self) -> None:
        self._head_bytes = 0  # what arrives next is a new request head

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_bytes is None:
            return
        if self._responding():
            self._arm_head_timer()  # a pipelined head behind a long stream: judge it once the stream ends
            return
        self._reject(b"HTTP/1.1 408 Request Timeout", 408, "request_timeout")

    def _reject(self, status_line: bytes, status: int, code: str) -> None:
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        if self._responding():  # never write an error into the middle of another response
            self.transport.close()
            return
        message = (
            f"Request head larger than {self.max_head_bytes} bytes."
            if status == 431
            else f"Request head not received within {self.head_timeout_s:g} s."
        )
        self.transport.write(_raw_response(status_line, error_body(status, message, code)))
        self.transport.close()


# for uvicorn.Config(http=...): these limits plus the generation POSTs served off the ASGI cycle
HTTP_PROTOCOL = "router.gateway.protocol:GatewayHttpProtocol"


def limited_http_protocol(head_timeout_s: float) -> type[HeadLimitedHttpTools]:
    """The gateway's protocol with another head timeout (tests; the default suits production)."""
    from .protocol import GatewayHttpProtocol  # it builds on this module

    return type("GatewayHttpProtocol", (GatewayHttpProtocol,), {"head_timeout_s": head_timeout_s})
