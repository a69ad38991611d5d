"""A :class:`~router.ledger.base.Ledger` that times every call into ``kvrouter_ledger_operation_seconds``.

Wrapping, not editing the stores: the same histogram covers the in-process and the Redis ledger, and the
cost is two clock reads and one observation per call (the Redis round trip it measures is ~100 µs). Each
method times inline with try/finally: a generator context manager cost more than the in-process ledger call
it timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

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

    def _observe(self, op: str, start_s: float) -> None:
        child = self._seconds.get(op)
        if child is None:
            child = self._seconds[op] = self._histogram.labels(op)
        child.observe(time.perf_counter() - start_s)

    async def register(self, capacities: Mapping[RankKey, int]) -> None:
        start_s = time.perf_counter()
        try:
            await self.inner.register(capacities)
        except LedgerUnavailable:
            self._errors["register"].inc()
            raise
        finally:
            self._observe("register", start_s)

    async def reserve(self, request_id: str, candidates: Sequence[RankKey], tokens: int) -> RankKey | None:
        start_s = time.perf_counter()
        try:
            return await self.inner.reserve(request_id, candidates, tokens)
        except LedgerUnavailable:
            self._errors["reserve"].inc()
            raise
        finally:
            self._observe("reserve", start_s)

    async def grow(self, request_id: str, tokens: int) -> bool:
        start_s = time.perf_counter()
        try:
            return await self.inner.grow(request_id, tokens)
        except LedgerUnavailable:
            self._errors["grow"].inc()
            raise
        finally:
            self._observe("grow", start_s)

    async def shrink(self, request_id: str, tokens: int) -> bool:
        start_s = time.perf_counter()
        try:
            return await self.inner.shrink(request_id, tokens)
        except LedgerUnavailable:
            self._errors["shrink"].inc()
            raise
        finally:
            self._observe("shrink", start_s)

    async def add_generated(self, request_id: str, tokens: int) -> None:
        start_s = time.perf_counter()
        try:
            await self.inner.add_generated(request_id, tokens)
        except LedgerUnavailable:
            self._errors["add_generated"].inc()
            raise
        finally:
            self._observe("add_generated", start_s)

    async def release(self, request_id: str) -> bool:
        start_s = time.perf_counter()
        try:
            return await self.inner.release(request_id)
        except LedgerUnavailable:
            self._errors["release"].inc()
            raise
        finally:
            self._observe("release", start_s)

    async def renew(self, request_ids: Iterable[str]) -> None:
        start_s = time.perf_counter()
        try:
            await self.inner.renew(request_ids)
        except LedgerUnavailable:
            self._errors["renew"].inc()
            raise
        finally:
            self._observe("renew", start_s)

    async def expire(self) -> int:
        start_s = time.perf_counter()
        try:
            return await self.inner.expire()
        except LedgerUnavailable:
            self._errors["expire"].inc()
            raise
        finally:
            self._observe("expire", start_s)

    async def get(self, request_id: str) -> Reservation | None:
        start_s = time.perf_counter()
        try:
            return await self.inner.get(request_id)
        except LedgerUnavailable:
            self._errors["get"].inc()
            raise
        finally:
            self._observe("get", start_s)

    async def usage(self) -> dict[RankKey, RankUsage]:
        start_s = time.perf_counter()
        try:
            return await self.inner.usage()
        except LedgerUnavailable:
            self._errors["usage"].inc()
            raise
        finally:
            self._observe("usage", start_s)

    async def close(self) -> None:
        await self.inner.close()
