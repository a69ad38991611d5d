"""A lean HTTP/1.1 client for the data path: POST a JSON body to an engine, get its answer as it arrives.

Why not aiohttp: per proxied request its ``ClientSession._request`` (tracing hooks, cookie and header
machinery, the connector's bookkeeping, response and stream-reader objects) was ~25 % of the router's
Python time. This client does only what the router needs: one cached head prefix per URL, one write per
request, httptools for parsing, a LIFO keep-alive pool per origin, and no task of its own.
"""

from __future__ import annotations

import asyncio

from .connection import Connection
from .errors import UpstreamConnectError, UpstreamReadError
from .pool import Pool
from .response import HIGH_WATER_BYTES, UpstreamResponse
from .target import Target, encode_request, parse_target


class UpstreamClient:
    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        max_idle_per_origin: int = 256,
        idle_timeout_s: float = 60.0,
        high_water_bytes: int = HIGH_WATER_BYTES,
    ) -> None:
        self._high_water_bytes = high_water_bytes
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_origin
        self._idle_timeout_s = idle_timeout_s
        self._targets: dict[str, tuple[Target, Pool]] = {}
        self._pools: dict[tuple[str, int], Pool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def post(
        self,
        url: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Send the request and return once the response's status and headers arrived.

        ``timeout_s`` bounds the whole exchange (connect, headers and body, like aiohttp's total timeout):
        past it, this call or the response's next read raises ``TimeoutError`` and the connection is
        dropped. Raises :class:`UpstreamConnectError` when no connection could be made and
        :class:`UpstreamReadError` when it broke before the headers.
        """
        if self._closed:
            raise RuntimeError("the upstream client is closed")
        entry = self._targets.get(url)
        if entry is None:
            entry = self._add_target(url)
        target, pool = entry
        data = encode_request(target.prefix, headers, body)
        loop = self._loop
        assert loop is not None
        deadline_s = None if timeout_s is None else loop.time() + timeout_s
        conn = pool.take_idle()
        if conn is None:
            conn = await self._connect(pool, deadline_s)
        while True:
            resp = UpstreamResponse(conn, loop, deadline_s)
            try:
                conn.send(resp, data)
                await resp.wait_headers()
                return resp
            except UpstreamReadError:
                resp.close()
                if not conn.reused or resp.got_bytes:
                    raise
                # The engine closed this idle connection as the request went out (the keep-alive race):
                # no byte came back, so the request never reached it. Once more on a new connection.
            except BaseException:
                resp.close()  # cancelled (the client left) or timed out: the connection cannot be reused
                raise
            conn = await self._connect(pool, deadline_s)

    async def close(self) -> None:
        """Close every connection, idle or busy (a pending read raises UpstreamReadError)."""
        self._closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._targets.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run

    def pool_sizes(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Per origin: (idle, open) connections, open counting busy ones too."""
        return {origin: (len(pool.idle), len(pool.open)) for origin, pool in self._pools.items()}

    def _add_target(self, url: str) -> tuple[Target, Pool]:
        target = parse_target(url)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        pool = self._pools.get(target.origin)
        if pool is None:
            pool = self._pools[target.origin] = Pool(
                target.host,
                target.port,
                self._loop,
                self._max_idle,
                self._idle_timeout_s,
                self._high_water_bytes,
            )
        entry = self._targets[url] = (target, pool)
        return entry

    async def _connect(self, pool: Pool, deadline_s: float | None) -> Connection:
        assert self._loop is not None
        limit_s = self._connect_timeout_s
        total_bound = False  # the exchange's deadline comes before the connect timeout
        if deadline_s is not None and deadline_s - self._loop.time() <= limit_s:
            limit_s = deadline_s - self._loop.time()
            total_bound = True
        where = f"{pool.host}:{pool.port}"
        try:
            if limit_s <= 0:
                raise TimeoutError
            return await pool.connect(limit_s)
        except TimeoutError:  # before OSError: TimeoutError is one
            if total_bound:
                raise TimeoutError("the upstream did not answer within the request timeout") from None
            raise UpstreamConnectError(f"connect to {where}: timed out after {limit_s:g} s") from None
        except OSError as exc:
            what = f"{type(exc).__name__}: {exc.strerror or exc}"
            raise UpstreamConnectError(f"connect to {where}: {what}") from None
