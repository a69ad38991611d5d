"""The admission queue: a bounded FIFO of requests waiting for KV room, each with its own deadline.

Strictly first come, first served: only the head tries to place itself (a large request is not starved by
small ones slipping past it), and a newcomer queues behind existing waiters rather than jumping them. The
head is woken on every release (``wake``) and polls at ``poll_s`` for room freed elsewhere (other router
replicas, engine telemetry, lease expiry). Each waiter places itself in its own task, so a waiter that is
cancelled (client gone, shutdown) can never leave a reservation behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """More waiters than ``max_waiting``: refuse now (429)."""


class QueueTimeout(Exception):
    """The deadline passed before room appeared (503)."""


class QueueClosed(Exception):
    """Admission is closed (the router is shutting down): refuse (503)."""


class WaitQueue:
    def __init__(self, max_waiting: int, timeout_s: float, poll_s: float = 0.05) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._waiters: deque[asyncio.Event] = deque()
        self.closed = False

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def wake(self) -> None:
        """Room may have appeared: let the head try again."""
        if self._waiters:
            self._waiters[0].set()

    def close(self) -> None:
        """Refuse every request from now on, those already waiting included (shutdown)."""
        self.closed = True
        for event in self._waiters:
            event.set()

    async def admit(self, attempt: Callable[[], Awaitable[T | None]]) -> T:
        """Run ``attempt`` now if nobody waits, else (or when it finds no room) wait in line and retry.

        ``attempt`` returns None for "no room now" and may raise to refuse outright.
        """
        if self.closed:
            raise QueueClosed
        if not self._waiters:
            got = await attempt()
            if got is not None:
                return got
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull
        deadline_s = time.monotonic() + self.timeout_s
        event = asyncio.Event()
        self._waiters.append(event)
        try:
            while True:
                if self.closed:
                    raise QueueClosed
                head = self._waiters[0] is event
                if head:
                    got = await attempt()
                    if got is not None:
                        return got
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise QueueTimeout
                event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        event.wait(), min(remaining_s, self.poll_s) if head else remaining_s
                    )
        finally:
            was_head = self._waiters[0] is event
            self._waiters.remove(event)
            if was_head:
                self.wake()
