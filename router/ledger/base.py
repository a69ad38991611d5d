"""The ledger: per-rank KV reservations, the only state shared between requests and router replicas.

Contract (tested against every store by one parametrised suite):

* ``reserve`` tries ``candidates`` in order and atomically reserves ``tokens`` on the first rank whose
  capacity still allows it; it returns that rank, or None when none does. A request id holds at most one
  reservation.
* ``grow`` adds tokens to a live reservation (page steps as generation passes the prediction) if
  capacity allows; ``shrink`` gives tokens back (a correction from the engine's usage).
* ``release`` frees a reservation exactly once; a second call returns False and changes nothing.
* ``renew`` extends leases of live reservations (stores with expiry); ``expire`` reclaims dead ones.
* ``usage`` returns every registered rank's reserved tokens and in-flight count in one call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from router.placement.snapshot import RankKey


@dataclass(frozen=True, slots=True)
class RankUsage:
    capacity_tokens: int
    reserved_tokens: int = 0
    inflight: int = 0
    generated_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    key: RankKey
    tokens: int
    generated_tokens: int = 0


class LedgerUnavailable(RuntimeError):
    """The store cannot be reached (Redis down); the caller applies the configured failure mode."""


@runtime_checkable
class Ledger(Protocol):
    async def register(self, capacities: Mapping[RankKey, int]) -> None:
        """Declare ranks and their capacity (idempotent; a capacity change takes effect for new reserves)."""

    async def reserve(
        self, request_id: str, candidates: Sequence[RankKey], tokens: int
    ) -> RankKey | None: ...

    async def grow(self, request_id: str, tokens: int) -> bool: ...

    async def shrink(self, request_id: str, tokens: int) -> bool: ...

    async def add_generated(self, request_id: str, tokens: int) -> None:
        """Count tokens generated so far (for growth and for the ledger's exact release)."""

    async def release(self, request_id: str) -> bool: ...

    async def renew(self, request_ids: Iterable[str]) -> None: ...

    async def expire(self) -> int:
        """Reclaim reservations whose lease ran out; returns how many."""

    async def get(self, request_id: str) -> Reservation | None: ...

    async def usage(self) -> dict[RankKey, RankUsage]: ...

    async def close(self) -> None: ...
