"""The data path's view of one HTTP exchange, whatever serves it: raw ASGI or the HTTP protocol itself.

The proxy reads three request headers and the body once, then answers either whole (:meth:`respond`) or
as a stream (:meth:`start`, :meth:`write` per chunk, :meth:`end`). While the request is watched
(:meth:`watch` .. :meth:`unwatch`) a client that goes away cancels the task serving it; after the
``CancelledError``, :meth:`absorb` tells whether that was the client (then the cancel is undone) or
something else (shutdown), which must propagate.

Two implementations: :class:`~router.gateway.asgi.AsgiExchange` (any ASGI server, the FastAPI routes) and
:class:`~router.gateway.direct.DirectExchange` (the asyncio transport, from the HTTP parser's callbacks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Final

from .errors import ApiError, error_body

Headers = list[tuple[bytes, bytes]]

# The request headers the data path reads (lower-case, as ASGI servers and the parser give them).
AUTHORIZATION: Final = "authorization"
CONTENT_LENGTH: Final = "content-length"
OUTPUT_HINT: Final = "x-kvrouter-output-hint"
WANTED: Final = frozenset(name.encode() for name in (AUTHORIZATION, CONTENT_LENGTH, OUTPUT_HINT))
JSON_TYPE: Final = b"application/json"


class ClientLeft(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"Request body exceeds {max_bytes} bytes.", code="request_too_large")


def wanted_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers the data path reads, latin-1 decoded; the first of repeated names wins (as Starlette's
    ``Headers.get``)."""
    found: dict[str, str] = {}
    for name, value in raw:
        if name in WANTED:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


class Exchange:
    """One request and its answer; subclasses move the bytes."""

    __slots__ = ("_armed", "_task", "gone", "headers")

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers  # only the WANTED names
        self.gone = False  # the client left while watched
        self._task: asyncio.Task[object] | None = None
        self._armed = False

    async def body(self, max_bytes: int) -> bytes:
        """The whole request body; 413 past ``max_bytes``, :class:`ClientLeft` if the client went away."""
        raise NotImplementedError

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole answer (``headers`` carry content-length); silently dropped for a client that left."""
        raise NotImplementedError

    async def start(self, status: int, headers: Headers) -> None:
        """Begins a streamed answer (no content-length: chunked on HTTP/1.1)."""
        raise NotImplementedError

    async def write(self, chunk: bytes) -> None:
        """One chunk of a streamed answer; waits only while the client's socket is backed up."""
        raise NotImplementedError

    async def end(self, chunk: bytes = b"") -> None:
        """The last chunk (may be empty); the watch ends first (the answer is complete)."""
        raise NotImplementedError

    def watch(self) -> None:
        """From now on a client that leaves cancels the current task."""
        self._task = asyncio.current_task()
        self._armed = True

    def unwatch(self) -> None:
        self._armed = False

    def absorb(self) -> bool:
        """After a CancelledError: True (and the cancel undone) if it was ours, i.e. the client left."""
        if not self.gone or self._task is None:
            return False
        self._task.uncancel()
        return True

    def _client_left(self) -> None:
        if self._armed and self._task is not None and not self.gone:
            self.gone = True
            self._task.cancel()


def encode_headers(headers: Mapping[str, str]) -> Headers:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def media_type(content_type: str) -> bytes:
    """As Starlette's Response: text types without a charset get utf-8."""
    if content_type.startswith("text/") and "charset=" not in content_type.lower():
        content_type += "; charset=utf-8"
    return content_type.encode("latin-1")


class Reply:
    """A whole answer (Starlette's header order: given headers, then content-length, then content-type)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: Headers, content_type: bytes | None) -> None:
        self.status = status
        self.body = body
        headers.append((b"content-length", b"%d" % len(body)))
        if content_type is not None:
            headers.append((b"content-type", content_type))
        self.headers = headers

    async def __call__(self, exchange: Exchange) -> None:
        await exchange.respond(self.status, self.headers, self.body)


def error_reply(exc: ApiError) -> Reply:
    body = error_body(exc.status, exc.message, exc.code, exc.param)
    return Reply(exc.status, body, encode_headers(exc.headers), JSON_TYPE)
