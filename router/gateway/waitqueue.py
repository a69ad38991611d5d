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

Backfill: a waiter that passes ``behind`` (an attempt that keeps off the rank the blocked head claimed,
router/placement/admission.py) does not idle behind a blocked head: it tries ``behind`` on arrival and on
every wake-up and poll, in line order, and leaves the line when placed. The head is still the only one
that may use its claimed rank, so it is not starved. Without ``behind`` a waiter keeps the strict rule.

``hold_s`` lengthens one waiter's deadline by the time the policy may hold it on purpose (a long prompt
waiting for a batch of long prefills, router/placement/prefill_gate.py), so a hold never turns into a 503.
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
        self._owners: dict[asyncio.Event, object] = {}  # waiter -> its caller's ``owner`` (if any)
        self._backfill: set[asyncio.Event] = set()  # waiters that pass ``behind``
        self.closed = False
        self._head_blocked = False  # the current head tried and found no room

    @property
    def depth(self) -> int:
        return len(self._waiters)

    @property
    def head_owner(self) -> object | None:
        """The ``owner`` the head of the line was admitted with (who holds the claim), or None."""
        return self._owners.get(self._waiters[0]) if self._waiters else None

    def wake(self) -> None:
        """Room may have appeared: let the head try again, and the backfilling waiters behind it."""
        if not self._waiters:
            return
        self._waiters[0].set()
        if self._head_blocked:
            self._wake_backfill()

    def _wake_backfill(self) -> None:
        if self._backfill:
            for event in self._waiters:  # in line order: the loop runs them first come, first served
                if event in self._backfill:
                    event.set()

    def close(self) -> None:
        """Refuse every request from now on, those already waiting included (shutdown)."""
        self.closed = True
        for event in self._waiters:
            event.set()

    async def admit(
        self,
        attempt: Callable[[], Awaitable[T | None]],
        behind: Callable[[], Awaitable[T | None]] | None = None,
        owner: object | None = None,
        hold_s: float = 0.0,
        tried: bool = False,
    ) -> T:
        """Run ``attempt`` now if nobody waits, else (or when it finds no room) wait in line and retry.

        ``attempt`` returns None for "no room now" and may raise to refuse outright. ``behind`` is the
        attempt to make while waiting behind a blocked head (backfill); ``owner`` names the caller while
        it is the head (:attr:`head_owner`); ``hold_s`` is added to this waiter's deadline. ``tried``: the
        caller found the line empty and has just made that first attempt itself, in vain (the fast path
        of an uncontended router): go straight to waiting.
        """
        if self.closed:
            raise QueueClosed
        if tried:
            pass
        elif not self._waiters or not self._head_blocked:
            got = await attempt()
            if got is not None:
                return got
        elif behind is not None:
            got = await behind()
            if got is not None:
                return got
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull
        deadline_s = time.monotonic() + self.timeout_s + max(0.0, hold_s)
        event = asyncio.Event()
        self._waiters.append(event)
        if owner is not None:
            self._owners[event] = owner
        if behind is not None:
            self._backfill.add(event)
        try:
            return await self._wait(event, deadline_s, attempt, behind)
        finally:
            was_head = self._waiters[0] is event
            self._waiters.remove(event)
            self._owners.pop(event, None)
            self._backfill.discard(event)
            if was_head:
                self._head_blocked = False  # the next head has not tried yet
                self.wake()

    async def _wait(
        self,
        event: asyncio.Event,
        deadline_s: float,
        attempt: Callable[[], Awaitable[T | None]],
        behind: Callable[[], Awaitable[T | None]] | None,
    ) -> T:
        """Wait in line until placed; the head polls, as does a backfilling waiter behind a blocked head."""
        while True:
            if self.closed:
                raise QueueClosed
            head = self._waiters[0] is event
            polls = head
            if head:
                got = await attempt()
                if got is not None:
                    return got
                if not self._head_blocked:  # the head now holds a claim: those behind may backfill
                    self._head_blocked = True
                    self._wake_backfill()
            elif behind is not None and self._head_blocked:
                polls = True
                got = await behind()
                if got is not None:
                    return got
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise QueueTimeout
            event.clear()
            # asyncio.timeout, not wait_for: no extra task, one loop wake-up less per hand-over
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining_s, self.poll_s) if polls else remaining_s):
                    await event.wait()
