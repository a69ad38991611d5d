"""What the upstream client raises besides ``TimeoutError`` (the exchange's total deadline passed)."""

from __future__ import annotations


class UpstreamError(Exception):
    """Base of the client's own errors."""


class UpstreamConnectError(UpstreamError):
    """No connection: refused, unreachable, or the connect timeout passed. The request never left: safe to
    retry on another rank."""


class UpstreamReadError(UpstreamError):
    """The connection was lost, or the answer did not parse as HTTP/1.1, before the response ended."""
