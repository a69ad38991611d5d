"""Raw ASGI for the data path: the few request headers it reads, the body read once, answers sent as two
messages. The generation routes build no Starlette Request/Response objects (their wrappers and the
middleware stack cost ~20 % of a proxied request's CPU under py-spy: docs/bench.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from starlette.types import Receive, Scope, Send

from .errors import ApiError, error_body

Headers = list[tuple[bytes, bytes]]

# The request headers the data path reads (ASGI servers lower-case header names).
AUTHORIZATION: Final = "authorization"
CONTENT_LENGTH: Final = "content-length"
OUTPUT_HINT: Final = "x-kvrouter-output-hint"
_WANTED: Final = frozenset(name.encode() for name in (AUTHORIZATION, CONTENT_LENGTH, OUTPUT_HINT))
JSON_TYPE: Final = b"application/json"


class ClientLeft(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


def request_headers(scope: Scope) -> dict[str, str]:
    """The headers the data path reads, latin-1 decoded; the first of repeated names wins (as Starlette's
    ``Headers.get``)."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name in _WANTED:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"Request body exceeds {max_bytes} bytes.", code="request_too_large")


async def read_body(receive: Receive, declared: str | None, max_bytes: int) -> bytes:
    """The whole request body (usually one ASGI message, then no copy); 413 past ``max_bytes``."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    message = await receive()
    if message["type"] != "http.request":
        raise ClientLeft
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
        return body
    buf = bytearray(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientLeft
        buf += message.get("body", b"")
        if len(buf) > max_bytes:
            raise _too_large(max_bytes)
        if not message.get("more_body", False):
            return bytes(buf)


def encode_headers(headers: Mapping[str, str]) -> Headers:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def media_type(content_type: str) -> bytes:
    """As Starlette's Response: text types without a charset get utf-8."""
    if content_type.startswith("text/") and "charset=" not in content_type.lower():
        content_type += "; charset=utf-8"
    return content_type.encode("latin-1")


class Reply:
    """A whole answer, sent as ``http.response.start`` + one body message (Starlette's header order:
    given headers, then content-length, then content-type)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: Headers, content_type: bytes | None) -> None:
        self.status = status
        self.body = body
        headers.append((b"content-length", b"%d" % len(body)))
        if content_type is not None:
            headers.append((b"content-type", content_type))
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def error_reply(exc: ApiError) -> Reply:
    body = error_body(exc.status, exc.message, exc.code, exc.param)
    return Reply(exc.status, body, encode_headers(exc.headers), JSON_TYPE)
