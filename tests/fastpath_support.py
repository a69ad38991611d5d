"""Helpers for the protocol fast-path tests (no tests here): a raw HTTP/1.1 client on one connection, and
the gateway protocol with a record of which requests it served itself."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import orjson

from router.gateway.protocol import GatewayHttpProtocol

Response = tuple[int, list[tuple[str, str]], bytes]


class Recording(GatewayHttpProtocol):
    """The gateway protocol, counting the requests it took off the ASGI cycle, keeping its connections,
    and with a small kernel send buffer when ``small_sndbuf`` (so a slow reader backs up the transport)."""

    direct: ClassVar[int] = 0
    protocols: ClassVar[list[Recording]] = []
    small_sndbuf: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        type(self).protocols.append(self)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.small_sndbuf:
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        super().connection_made(transport)

    def _intercept(self) -> bool:
        taken = super()._intercept()
        type(self).direct += taken
        return taken


def recording(**attrs: Any) -> type[Recording]:
    """A fresh subclass (its own counters), with class attributes overridden (e.g. head_timeout_s)."""
    return type("Recording", (Recording,), {"direct": 0, "protocols": [], **attrs})


def post(path: str, body: dict[str, Any], *, version: str = "1.1", extra: str = "") -> bytes:
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{extra}\r\n"
    )
    return head.encode() + data


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One response: status, headers in order (names lower-cased), body (chunked decoded)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = [(k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:] if line)]
    found = dict(headers)
    if "content-length" in found:
        return status, headers, await reader.readexactly(int(found["content-length"]))
    if found.get("transfer-encoding") != "chunked":
        return status, headers, await reader.read()
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        body += (await reader.readexactly(size + 2))[:-2]
        if size == 0:
            return status, headers, bytes(body)


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body (after its head was read)."""
    size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
    return (await reader.readexactly(size + 2))[:-2]


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    pairs = (line.split(":", 1) for line in lines[1:] if line)
    return int(lines[0].split()[1]), {k.lower(): v.strip() for k, v in pairs}


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@contextlib.contextmanager
def raw_socket(url: str, rcvbuf_bytes: int | None = None) -> Iterator[socket.socket]:
    """A non-blocking socket for ``loop.sock_*``; a small receive buffer is set before connect, so the
    window is small from the start."""
    sock = socket.socket()
    try:
        if rcvbuf_bytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
        sock.setblocking(False)
        yield sock
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(*address(url), limit=1 << 20)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
