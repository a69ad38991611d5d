"""A :class:`~router.ledger.base.Ledger` that times every call into ``kvrouter_ledger_operation_seconds``.

Wrapping, not editing the stores: the same histogram covers the in-process and the Redis ledger, and the
cost is two clock reads and one observation per call (the Redis round trip it measures is ~100 µs).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from prometheus_client import Counter, Histogram

from router.ledger.base import Ledger, LedgerUnavailable, RankUsage, Reservation
from router.placement.snapshot import RankKey
from router.telemetry import LEDGER_OPS


class TimedLedger:
    """Delegates to ``inner``; LedgerUnavailable is counted (``kvrouter_ledger_errors_total``), re-raised."""

    def __init__(self, inner: Ledger, seconds: Histogram, errors: Counter) -> None:
        self.inner = inner
        self._histogram = seconds
        self._seconds: dict[str, Histogram] = {}  # children made on first use: no empty histograms scraped
        self._errors = {op: errors.labels(op) for op in LEDGER_OPS}  # zeros from the start, for rate()

    @contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        start_s = time.perf_counter()
        try:
            yield
        except LedgerUnavailable:
            self._errors[op].inc()
            raise
        finally:
            child = self._seconds.get(op)
            if child is None:
                child = self._seconds[op] = self._histogram.labels(op)
            child.observe(time.perf_counter() - start_s)

    async def register(self, capacities: Mapping[RankKey, int]) -> None:
        with self._timed("register"):
            await self.inner.register(capacities)

    async def reserve(self, request_id: str, candidates: Sequence[RankKey], tokens: int) -> RankKey | None:
        with self._timed("reserve"):
            return await self.inner.reserve(request_id, candidates, tokens)

    async def grow(self, request_id: str, tokens: int) -> bool:
        with self._timed("grow"):
            return await self.inner.grow(request_id, tokens)

    async def shrink(self, request_id: str, tokens: int) -> bool:
        with self._timed("shrink"):
            return await self.inner.shrink(request_id, tokens)

    async def add_generated(self, request_id: str, tokens: int) -> None:
        with self._timed("add_generated"):
            await self.inner.add_generated(request_id, tokens)

    async def release(self, request_id: str) -> bool:
        with self._timed("release"):
            return await self.inner.release(request_id)

    async def renew(self, request_ids: Iterable[str]) -> None:
        with self._timed("renew"):
            await self.inner.renew(request_ids)

    async def expire(self) -> int:
        with self._timed("expire"):
            return await self.inner.expire()

    async def get(self, request_id: str) -> Reservation | None:
        with self._timed("get"):
            return await self.inner.get(request_id)

    async def usage(self) -> dict[RankKey, RankUsage]:
        with self._timed("usage"):
            return await self.inner.usage()

    async def close(self) -> None:
        await self.inner.close()
