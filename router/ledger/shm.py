"""Shared-memory ledger: the worker processes of one ``kvrouter serve --workers N`` on one host share it.

Same semantics as :class:`~router.ledger.memory.InMemoryLedger`, with the per-rank counts in a file mapped
by every worker (router/ledger/shm_file.py) and each call holding the file's ``flock`` only for its few
arithmetic operations (never across an await): a few µs per call instead of Redis round trips.

What is shared and what is not: each worker owns its requests, so its reservations (request id -> rank,
tokens, generated tokens, lease) stay in process, as in the in-process ledger; only the per-rank counts
are shared, as totals (what ``reserve`` compares with the capacity) and as each worker slot's share of them.
``get`` and ``release`` therefore see this process's reservations only (a request is placed, streamed and
released by the worker that accepted it); ``usage`` sees every worker's.

A worker that dies (its pid gone or a zombie, or its heartbeat older than the lease TTL: it has renewed
nothing for a TTL, so by lease rules everything it held has expired) has its slot zeroed by whichever
live worker notices first (at most every ``reap_interval_s``, and on every ``expire()``), and the totals
are then recomputed from the live slots. Increments write the total before the slot and decrements the
slot before the total, so a process killed between the two writes leaves the total too high (room
unused until it is reaped), never too low. A worker that finds its own slot reclaimed (it stalled for a
TTL) drops its reservations, as their leases ran out, and takes a new slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.ledger.base import RankUsage, Reservation
from router.ledger.leases import Leases
from router.ledger.memory import DEFAULT_LEASE_TTL_S, check_capacities, check_tokens
from router.ledger.shm_file import H_KEYS, LedgerFile
from router.placement.snapshot import RankKey

log = logging.getLogger(__name__)
MAX_REAP_INTERVAL_S = 1.0


@dataclass(slots=True)
class _Held:
    index: int
    key: RankKey
    tokens: int
    generated_tokens: int = 0


class SharedMemoryLedger:
    """The :class:`~router.ledger.base.Ledger` of one host's worker processes; ``path`` must exist
    (:func:`router.ledger.shm_file.create_ledger_file`). ``clock`` is ``time.monotonic`` or a test's fake;
    every process sharing a file must use the same clock."""

    def __init__(
        self,
        path: str,
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.path = path
        self.lease_ttl_s = lease_ttl_s
        self.reap_interval_s = min(MAX_REAP_INTERVAL_S, lease_ttl_s / 4)
        self._clock = clock
        self._file = LedgerFile(path)
        self._fd = self._file.fd
        self._q = self._file.words
        lay = self._file.layout
        self._max_keys, self._max_slots, self._name_bytes = lay.max_keys, lay.max_slots, lay.name_bytes
        self._cap, self._rank, self._res = lay.cap_at, lay.rank_at, lay.reserved_at
        self._inf, self._gen = lay.inflight_at, lay.generated_at
        self._pid, self._token, self._beat = lay.pid_at, lay.token_at, lay.beat_at
        self._sres, self._sinf, self._sgen = lay.slot_reserved_at, lay.slot_inflight_at, lay.slot_generated_at
        self._index: dict[RankKey, int] = {}
        self._keys: list[RankKey] = []
        self._held: dict[str, _Held] = {}
        self._leases = Leases(lease_ttl_s)
        self._owner = secrets.randbits(62) + 1
        self._slot = -1
        self._row = 0  # self._slot * max_keys: the start of this process's rows
        self._next_reap_s = 0.0
        self._lock()
        try:
            self._claim_slot(self._clock())
        except BaseException:
            self._unlock()
            self._file.close()
            raise
        self._unlock()

    # -- the lock and what every locked call does first -----------------------------------------------

    def _lock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _begin(self) -> float:
        """Under the lock: check this slot is still ours, beat, reap if due, expire our due leases."""
        now_s = self._clock()
        q = self._q
        if q[self._token + self._slot] != self._owner:
            self._lost_slot(now_s)
        q[self._beat + self._slot] = int(now_s * 1e9)
        if now_s >= self._next_reap_s:
            self._reap(now_s)
        leases = self._leases
        while (request_id := leases.lapsed(now_s)) is not None:
            self._release_locked(request_id)
        return now_s

    # -- worker slots ---------------------------------------------------------------------------------

    def _claim_slot(self, now_s: float) -> None:
        q = self._q
        free = [s for s in range(self._max_slots) if q[self._pid + s] == 0]
        if not free:
            self._reap(now_s)
            free = [s for s in range(self._max_slots) if q[self._pid + s] == 0]
        if not free:
            raise RuntimeError(f"all {self._max_slots} worker slots of the ledger {self.path} are in use")
        self._slot = slot = free[0]
        self._row = slot * self._max_keys
        q[self._token + slot] = self._owner
        q[self._beat + slot] = int(now_s * 1e9)
        q[self._pid + slot] = os.getpid()

    def _lost_slot(self, now_s: float) -> None:
        log.warning(
            "ledger slot %d was reclaimed (this worker stalled longer than the %.0f s lease TTL): "
            "dropping its %d reservations, whose leases ran out",
            self._slot,
            self.lease_ttl_s,
            len(self._held),
        )
        self._held.clear()
        self._leases.clear()
        self._claim_slot(now_s)

    def _reap(self, now_s: float) -> int:
        """Free the slots of dead workers and recompute the totals from the live ones; returns how many."""
        self._next_reap_s = now_s + self.reap_interval_s
        dead = self._file.dead_slots(int((now_s - self.lease_ttl_s) * 1e9), keep=self._slot)
        for slot in dead:
            log.warning("ledger: reclaiming the slot of dead worker pid %d", self._q[self._pid + slot])
            self._file.zero_slot(slot)
        if dead:
            self._file.recount()
        return len(dead)

    # -- rank keys ------------------------------------------------------------------------------------

    def _refresh_keys(self) -> None:
        """Learn keys other processes appended (the table only grows; indexes never move)."""
        for index in range(len(self._keys), self._file.keys()):
            key = RankKey(self._file.read_name(index), self._q[self._rank + index])
            self._keys.append(key)
            self._index[key] = index

    def _index_of(self, key: RankKey) -> int:
        index = self._index.get(key)
        if index is None:
            self._refresh_keys()
            index = self._index.get(key)
            if index is None:
                raise ValueError(f"unknown rank {key} (not registered)")
        return index

    async def register(self, capacities: Mapping[RankKey, int]) -> None:
        check_capacities(capacities)
        for key in capacities:
            if len(key.backend.encode()) > self._name_bytes:
                raise ValueError(f"backend name {key.backend!r} is over {self._name_bytes} bytes")
        self._lock()
        try:
            self._begin()
            self._refresh_keys()
            q = self._q
            for key, capacity_tokens in capacities.items():
                index = self._index.get(key)
                if index is None:
                    index = self._file.keys()
                    if index >= self._max_keys:
                        raise ValueError(f"the shared-memory ledger holds at most {self._max_keys} ranks")
                    self._file.write_name(index, key.backend.encode())
                    q[self._rank + index] = key.rank
                    q[self._cap + index] = capacity_tokens
                    q[H_KEYS] = index + 1  # published last: readers never see a half-written key
                    self._keys.append(key)
                    self._index[key] = index
                else:
                    q[self._cap + index] = capacity_tokens
        finally:
            self._unlock()

    # -- reservations ---------------------------------------------------------------------------------

    async def reserve(self, request_id: str, candidates: Sequence[RankKey], tokens: int) -> RankKey | None:
        check_tokens(tokens, allow_zero=False)
        self._lock()
        try:
            now_s = self._begin()
            if request_id in self._held:
                raise ValueError(f"request {request_id!r} already holds a reservation")
            indexes = [self._index_of(key) for key in candidates]
            q, res, inf = self._q, self._res, self._inf
            for key, i in zip(candidates, indexes, strict=True):
                if q[res + i] + tokens <= q[self._cap + i]:
                    q[res + i] += tokens  # total first: a crash here over-counts, never under-counts
                    q[inf + i] += 1
                    q[self._sres + self._row + i] += tokens
                    q[self._sinf + self._row + i] += 1
                    self._held[request_id] = _Held(i, key, tokens)
                    self._leases.start(request_id, now_s)
                    return key
            return None
        finally:
            self._unlock()

    async def grow(self, request_id: str, tokens: int) -> bool:
        check_tokens(tokens, allow_zero=True)
        self._lock()
        try:
            self._begin()
            held = self._held.get(request_id)
            if held is None:
                return False
            q, i = self._q, held.index
            if q[self._res + i] + tokens > q[self._cap + i]:
                return False
            q[self._res + i] += tokens
            q[self._sres + self._row + i] += tokens
            held.tokens += tokens
            return True
        finally:
            self._unlock()

    async def shrink(self, request_id: str, tokens: int) -> bool:
        """Give ``tokens`` back (clamped: a reservation never goes below zero)."""
        check_tokens(tokens, allow_zero=True)
        self._lock()
        try:
            self._begin()
            held = self._held.get(request_id)
            if held is None:
                return False
            given_back_tokens = min(tokens, held.tokens)
            held.tokens -= given_back_tokens
            q, i = self._q, held.index
            q[self._sres + self._row + i] -= given_back_tokens  # slot first: see the module docstring
            q[self._res + i] -= given_back_tokens
            return True
        finally:
            self._unlock()

    async def add_generated(self, request_id: str, tokens: int) -> None:
        check_tokens(tokens, allow_zero=True)
        self._lock()
        try:
            self._begin()
            held = self._held.get(request_id)
            if held is not None:
                held.generated_tokens += tokens
                self._q[self._gen + held.index] += tokens
                self._q[self._sgen + self._row + held.index] += tokens
        finally:
            self._unlock()

    async def release(self, request_id: str) -> bool:
        self._lock()
        try:
            self._begin()
            return self._release_locked(request_id)
        finally:
            self._unlock()

    def _release_locked(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._leases.drop(request_id)
        q, i, row = self._q, held.index, self._row
        q[self._sres + row + i] -= held.tokens
        q[self._sinf + row + i] -= 1
        q[self._sgen + row + i] -= held.generated_tokens
        q[self._res + i] -= held.tokens
        q[self._inf + i] -= 1
        q[self._gen + i] -= held.generated_tokens
        return True

    async def renew(self, request_ids: Iterable[str]) -> None:
        self._lock()
        try:
            now_s = self._begin()  # also the heartbeat that keeps this slot ours
        finally:
            self._unlock()
        self._leases.renew(request_ids, now_s)

    async def expire(self) -> int:
        """Reclaim this process's lapsed leases (returned) and, whatever the reap interval, dead slots."""
        before = len(self._held)
        self._lock()
        try:
            self._next_reap_s = 0.0
            self._begin()
        finally:
            self._unlock()
        return before - len(self._held)

    async def get(self, request_id: str) -> Reservation | None:
        if self._leases.lapsed(self._clock()) is not None:  # something lapsed: reclaim it first
            await self.expire()
        held = self._held.get(request_id)
        if held is None:
            return None
        return Reservation(request_id, held.key, held.tokens, held.generated_tokens)

    async def usage(self) -> dict[RankKey, RankUsage]:
        self._lock()
        try:
            self._begin()
            self._refresh_keys()
            q = self._q
            return {
                key: RankUsage(q[self._cap + i], q[self._res + i], q[self._inf + i], q[self._gen + i])
                for i, key in enumerate(self._keys)
            }
        finally:
            self._unlock()

    async def workers(self) -> dict[int, int]:
        """Reserved tokens per live worker pid, this one included (for operators and tests)."""
        self._lock()
        try:
            self._begin()
            return self._file.reserved_per_pid()
        finally:
            self._unlock()

    async def close(self) -> None:
        """Give back what this process still holds and free its slot (idempotent)."""
        if self._slot < 0:
            return
        self._lock()
        try:
            if self._q[self._token + self._slot] == self._owner:
                for request_id in list(self._held):
                    self._release_locked(request_id)
                self._file.zero_slot(self._slot)
        finally:
            self._unlock()
        self._slot = -1
        self._held.clear()
        self._leases.clear()
        with contextlib.suppress(OSError):
            self._file.close()
