"""What one router replica knows of its own reservations, so it can keep going when Redis cannot be reached.

Two books: ``owned`` mirrors the reservations this replica holds *in Redis* (needed to put them back if
Redis restarts empty, and to count them against the local share), and ``local`` is an in-process ledger
of the reservations made *while Redis was down* (``fail_open``). A replica's share of a rank is what it
held there at its last Redis read plus an equal slice (``// replicas``) of the room free then; it books
locally what its share leaves after its current holdings. N replicas that all lose Redis at once thus
add at most the room that was free, together, whatever split of the rank they held (a plain
``capacity // replicas`` would let the replica holding less than its half add a half while the other
already held more). Before any read the baseline is empty: the share is ``capacity // replicas``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from router.ledger.base import RankUsage, Reservation
from router.ledger.memory import InMemoryLedger
from router.placement.snapshot import RankKey


@dataclass(slots=True)
class Held:
    key: RankKey
    tokens: int
    generated_tokens: int = 0
    expiry_s: float = 0.0  # local clock: an owned reservation nobody renews is forgotten, never put back


class LocalShare:
    def __init__(self, *, replicas: int, lease_ttl_s: float, clock: Callable[[], float]) -> None:
        self.replicas = replicas
        self.capacity_tokens: dict[RankKey, int] = {}
        self.owned: dict[str, Held] = {}
        self._owned_tokens: dict[RankKey, int] = {}
        self._owned_count: dict[RankKey, int] = {}
        self._baseline: dict[RankKey, tuple[int, int]] = {}  # last Redis read: (all reserved, ours)
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self.local = InMemoryLedger(lease_ttl_s=lease_ttl_s, clock=clock)

    def register(self, capacities: dict[RankKey, int]) -> None:
        self.capacity_tokens.update(capacities)
        for key in capacities:
            self._owned_tokens.setdefault(key, 0)
            self._owned_count.setdefault(key, 0)
        self._set_local_capacity(capacities)

    def share_tokens(self, key: RankKey) -> int:
        reserved_tokens, ours_tokens = self._baseline.get(key, (0, 0))
        return ours_tokens + max(0, self.capacity_tokens[key] - reserved_tokens) // self.replicas

    def within_share(self, candidates: Sequence[RankKey], tokens: int) -> list[RankKey]:
        """The candidates where ``tokens`` more still fit this replica's share (after its holdings)."""
        local = self.local.usage_now()
        return [
            k
            for k in candidates
            if k in self.capacity_tokens
            and self._owned_tokens.get(k, 0) + (local[k].reserved_tokens if k in local else 0) + tokens
            <= self.share_tokens(k)
        ]

    def observe(self, reserved_tokens: dict[RankKey, int]) -> None:
        """A successful Redis read: remember every rank's total and this replica's part of it."""
        for key, total in reserved_tokens.items():
            self._baseline[key] = (total, self._owned_tokens.get(key, 0))

    # --- reservations this replica holds in Redis -------------------------------------------------
    def own(self, request_id: str, key: RankKey, tokens: int, generated_tokens: int = 0) -> None:
        self.owned[request_id] = Held(key, tokens, generated_tokens, self._clock() + self.lease_ttl_s)
        self._owned_tokens[key] = self._owned_tokens.get(key, 0) + tokens
        self._owned_count[key] = self._owned_count.get(key, 0) + 1

    def disown(self, request_id: str) -> Held | None:
        held = self.owned.pop(request_id, None)
        if held is not None:
            self._owned_tokens[held.key] -= held.tokens
            self._owned_count[held.key] -= 1
        return held

    def adjust(self, request_id: str, tokens: int, generated_tokens: int = 0) -> None:
        held = self.owned.get(request_id)
        if held is not None:
            tokens = max(tokens, -held.tokens)
            held.tokens += tokens
            held.generated_tokens += generated_tokens
            self._owned_tokens[held.key] += tokens

    def renewed(self, request_ids: Iterable[str]) -> None:
        expiry_s = self._clock() + self.lease_ttl_s
        for request_id in request_ids:
            held = self.owned.get(request_id)
            if held is not None:
                held.expiry_s = expiry_s

    def live_owned(self) -> dict[str, Held]:
        """Owned reservations whose local lease still runs; the others are forgotten (their owner stopped
        renewing them, so Redis reclaims them too)."""
        now_s = self._clock()
        for request_id in [rid for rid, h in self.owned.items() if h.expiry_s <= now_s]:
            self.disown(request_id)
        return dict(self.owned)

    # --- reservations made while Redis was unreachable -------------------------------------------
    def holds_locally(self, request_id: str) -> bool:
        return self.local.holds(request_id)

    def reserve(self, request_id: str, candidates: Sequence[RankKey], tokens: int) -> RankKey | None:
        if request_id in self.owned:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        for key in candidates:
            if key not in self.capacity_tokens:
                raise ValueError(f"unknown rank {key} (not registered)")
        self._set_local_capacity(candidates)
        return self.local.reserve_now(request_id, candidates, tokens)

    def usage(self) -> dict[RankKey, RankUsage]:
        """The degraded view: this replica's share, and what it holds (in Redis before, locally since)."""
        self._set_local_capacity(self.capacity_tokens)
        owned_generated: dict[RankKey, int] = {}
        for held in self.owned.values():
            owned_generated[held.key] = owned_generated.get(held.key, 0) + held.generated_tokens
        out: dict[RankKey, RankUsage] = {}
        for key, u in self.local.usage_now().items():
            out[key] = RankUsage(
                capacity_tokens=self.share_tokens(key),
                reserved_tokens=u.reserved_tokens + self._owned_tokens[key],
                inflight=u.inflight + self._owned_count[key],
                generated_tokens=u.generated_tokens + owned_generated.get(key, 0),
            )
        return out

    def owned_reservation(self, request_id: str) -> Reservation | None:
        held = self.owned.get(request_id)
        return None if held is None else Reservation(request_id, held.key, held.tokens, held.generated_tokens)

    def _set_local_capacity(self, keys: Iterable[RankKey]) -> None:
        # The local ledger's capacity is what is left of the share after this replica's Redis reservations.
        self.local.register_now(
            {k: max(0, self.share_tokens(k) - self._owned_tokens.get(k, 0)) for k in keys}
        )
