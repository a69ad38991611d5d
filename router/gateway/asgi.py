"""The data path's exchange over raw ASGI: the body read once, answers sent as two messages.

Used when the app runs under an ASGI server other than the gateway's own protocol (router/gateway/
protocol.py), and by the FastAPI generation routes. The generation routes build no Starlette
Request/Response objects (their wrappers and the middleware stack cost ~20 % of a proxied request's CPU
under py-spy: docs/bench.md).

A client that goes away is noticed by a listener task awaiting ``receive`` (uvicorn's ``send`` silently
drops data for a closed connection, so only ``receive`` tells).
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope, Send

from .exchange import CONTENT_LENGTH, ClientLeft, Exchange, Headers, too_large, wanted_headers


async def read_body(receive: Receive, declared: str | None, max_bytes: int) -> bytes:
    """The whole request body (usually one ASGI message, then no copy); 413 past ``max_bytes``."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    message = await receive()
    if message["type"] != "http.request":
        raise ClientLeft
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > max_bytes:
            raise too_large(max_bytes)
        return body
    buf = bytearray(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientLeft
        buf += message.get("body", b"")
        if len(buf) > max_bytes:
            raise too_large(max_bytes)
        if not message.get("more_body", False):
            return bytes(buf)


class AsgiExchange(Exchange):
    __slots__ = ("_listener", "_receive", "_send")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        super().__init__(wanted_headers(scope["headers"]))
        self._receive = receive
        self._send = send
        self._listener: asyncio.Task[None] | None = None

    async def body(self, max_bytes: int) -> bytes:
        return await read_body(self._receive, self.headers.get(CONTENT_LENGTH), max_bytes)

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.unwatch()
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, chunk: bytes = b"") -> None:
        self.unwatch()  # the last send completes the response, after which uvicorn reports "disconnect"
        await self._send({"type": "http.response.body", "body": chunk, "more_body": False})

    def watch(self) -> None:
        super().watch()
        self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            message: Message = await self._receive()
            if message["type"] == "http.disconnect":
                self._client_left()
                return

    def unwatch(self) -> None:
        super().unwatch()
        if self._listener is not None:
            self._listener.cancel()
            self._listener = None
