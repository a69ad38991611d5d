"""Prometheus metrics of one gateway, in its own registry (no global one, so apps and tests stay apart).

Three kinds of series, three sources (docs/observability.md has the whole model):

* request-path counters and histograms, updated as requests pass. They are per process; with
  ``kvrouter serve --workers N`` they live in prometheus_client's multiprocess files and every scrape,
  whichever worker answers it, sums all workers;
* per-process gauges (admission queue depth, prompt tokens forwarded but not yet answered per rank),
  published from memory at scrape time and, with several workers, every ``publish_interval_s``;
* per-rank gauges (capacity, reserved, in flight, engine truth, drift, health), built at scrape time by
  :class:`router.telemetry_state.RankStateCollector` from in-memory state: a scrape never reaches the
  ledger or a backend.

Labels are bounded: ``backend``/``rank`` come from configured backends, ``model`` only from the models the
backends serve (requests for anything else are refused before a label is made), ``reason``/``kind``/``op``
from fixed sets in the code. No request ids, prompts or client values ever become labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.registry import Collector

from router.placement.snapshot import RankKey
from router.telemetry_reservation import ReservationMetrics
from router.telemetry_state import RankRow as RankRow  # re-exported: the gateway's /ranks rows
from router.telemetry_text import render_text

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Buckets for LLM serving. TTFT: a cached short prompt answers in ms; a 128k-token prefill behind a full
# queue takes minutes. ITL: DeepSeek-V3 decode steps are ~30-70 ms (calibration.md), stalls up to seconds
# when another rank prefills. Duration: up to the 600 s default request timeout and beyond.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                  15.0, 20.0, 30.0, 60.0, 120.0, 300.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0,
                      600.0, 1200.0)  # fmt: skip
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                        60.0, 120.0)  # fmt: skip
LEDGER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)  # fmt: skip

MAX_SPREAD_TOKENS = 4096  # bounds the per-chunk loop of observe_spread (a chunk is far smaller)

LEDGER_OPS = ("register", "reserve", "grow", "shrink", "add_generated", "release", "renew", "expire",
              "get", "usage")  # fmt: skip


@dataclass(frozen=True, slots=True)
class LocalState:
    """What only this process knows: its admission queue and the prompts it forwarded, not yet answered."""

    queue_depth: int = 0
    prefill_tokens: Mapping[RankKey, int] = field(default_factory=dict)


LocalSource = Callable[[], LocalState]


def multiprocess_dir(workers: int) -> str | None:
    """The shared metrics directory when this process is one of several workers behind one port."""
    return os.environ.get(MULTIPROC_ENV) if workers > 1 else None


def prepare_multiprocess_dir() -> str:
    """Before spawning workers: an empty metrics directory, named in the environment they inherit.

    prometheus_client picks its value store when it is first imported, from this variable, so it must be
    set before the workers start (uvicorn spawns fresh interpreters). Files of a previous run are removed:
    their counters would otherwise be summed into this one's.
    """
    path = os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix="kvrouter-metrics-")
    Path(path).mkdir(parents=True, exist_ok=True)
    for stale in Path(path).glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_ENV] = path
    return path


class Metrics:
    def __init__(
        self, *, policy: str = "", multiprocess_dir: str | None = None, publish_interval_s: float = 1.0
    ) -> None:
        self.policy = policy
        self.multiprocess_dir = multiprocess_dir
        self.publish_interval_s = publish_interval_s
        # The metric objects' own registry. Single process: it is the one exposed. Several workers: it is
        # never exposed; the values go through the multiprocess files, read by MultiProcessCollector.
        r = CollectorRegistry(auto_describe=True)
        self.registry = r if multiprocess_dir is None else CollectorRegistry(auto_describe=True)
        if multiprocess_dir is not None:
            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
        self._build_request_path(r)
        self._build_internals(r)
        self.reservations = ReservationMetrics(r)  # the reservation book's meter, and its quantile gauge
        self.registry.register(self.reservations)
        self._local: LocalSource | None = None
        self._publisher: asyncio.Task[None] | None = None
        self._placed: dict[RankKey, Counter] = {}
        self._finished: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        self._queue_wait: dict[str, Histogram] = {}
        self._ttft: dict[tuple[str, str], Histogram] = {}
        self._itl: dict[tuple[str, str], Histogram] = {}

    def _build_request_path(self, r: CollectorRegistry) -> None:
        """What a request passes through: answered, refused, placed, how long it took."""
        self.requests = Counter(
            "kvrouter_requests",
            "Requests answered, by route, HTTP status and model",
            ["route", "code", "model"],
            registry=r,
        )
        self.rejections = Counter(
            "kvrouter_rejections", "Requests refused by the router, by reason", ["reason"], registry=r
        )
        self.placements = Counter(
            "kvrouter_placements",
            "Placement decisions (reservations made), by rank",
            ["policy", "backend", "rank"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvrouter_ttft_seconds",
            "Streamed requests: arrival to first upstream byte",
            ["route", "model"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "kvrouter_inter_token_latency_seconds",
            "Gap between streamed tokens as relayed (a chunk's gap split over its tokens)",
            ["route", "model"],
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.duration = Histogram(
            "kvrouter_request_duration_seconds",
            "Arrival to last byte",
            ["route", "model"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvrouter_queue_wait_seconds",
            "Time from arrival at admission to a reservation (or to giving up)",
            ["outcome"],
            buckets=QUEUE_WAIT_BUCKETS_S,
            registry=r,
        )

    def _build_internals(self, r: CollectorRegistry) -> None:
        """Upstreams, the ledger, and the per-process gauges."""
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
        self.ledger_seconds = Histogram(
            "kvrouter_ledger_operation_seconds",
            "Ledger call latency, by operation",
            ["op"],
            buckets=LEDGER_BUCKETS_S,
            registry=r,
        )
        self.ledger_errors = Counter(
            "kvrouter_ledger_errors", "Ledger calls that found the store unavailable", ["op"], registry=r
        )
        self.queue_depth = Gauge(
            "kvrouter_queue_depth",
            "Requests waiting for KV capacity",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefill_queued = Gauge(
            "kvrouter_rank_prefill_queued_tokens",
            "Prompt tokens forwarded to the rank and not yet answered (router view)",
            ["backend", "rank"],
            registry=r,
            multiprocess_mode="livesum",
        )

    # -- wiring ------------------------------------------------------------------------------------------

    def attach(self, rank_state: Collector, local: LocalSource) -> None:
        """Expose ``rank_state`` (per-rank gauges) and read per-process state from ``local``."""
        self.registry.register(rank_state)
        self._local = local

    async def start(self) -> None:
        """With several workers, keep this worker's per-process gauges fresh for the others' scrapes."""
        if self.multiprocess_dir is not None and self._publisher is None:
            self._publisher = asyncio.create_task(self._publish_loop(), name="kvrouter-metrics-publish")

    async def stop(self) -> None:
        task, self._publisher = self._publisher, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.multiprocess_dir is not None:  # this worker's live gauges leave the sums
            multiprocess.mark_process_dead(os.getpid(), self.multiprocess_dir)  # type: ignore[no-untyped-call]

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.publish_interval_s)
            try:
                self.publish()
            except Exception:  # a metrics hiccup must never stop the worker
                log.exception("publishing local metrics failed")

    def publish(self) -> None:
        if self._local is None:
            return
        state = self._local()
        self.queue_depth.set(state.queue_depth)
        for key, tokens in state.prefill_tokens.items():
            self.prefill_queued.labels(key.backend, str(key.rank)).set(max(0, tokens))

    def render(self) -> bytes:
        """The exposition: local gauges published, then every collector read from memory."""
        self.publish()
        return render_text(self.registry)

    # -- request path ------------------------------------------------------------------------------------

    # Labelled children are bound once and kept (labels() costs a lock and a dict walk per call); every
    # label set here is bounded (see the module docstring), so these dicts are too.

    def placed(self, key: RankKey) -> None:
        child = self._placed.get(key)
        if child is None:
            child = self._placed[key] = self.placements.labels(self.policy, key.backend, str(key.rank))
        child.inc()

    def finished(self, route: str, model: str, status: int, duration_s: float) -> None:
        children = self._finished.get((route, model, status))
        if children is None:
            children = self._finished[(route, model, status)] = (
                self.requests.labels(route, str(status), model),
                self.duration.labels(route, model),
            )
        children[0].inc()
        children[1].observe(duration_s)

    def queue_waited(self, outcome: str, wait_s: float) -> None:
        child = self._queue_wait.get(outcome)
        if child is None:
            child = self._queue_wait[outcome] = self.queue_wait.labels(outcome)
        child.observe(wait_s)

    def ttft_of(self, route: str, model: str) -> Histogram:
        child = self._ttft.get((route, model))
        if child is None:
            child = self._ttft[(route, model)] = self.ttft.labels(route, model)
        return child

    def itl_of(self, route: str, model: str) -> Histogram:
        child = self._itl.get((route, model))
        if child is None:
            child = self._itl[(route, model)] = self.itl.labels(route, model)
        return child


def observe_spread(child: Histogram, gap_s: float, tokens: int) -> None:
    """``tokens`` arrived together after ``gap_s``: one observation each, the gap split between them, so
    the histogram's sum stays the streaming time and its count the number of token gaps."""
    per_token_s = gap_s / tokens
    for _ in range(min(tokens, MAX_SPREAD_TOKENS)):
        child.observe(per_token_s)
