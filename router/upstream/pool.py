"""Kept-alive connections to one origin (host, port).

Idle connections are reused last-in first-out, so a burst's extra connections sit at the old end and age
out (``idle_timeout_s``, swept by one timer while any is idle). A connection the engine closes while idle
leaves the pool at once (its protocol's ``connection_lost``).
"""

from __future__ import annotations

import asyncio
from collections import deque

from .connection import Connection


class Pool:
    def __init__(
        self,
        host: str,
        port: int,
        loop: asyncio.AbstractEventLoop,
        max_idle: int,
        idle_timeout_s: float,
        high_water_bytes: int,
    ) -> None:
        self.host = host
        self.port = port
        self._loop = loop
        self._max_idle = max_idle
        self._idle_timeout_s = idle_timeout_s
        self.high_water_bytes = high_water_bytes
        self.closed = False
        self.idle: deque[Connection] = deque()
        self.open: set[Connection] = set()  # idle and busy
        self._sweep: asyncio.TimerHandle | None = None

    async def connect(self, timeout_s: float) -> Connection:
        """A new connection; ``TimeoutError`` or ``OSError`` as asyncio raises them."""
        async with asyncio.timeout(timeout_s):
            _, conn = await self._loop.create_connection(lambda: Connection(self), self.host, self.port)
        if self.closed:  # the client closed while this connect was under way
            conn.close()
            raise ConnectionAbortedError("the upstream client is closed")
        if conn.closed:  # lost between connect and now (no lost() then: it was not counted yet)
            raise ConnectionResetError("closed right after connecting")
        self.open.add(conn)
        return conn

    def take_idle(self) -> Connection | None:
        idle = self.idle
        while idle:
            conn = idle.pop()
            conn.pooled = False
            transport = conn.transport
            if not conn.closed and transport is not None and not transport.is_closing():
                return conn
            conn.close()
        return None

    def put(self, conn: Connection) -> None:
        if conn.closed:
            return
        if self.closed or len(self.idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since_s = self._loop.time()
        conn.pooled = True
        self.idle.append(conn)
        if self._sweep is None:
            self._sweep = self._loop.call_later(self._idle_timeout_s, self._expire)

    def lost(self, conn: Connection) -> None:
        """The connection closed (either side): it leaves the pool."""
        self.open.discard(conn)
        if conn.pooled:
            conn.pooled = False
            self.idle.remove(conn)

    def _expire(self) -> None:
        self._sweep = None
        oldest_kept_s = self._loop.time() - self._idle_timeout_s
        idle = self.idle
        while idle and idle[0].idle_since_s <= oldest_kept_s:
            conn = idle.popleft()
            conn.pooled = False
            conn.close()
        if idle:  # next sweep when the oldest one left would expire
            self._sweep = self._loop.call_at(idle[0].idle_since_s + self._idle_timeout_s, self._expire)

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in self.idle:
            conn.pooled = False
        self.idle.clear()
        for conn in list(self.open):
            conn.close()
