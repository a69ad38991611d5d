"""Redis-backed ledger shared by router replicas (being written; the in-process store is usable now)."""

from __future__ import annotations

from typing import Any


class RedisLedger:
    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisLedger:
        raise NotImplementedError("RedisLedger not landed yet: leave redis_url unset (in-process ledger)")
