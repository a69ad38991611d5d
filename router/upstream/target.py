"""Upstream URLs, parsed once: the origin a connection pool serves and the request head's fixed prefix."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

_CONTENT_LENGTH = b"content-length: "
_HEAD_END = b"\r\n\r\n"
_SEP = b": "
_CRLF = b"\r\n"


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    path: str
    prefix: bytes  # "POST <path> HTTP/1.1\r\nhost: <host:port>\r\n"

    @property
    def origin(self) -> tuple[str, int]:
        return (self.host, self.port)


def parse_target(url: str) -> Target:
    """``http://host[:port]/path[?query]`` only: the engines speak plain HTTP on the cluster network."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        raise ValueError(f"{url}: https upstreams are not supported (the engines serve plain HTTP)")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url}: not an http://host:port/path URL")
    if parts.username or parts.password or parts.fragment:
        raise ValueError(f"{url}: credentials and fragments are not supported in an upstream URL")
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname
    authority = f"[{host}]" if ":" in host else host  # an IPv6 literal keeps its brackets in Host
    prefix = f"POST {path} HTTP/1.1\r\nhost: {authority}:{port}\r\n".encode("ascii")
    return Target(host, port, path, prefix)


def encode_request(prefix: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """Head and body as one buffer (one write, one segment for a small request)."""
    parts = [prefix]
    for name, value in headers:
        if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
            raise ValueError(f"header {name!r} holds a line break")
        parts += (name, _SEP, value, _CRLF)
    parts += (_CONTENT_LENGTH, b"%d" % len(body), _HEAD_END, body)
    return b"".join(parts)
