"""The data path's HTTP/1.1 client to the engines (asyncio Protocol + httptools, keep-alive pools)."""

from .client import UpstreamClient
from .errors import UpstreamConnectError, UpstreamError, UpstreamReadError
from .response import HIGH_WATER_BYTES, UpstreamResponse

__all__ = [
    "HIGH_WATER_BYTES",
    "UpstreamClient",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamReadError",
    "UpstreamResponse",
]
