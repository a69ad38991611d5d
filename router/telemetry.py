"""Prometheus metrics of one gateway, in its own registry (no global one, so apps and tests stay apart).

Request-path metrics (counters, histograms) are updated as requests pass. Per-rank gauges are not: the
``/metrics`` handler gathers the current rank table once and a custom collector turns it into gauge
families at scrape time, so keeping them costs nothing per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True, slots=True)
class RankRow:
    """One rank as /ranks and /metrics show it."""

    backend: str
    rank: int
    capacity_tokens: int
    reserved_tokens: int
    inflight: int
    engine_used_tokens: int | None
    healthy: bool


class _StateCollector(Collector):
    """Turns the last gathered rank table into gauges when scraped."""

    def __init__(self) -> None:
        self.rows: Sequence[RankRow] = ()
        self.queue_depth = 0

    def collect(self) -> Iterable[Metric]:
        labels = ["backend", "rank"]
        fams = {
            "capacity": GaugeMetricFamily(
                "kvrouter_rank_capacity_tokens", "KV pool of the rank, tokens", labels=labels
            ),
            "reserved": GaugeMetricFamily(
                "kvrouter_rank_reserved_tokens", "Tokens reserved by the router ledger", labels=labels
            ),
            "engine": GaugeMetricFamily(
                "kvrouter_rank_engine_used_tokens", "KV tokens in use as the engine reports", labels=labels
            ),
            "drift": GaugeMetricFamily(
                "kvrouter_rank_drift_tokens", "Engine-reported minus reserved tokens", labels=labels
            ),
            "inflight": GaugeMetricFamily(
                "kvrouter_rank_inflight_requests", "Requests pinned to the rank", labels=labels
            ),
            "healthy": GaugeMetricFamily(
                "kvrouter_rank_healthy", "1 if the rank takes requests", labels=labels
            ),
        }
        for row in self.rows:
            lv = [row.backend, str(row.rank)]
            fams["capacity"].add_metric(lv, row.capacity_tokens)
            fams["reserved"].add_metric(lv, row.reserved_tokens)
            fams["inflight"].add_metric(lv, row.inflight)
            fams["healthy"].add_metric(lv, 1.0 if row.healthy else 0.0)
            if row.engine_used_tokens is not None:
                fams["engine"].add_metric(lv, row.engine_used_tokens)
                fams["drift"].add_metric(lv, row.engine_used_tokens - row.reserved_tokens)
        yield from fams.values()
        depth = GaugeMetricFamily("kvrouter_queue_depth", "Requests waiting for KV capacity")
        depth.add_metric([], self.queue_depth)
        yield depth


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvrouter_requests", "Requests answered, by route and HTTP status", ["route", "code"], registry=r
        )
        self.rejections = Counter(
            "kvrouter_rejections", "Requests refused by the router, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "kvrouter_ttft_seconds",
            "Arrival to first upstream byte",
            ["route"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.duration = Histogram(
            "kvrouter_request_duration_seconds",
            "Arrival to last byte",
            ["route"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvrouter_queue_wait_seconds",
            "Time spent waiting for capacity",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "kvrouter_upstream_retries",
            "Attempts moved to another rank before the first byte",
            ["backend"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvrouter_upstream_errors", "Upstream failures, by kind", ["backend", "kind"], registry=r
        )
        self.disconnects = Counter("kvrouter_client_disconnects", "Clients gone before the end", registry=r)
        self.generated = Counter("kvrouter_generated_tokens", "Output tokens relayed (counted)", registry=r)
        self._state = _StateCollector()
        r.register(self._state)

    def render(self, rows: Sequence[RankRow], queue_depth: int) -> bytes:
        self._state.rows = rows
        self._state.queue_depth = queue_depth
        return generate_latest(self.registry)
