"""In-process ledger: one router process, no shared state, nanoseconds per call.

Atomicity comes from asyncio itself: no method awaits between reading a rank's free tokens and writing the
reservation, so two tasks can never both take the last free tokens of a rank.

Leases: every reservation expires ``lease_ttl_s`` after its reserve or its last ``renew``
(:class:`~router.ledger.leases.Leases`, in expiry order), and every public call reclaims the expired ones
lazily first: an expired reservation is never visible, whether or not ``expire()`` ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.ledger.base import RankUsage, Reservation
from router.ledger.leases import Leases
from router.placement.snapshot import RankKey

DEFAULT_LEASE_TTL_S = 30.0


@dataclass(slots=True)
class _Rank:
    """One rank's totals: one dict lookup per rank and call. ``usage`` is their last
    :class:`RankUsage`, kept until they change (None: stale), so ``usage()`` builds one only for the
    ranks that changed and hands back the same object for the others (the placer skips those)."""

    capacity_tokens: int
    reserved_tokens: int = 0
    inflight: int = 0
    generated_tokens: int = 0
    usage: RankUsage | None = None


@dataclass(slots=True)
class _Held:
    rank: _Rank
    key: RankKey
    tokens: int
    generated_tokens: int = 0


def check_tokens(tokens: int, *, allow_zero: bool) -> None:
    """Reject non-integers and negative (or zero, for reserve) token counts: never silently miscount."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ValueError(f"tokens must be an int, got {tokens!r}")
    if tokens < 0 or (tokens == 0 and not allow_zero):
        raise ValueError(f"tokens must be {'>= 0' if allow_zero else '>= 1'}, got {tokens}")


def check_capacities(capacities: Mapping[RankKey, int]) -> None:
    for key, capacity_tokens in capacities.items():
        if not isinstance(key, RankKey):
            raise ValueError(f"rank keys must be RankKey, got {key!r}")
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
            raise ValueError(f"capacity of {key} must be an int >= 0, got {capacity_tokens!r}")


class InMemoryLedger:
    """The :class:`~router.ledger.base.Ledger` for a single router process.

    ``clock`` returns seconds and must never decrease (``time.monotonic`` by default; tests inject a fake).
    """

    def __init__(
        self, *, lease_ttl_s: float = DEFAULT_LEASE_TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._ranks: dict[RankKey, _Rank] = {}
        self._held: dict[str, _Held] = {}
        self._leases = Leases(lease_ttl_s)

    async def register(self, capacities: Mapping[RankKey, int]) -> None:
        self.register_now(capacities)

    def register_now(self, capacities: Mapping[RankKey, int]) -> None:
        check_capacities(capacities)
        for key, capacity_tokens in capacities.items():
            rank = self._ranks.get(key)
            if rank is None:
                self._ranks[key] = _Rank(capacity_tokens)
            else:
                rank.capacity_tokens = capacity_tokens
                rank.usage = None

    async def reserve(self, request_id: str, candidates: Sequence[RankKey], tokens: int) -> RankKey | None:
        return self.reserve_now(request_id, candidates, tokens)

    def reserve_now(self, request_id: str, candidates: Sequence[RankKey], tokens: int) -> RankKey | None:
        """Synchronous reserve (also used by the Redis store's local share when Redis is down)."""
        check_tokens(tokens, allow_zero=False)
        now_s = self._expire_due()
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        try:
            ranks = [self._ranks[key] for key in candidates]
        except KeyError as exc:
            raise ValueError(f"unknown rank {exc.args[0]} (not registered)") from None
        for key, rank in zip(candidates, ranks, strict=True):
            if rank.reserved_tokens + tokens <= rank.capacity_tokens:
                rank.reserved_tokens += tokens
                rank.inflight += 1
                rank.usage = None
                self._held[request_id] = _Held(rank, key, tokens)
                self._leases.start(request_id, now_s)
                return key
        return None

    async def grow(self, request_id: str, tokens: int) -> bool:
        check_tokens(tokens, allow_zero=True)
        self._expire_due()
        held = self._held.get(request_id)
        if held is None:
            return False
        if held.rank.reserved_tokens + tokens > held.rank.capacity_tokens:
            return False
        held.tokens += tokens
        held.rank.reserved_tokens += tokens
        held.rank.usage = None
        return True

    async def shrink(self, request_id: str, tokens: int) -> bool:
        """Give ``tokens`` back (clamped: a reservation never goes below zero)."""
        check_tokens(tokens, allow_zero=True)
        self._expire_due()
        held = self._held.get(request_id)
        if held is None:
            return False
        given_back_tokens = min(tokens, held.tokens)
        held.tokens -= given_back_tokens
        held.rank.reserved_tokens -= given_back_tokens
        held.rank.usage = None
        return True

    async def add_generated(self, request_id: str, tokens: int) -> None:
        check_tokens(tokens, allow_zero=True)
        self._expire_due()
        held = self._held.get(request_id)
        if held is not None:
            held.generated_tokens += tokens
            held.rank.generated_tokens += tokens
            held.rank.usage = None

    async def release(self, request_id: str) -> bool:
        self._expire_due()
        return self.release_now(request_id)

    def release_now(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._leases.drop(request_id)
        rank = held.rank
        rank.reserved_tokens -= held.tokens
        rank.inflight -= 1
        rank.generated_tokens -= held.generated_tokens
        rank.usage = None
        return True

    async def renew(self, request_ids: Iterable[str]) -> None:
        self._leases.renew(request_ids, self._expire_due())

    async def expire(self) -> int:
        before = len(self._held)
        self._expire_due()
        return before - len(self._held)

    async def get(self, request_id: str) -> Reservation | None:
        self._expire_due()
        held = self._held.get(request_id)
        if held is None:
            return None
        return Reservation(request_id, held.key, held.tokens, held.generated_tokens)

    async def usage(self) -> dict[RankKey, RankUsage]:
        self._expire_due()
        return self.usage_now()

    def usage_now(self) -> dict[RankKey, RankUsage]:
        out: dict[RankKey, RankUsage] = {}
        for key, r in self._ranks.items():
            u = r.usage
            if u is None:
                u = r.usage = RankUsage(r.capacity_tokens, r.reserved_tokens, r.inflight, r.generated_tokens)
            out[key] = u
        return out

    def holds(self, request_id: str) -> bool:
        self._expire_due()
        return request_id in self._held

    def held(self) -> dict[str, Reservation]:
        """Every live reservation (for the Redis store's reconciliation and for tests)."""
        self._expire_due()
        return {rid: Reservation(rid, h.key, h.tokens, h.generated_tokens) for rid, h in self._held.items()}

    async def close(self) -> None:
        return None

    def _expire_due(self) -> float:
        """Reclaim every reservation whose lease ran out; returns the clock reading used."""
        now_s = self._clock()
        leases = self._leases
        while (request_id := leases.lapsed(now_s)) is not None:
            self.release_now(request_id)
        return now_s
