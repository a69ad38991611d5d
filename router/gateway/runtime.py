"""The gateway's process-wide resources, built in the app lifespan and torn down with it.

One upstream client (the data plane: router/upstream, a keep-alive pool per engine), one httpx client
(the control plane: discovery, polls, aborts), the ledger, the backends and their reconcile loop, the
metrics registry, and every live flight (so shutdown can release what is still held).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from router.backends.base import Backend, BackendInfo
from router.backends.factory import make_backend
from router.config import Settings
from router.ledger.base import Ledger, LedgerUnavailable
from router.ledger.factory import build_ledger
from router.placement import get_policy
from router.placement.snapshot import RankKey
from router.reconcile import Reconciler, ReconcileSettings
from router.sizing import Sizer, load_tokenizer
from router.telemetry import LocalState, Metrics
from router.telemetry_ledger import TimedLedger
from router.telemetry_state import RankRow, RankStateCollector, UsageCache, rank_rows
from router.telemetry_store import TelemetryStore
from router.upstream import UpstreamClient

from .flight import Flight, LocalLoad
from .output_plan import build_book, growth_check_at, learned_tokens
from .placement import Placer
from .waitqueue import WaitQueue

log = logging.getLogger(__name__)
ABORT_TASK = "kvrouter-abort"
# Idle engine connections close before uvicorn's 5 s keep-alive timeout (SGLang and vLLM serve with it)
# would close them under a request; the client still retries that race once.
UPSTREAM_IDLE_TIMEOUT_S = 4.0
UPSTREAM_MAX_IDLE_PER_ORIGIN = 256


def build_sizer(settings: Settings) -> Sizer:
    tokenizer = load_tokenizer(settings.tokenizer_path) if settings.tokenizer_path else None
    return Sizer(
        default_max_tokens=settings.default_max_tokens,
        bytes_per_token=settings.bytes_per_token,
        safety_factor=settings.estimate_safety_factor,
        message_overhead_tokens=settings.chat_message_overhead_tokens,
        tokenizer=tokenizer,
    )


class Gateway:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.sizer = build_sizer(settings)
        self.backends: dict[str, Backend] = {
            spec.name: make_backend(spec, timeout_s=settings.connect_timeout_s)
            for spec in settings.backend_specs()
        }
        inner = build_ledger(
            settings.redis_url,
            failure_mode=settings.ledger_failure_mode,
            lease_ttl_s=settings.lease_ttl_s,
            namespace=settings.ledger_namespace,
            replicas=settings.replicas * settings.workers,  # every process that may book while Redis is down
            socket_timeout_s=settings.ledger_timeout_s,
            shm_path=settings.ledger_path,  # set by `serve --workers N` (the parent made the file)
        )
        self.ledger: Ledger = TimedLedger(inner, metrics.ledger_seconds, metrics.ledger_errors)
        self.usage = UsageCache(self.ledger)  # the reconcile loop's ledger snapshot, behind /metrics
        self.store = TelemetryStore()
        self.load = LocalLoad()
        self.queue = WaitQueue(settings.queue_max, settings.queue_timeout_s)
        self.book, self.share = build_book(settings, metrics.reservations)  # output reservations
        self.placer = Placer(
            self.ledger,
            self.store,
            get_policy(settings.policy),
            self.load,
            self.queue,
            metrics,
            book=self.book,
        )
        self.flights: dict[str, Flight] = {}
        self.control = httpx.AsyncClient(timeout=settings.connect_timeout_s)
        self.reconciler = Reconciler(
            list(self.backends.values()),
            self.store,
            http=self.control,
            settings=ReconcileSettings(
                interval_s=settings.reconcile_interval_s, probe_interval_s=settings.probe_interval_s
            ),
            estimate=self.usage.estimate,
            on_discovered=self._discovered,
        )
        self.upstream: UpstreamClient | None = None
        self.upstream_timeout_s = settings.request_timeout_s  # the whole exchange, stream included
        self._background: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        engines = {name: b.spec.engine for name, b in self.backends.items()}
        metrics.attach(RankStateCollector(self.store, self.usage, engines), self._local_state)

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        # Sends only the headers given (no Accept-Encoding: bytes are relayed as the engine sent them).
        self.upstream = UpstreamClient(
            connect_timeout_s=self.settings.connect_timeout_s,
            max_idle_per_origin=UPSTREAM_MAX_IDLE_PER_ORIGIN,
            idle_timeout_s=UPSTREAM_IDLE_TIMEOUT_S,
        )
        await self.reconciler.start()
        self._renewer = asyncio.create_task(self._renew_loop(), name="kvrouter-lease-renew")
        if self.share is not None:  # cancelled with the other background tasks at stop
            share = asyncio.create_task(self.share.run(self.settings.reservation_share_interval_s))
            self._background.add(share)
            share.add_done_callback(self._background.discard)
        await self.metrics.start()

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self.reconciler.stop()
        for flight in list(self.flights.values()):  # anything still held at shutdown is released
            flight.outcome = "shutdown"
            await self.finish(flight, 503)
        aborts = [t for t in self._background if t.get_name() == ABORT_TASK]
        if aborts:  # engine-side aborts already under way get to finish (each bounded by its timeout)
            await asyncio.wait(aborts, timeout=self.settings.connect_timeout_s)
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.upstream is not None:
            await self.upstream.close()
        await self.control.aclose()
        await self.ledger.close()
        if self.share is not None:
            await self.share.close()
        await self.metrics.stop()

    async def _discovered(self, info: BackendInfo) -> None:
        await self.ledger.register({RankKey(info.name, r): c for r, c in enumerate(info.capacities_tokens)})
        self.queue.wake()

    async def _renew_loop(self) -> None:
        """Keep the leases of live flights from expiring (a lost router lets them lapse)."""
        period_s = self.settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period_s)
            if self.flights:
                try:
                    await self.ledger.renew(list(self.flights))
                except LedgerUnavailable as exc:
                    log.warning("lease renew failed: %s", exc)
            self.queue.wake()

    # -- flights -----------------------------------------------------------------------------------------

    def begin(self, flight: Flight) -> None:
        self.flights[flight.request_id] = flight

    async def unplace(self, flight: Flight) -> None:
        """Give back a rank before retrying elsewhere."""
        self.book.finished(flight.request_id, None)
        flight.on_unplaced(self.load)
        await self._release(flight.request_id)

    async def finish(self, flight: Flight, status: int) -> None:
        """Release exactly once and record the outcome, whatever path ends the request."""
        if flight.finished:
            return
        flight.finished = True
        self.flights.pop(flight.request_id, None)
        if flight.generated_tokens:
            self.metrics.generated.inc(flight.generated_tokens)
        self.book.finished(flight.request_id, learned_tokens(flight, status))
        flight.on_unplaced(self.load)
        await self._release(flight.request_id)
        self.metrics.finished(flight.route, flight.model, status, time.perf_counter() - flight.arrived_s)
        if flight.outcome == "client_disconnect":
            self.metrics.disconnects.inc()

    async def _release(self, request_id: str) -> None:
        try:
            await self.ledger.release(request_id)
        except LedgerUnavailable as exc:  # the lease will lapse; nothing else can be done now
            log.warning("release of %s failed: %s", request_id, exc)
        self.queue.wake()

    async def report_tokens(self, flight: Flight) -> None:
        """Tell the ledger how far generation got; grow the reservation once it no longer holds the next
        token (the book says by how much: whole pages, plus the configured step)."""
        delta = flight.generated_tokens - flight.reported_tokens
        if delta <= 0 or flight.key is None:
            return
        flight.reported_tokens = generated = flight.generated_tokens
        rid, page = flight.request_id, self._page_size(flight.key)
        try:
            await self.ledger.add_generated(rid, delta)
            step = self.book.growth(rid, generated, page)
            if step:
                ok = await self.ledger.grow(rid, step)
                self.book.grown(rid, step, ok)
                flight.grown_tokens += step if ok else 0
        except LedgerUnavailable as exc:
            log.debug("token report for %s failed: %s", rid, exc)
        flight.grow_at_tokens = growth_check_at(self.book, rid, generated, page)

    def _page_size(self, key: RankKey) -> int:
        info = self.store.info(key.backend)
        return info.page_size if info is not None else 1

    def abort_upstream(self, flight: Flight) -> None:
        """Best-effort engine-side abort by id, in the background (never delays the release)."""
        if flight.key is None or flight.rid is None:
            return
        backend = self.backends.get(flight.key.backend)
        if backend is None:
            return
        task = asyncio.create_task(backend.abort(self.control, flight.key.rank, flight.rid), name=ABORT_TASK)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- views -------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        return any(truth.healthy for truth in self.store.ranks().values())

    async def rank_rows(self) -> list[RankRow]:
        """/ranks: a live ledger read (an operator's question deserves the current answer)."""
        try:
            usage = await self.ledger.usage()
        except LedgerUnavailable:
            usage = {}
        return rank_rows(self.store.ranks(), usage)

    def _local_state(self) -> LocalState:
        """Per-process values for /metrics: this worker's queue and the prompts it has not seen answered."""
        prefill = {key: self.load.get(key).prefill_tokens for key in self.store.ranks()}
        return LocalState(self.queue.depth, prefill)
