"""A process's lease expiries, kept in expiry order (the in-process and shared-memory ledgers share it).

Every reservation expires ``ttl_s`` after its reserve or its last renew. Because the TTL is one constant
and the clock never goes backwards, insertion order of the dict (an entry moved to the end on renew) is
expiry order: the lapsed leases are always at the front, so finding them costs O(lapsed).
"""

from __future__ import annotations

from collections.abc import Iterable


class Leases:
    __slots__ = ("_expiry_s", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._expiry_s: dict[str, float] = {}

    def start(self, request_id: str, now_s: float) -> None:
        self._expiry_s[request_id] = now_s + self.ttl_s

    def drop(self, request_id: str) -> None:
        self._expiry_s.pop(request_id, None)

    def renew(self, request_ids: Iterable[str], now_s: float) -> None:
        """Extend the leases among ``request_ids`` that are live (others are ignored)."""
        expiry_s = now_s + self.ttl_s
        leases = self._expiry_s
        for request_id in request_ids:
            if leases.pop(request_id, None) is not None:
                leases[request_id] = expiry_s  # re-inserted at the end: keeps the dict in expiry order

    def lapsed(self, now_s: float) -> str | None:
        """The request id of a lease that ran out by ``now_s`` (the oldest), or None. The caller releases it,
        which must :meth:`drop` it, before asking again."""
        leases = self._expiry_s
        if leases:
            request_id, expiry_s = next(iter(leases.items()))
            if expiry_s <= now_s:
                return request_id
        return None

    def clear(self) -> None:
        self._expiry_s.clear()
