"""The admission queue: a bounded FIFO of requests waiting for KV room, each with its own deadline.

First come, first served while there is contention: only the head tries to place itself, and once the
head has found no room a newcomer queues behind it rather than jumping it (a large request is not starved
by small ones slipping past). The head is woken on every release (``wake``) and polls at ``poll_s`` for
room freed elsewhere (other router replicas, engine telemetry, lease expiry). Each waiter places itself
in its own task, so a waiter that is cancelled (client gone, shutdown) can never leave a reservation
behind.

Handing the line on costs an event-loop wake-up per waiter, which under load is milliseconds: if newcomers
always queued behind a non-empty line, a line that formed once would never drain while arrivals kept up,
and requests would be refused (429) with the ranks idle (measured: loadtest/bench/soak.py, ~half of all
requests). So a newcomer tries at once unless the current head is *blocked* (has tried and found no room);
in the zero-latency limit (the simulator) the two rules are the same.
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
        self._head_blocked = False  # the current head tried and found no room

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
        if not self._waiters or not self._head_blocked:
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
                    self._head_blocked = True
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise QueueTimeout
                event.clear()
                # asyncio.timeout, not wait_for: no extra task, one loop wake-up less per hand-over
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining_s, self.poll_s) if head else remaining_s):
                        await event.wait()
        finally:
            was_head = self._waiters[0] is event
            self._waiters.remove(event)
            if was_head:
                self._head_blocked = False  # the next head has not tried yet
                self.wake()
