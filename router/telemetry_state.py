"""Per-rank gauges from in-memory state: what /ranks and /metrics show, built without any I/O.

The ledger numbers (capacity, reserved, in flight) come from :class:`UsageCache`, the ledger snapshot the
reconcile loop reads once per round (it needs it anyway, to measure drift). With the Redis ledger that
snapshot is the *global* truth shared by every worker and replica, so every router process exposes the
same values, at most one reconcile interval old (``kvrouter_ledger_snapshot_age_seconds`` says how old).
The engine numbers come from the :class:`~router.telemetry_store.TelemetryStore` the same loop fills.
A scrape therefore costs a walk over a few dicts: no ledger round trip, no fan-out to backends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.ledger.base import Ledger, RankUsage
from router.placement.snapshot import RankKey
from router.telemetry_store import RankTruth, TelemetryStore

RANK_LABELS = ["backend", "rank"]


@dataclass(frozen=True, slots=True)
class RankRow:
    """One rank as /ranks and /metrics show it (fields after ``healthy`` only on /metrics)."""

    backend: str
    rank: int
    capacity_tokens: int
    reserved_tokens: int
    inflight: int
    engine_used_tokens: int | None
    healthy: bool
    in_ledger: bool = True  # False: the ledger snapshot lacks this rank, reserved/inflight are unknown
    drift_tokens: int | None = None
    engine_running: int | None = None
    engine_waiting: int | None = None
    telemetry_age_s: float | None = None


def rank_rows(
    truths: Mapping[RankKey, RankTruth], usage: Mapping[RankKey, RankUsage], now_s: float | None = None
) -> list[RankRow]:
    """Engine truth joined with a ledger snapshot, ordered by backend then rank."""
    rows = []
    for key, truth in sorted(truths.items(), key=lambda kv: (kv[0].backend, kv[0].rank)):
        u = usage.get(key)
        age_s = None if now_s is None or truth.updated_s is None else max(0.0, now_s - truth.updated_s)
        rows.append(
            RankRow(
                backend=key.backend,
                rank=key.rank,
                capacity_tokens=u.capacity_tokens if u is not None else truth.capacity_tokens,
                reserved_tokens=u.reserved_tokens if u is not None else 0,
                inflight=u.inflight if u is not None else 0,
                engine_used_tokens=truth.engine_used_tokens,
                healthy=truth.healthy,
                in_ledger=u is not None,
                drift_tokens=truth.drift_tokens,
                engine_running=truth.running,
                engine_waiting=truth.waiting,
                telemetry_age_s=age_s,
            )
        )
    return rows


class UsageCache:
    """The ledger usage last read by the reconcile loop; its ``estimate`` is the loop's drift estimate."""

    def __init__(self, ledger: Ledger, clock: Callable[[], float] = time.monotonic) -> None:
        self._ledger = ledger
        self._clock = clock
        self.usage: Mapping[RankKey, RankUsage] = {}
        self.taken_s: float | None = None

    async def estimate(self) -> Mapping[RankKey, int]:
        """Read the ledger once: keep the snapshot, hand back reserved tokens per rank."""
        usage = await self._ledger.usage()
        self.usage = usage
        self.taken_s = self._clock()
        return {key: u.reserved_tokens for key, u in usage.items()}

    def age_s(self) -> float | None:
        return None if self.taken_s is None else max(0.0, self._clock() - self.taken_s)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=RANK_LABELS if labels is None else labels)


class RankStateCollector(Collector):
    """Turns the telemetry store and the cached ledger snapshot into gauge families when scraped."""

    def __init__(
        self,
        store: TelemetryStore,
        usage: UsageCache,
        backends: Mapping[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._usage = usage
        self._backends = dict(backends)  # name -> engine, as configured
        self._clock = clock

    def rows(self) -> list[RankRow]:
        return rank_rows(self._store.ranks(), self._usage.usage, self._clock())

    def collect(self) -> Iterable[Metric]:
        fams = {
            "capacity": _gauge("kvrouter_rank_capacity_tokens", "KV pool of the rank, tokens"),
            "reserved": _gauge("kvrouter_rank_reserved_tokens", "Tokens reserved in the router ledger"),
            "inflight": _gauge(
                "kvrouter_rank_inflight_requests", "Requests holding a reservation on the rank"
            ),
            "engine": _gauge("kvrouter_rank_engine_used_tokens", "KV tokens in use as the engine reports"),
            "drift": _gauge(
                "kvrouter_rank_drift_tokens", "Engine-reported minus reserved tokens at poll time"
            ),
            "running": _gauge("kvrouter_rank_engine_running_requests", "Running requests, engine's view"),
            "waiting": _gauge("kvrouter_rank_engine_waiting_requests", "Waiting requests, engine's view"),
            "age": _gauge(
                "kvrouter_rank_telemetry_age_seconds", "Time since the engine last answered a poll"
            ),
            "healthy": _gauge("kvrouter_rank_healthy", "1 if the rank takes requests (polls and data plane)"),
        }
        for row in self.rows():
            lv = [row.backend, str(row.rank)]
            fams["capacity"].add_metric(lv, row.capacity_tokens)
            fams["healthy"].add_metric(lv, 1.0 if row.healthy else 0.0)
            if row.in_ledger:
                fams["reserved"].add_metric(lv, row.reserved_tokens)
                fams["inflight"].add_metric(lv, row.inflight)
            for name, value in (("engine", row.engine_used_tokens), ("drift", row.drift_tokens),
                                ("running", row.engine_running), ("waiting", row.engine_waiting),
                                ("age", row.telemetry_age_s)):  # fmt: skip
                if value is not None:
                    fams[name].add_metric(lv, value)
        yield from fams.values()
        yield self._backends_up()
        age = _gauge(
            "kvrouter_ledger_snapshot_age_seconds", "Age of the ledger snapshot behind the rank gauges", []
        )
        snapshot_age_s = self._usage.age_s()
        if snapshot_age_s is not None:
            age.add_metric([], snapshot_age_s)
        yield age

    def _backends_up(self) -> GaugeMetricFamily:
        up = _gauge("kvrouter_backend_up", "1 if the backend is discovered and its last poll answered",
                    ["backend", "engine"])  # fmt: skip
        for name, engine in sorted(self._backends.items()):
            ok = self._store.info(name) is not None and self._store.backend_error(name) is None
            up.add_metric([name, engine], 1.0 if ok else 0.0)
        return up
