"""The reconcile loop: the only code that polls engines (DESIGN §3 step 7).

Every ``interval_s`` (jittered, so router replicas do not scrape in phase) it polls every backend at
once, each bounded by ``poll_timeout_s``, and writes per-rank truth, drift against the router's own
estimate, and health (with hysteresis) into a :class:`TelemetryStore`. A backend that was down at
startup is re-discovered every ``rediscover_interval_s`` until it answers; one that comes back after
all its ranks went unhealthy is re-discovered too (a restarted engine may have another size).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from router.backends import fetch
from router.backends.base import Backend, BackendError, BackendInfo, RankTelemetry
from router.ledger.base import Ledger
from router.placement.snapshot import RankKey
from router.telemetry_store import TelemetryStore

log = logging.getLogger(__name__)
STOP_RECANCEL_S = 0.1  # stop(): how long a cancelled loop may take to end before it is cancelled again

EstimateFn = Callable[[], Awaitable[Mapping[RankKey, int]]]
DiscoveredHook = Callable[[BackendInfo], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ReconcileSettings:
    interval_s: float = 1.0
    jitter_frac: float = 0.1  # each sleep is interval_s × (1 ± jitter_frac)
    poll_timeout_s: float = 3.0  # per backend per round, on top of the adapters' per-call timeouts
    discover_timeout_s: float = 5.0
    rediscover_interval_s: float = 5.0
    probe_interval_s: float = 5.0  # a rank whose data-plane breaker tripped gets a 1-token request this often

    def __post_init__(self) -> None:
        if min(self.interval_s, self.poll_timeout_s, self.discover_timeout_s, self.probe_interval_s) <= 0:
            raise ValueError("reconcile intervals and timeouts must be positive")
        if not 0 <= self.jitter_frac < 1:
            raise ValueError(f"jitter_frac must be in [0, 1), got {self.jitter_frac}")


def ledger_estimate(ledger: Ledger) -> EstimateFn:
    """The router's own per-rank estimate: the ledger's reserved tokens (what drift is measured against)."""

    async def estimate() -> Mapping[RankKey, int]:
        return {key: u.reserved_tokens for key, u in (await ledger.usage()).items()}

    return estimate


class Reconciler:
    def __init__(
        self,
        backends: Sequence[Backend],
        store: TelemetryStore,
        *,
        http: httpx.AsyncClient | None = None,
        settings: ReconcileSettings | None = None,
        estimate: EstimateFn | None = None,
        on_discovered: DiscoveredHook | None = None,
        rng: random.Random | None = None,
    ) -> None:
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique, got {names}")
        self.backends = tuple(backends)
        self.store = store
        self.settings = settings or ReconcileSettings()
        self._http = http
        self._own_http = http is None
        self._estimate = estimate
        self._on_discovered = on_discovered
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None
        self._next_discovery_s: dict[str, float] = {}
        self._rediscover: set[str] = set()
        self._next_probe_s: dict[RankKey, float] = {}

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """One discovery round (bounded; a backend that is down is retried by the loop), then the loop."""
        if self.running:
            return
        self._client()
        await self.discover()
        self._task = asyncio.create_task(self._run(), name="kvrouter-reconcile")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # Python 3.11's asyncio.wait_for swallows a cancel that lands as its inner call completes (the
            # loop then sleeps on): cancel again until the task has ended.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=STOP_RECANCEL_S)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._sleep_s())
            try:
                await self.tick()
            except Exception:  # the loop must survive anything a backend or hook does
                log.exception("reconcile round failed")

    def _sleep_s(self) -> float:
        j = self.settings.jitter_frac
        return self.settings.interval_s * (1.0 + self._rng.uniform(-j, j))

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.settings.poll_timeout_s)
        return self._http

    # -- discovery ---------------------------------------------------------------------------------------

    async def discover(self, force: bool = False) -> None:
        """Discover every backend not yet known (or due for re-discovery), concurrently."""
        now = asyncio.get_running_loop().time()
        due = [
            b
            for b in self.backends
            if force
            or b.name in self._rediscover
            or (self._incomplete(b.name) and now >= self._next_discovery_s.get(b.name, 0.0))
        ]
        if due:
            await asyncio.gather(*(self._discover_one(b) for b in due))

    def _incomplete(self, name: str) -> bool:
        """Never discovered, or discovered without some ranks (external LB with a pod down)."""
        info = self.store.info(name)
        return info is None or bool(info.extra.get("unverified_ranks"))

    async def _discover_one(self, backend: Backend) -> None:
        self._rediscover.discard(backend.name)
        loop = asyncio.get_running_loop()
        self._next_discovery_s[backend.name] = loop.time() + self.settings.rediscover_interval_s
        try:
            info = await asyncio.wait_for(backend.discover(self._client()), self.settings.discover_timeout_s)
        except Exception as exc:  # any failure means "not yet"; keep the message for /ready
            self.store.set_backend_error(backend.name, f"discovery: {_describe(exc)}")
            log.warning("%s: discovery failed: %s", backend.name, _describe(exc))
            return
        self.store.set_backend_error(backend.name, None)
        if self.store.set_info(info):
            log.info("%s: %s dp=%d page=%d capacity/rank=%s", info.name, info.engine, info.dp_size,
                     info.page_size, info.capacities_tokens)  # fmt: skip
            if self._on_discovered is not None:
                try:
                    await self._on_discovered(info)
                except Exception:
                    log.exception("%s: on_discovered hook failed", backend.name)

    # -- polling -----------------------------------------------------------------------------------------

    async def tick(self) -> None:
        """One reconcile round: discovery where due, then every known backend polled at once."""
        await self.discover()
        polled = [b for b in self.backends if self.store.info(b.name) is not None]
        results = await asyncio.gather(*(self._poll_one(b) for b in polled), return_exceptions=True)
        estimates = await self._estimates()
        for backend, result in zip(polled, results, strict=True):
            self._record(backend, result, estimates)
        await self._probe_tripped()
        self.store.polls += 1

    async def _poll_one(self, backend: Backend) -> list[RankTelemetry]:
        return await asyncio.wait_for(backend.poll(self._client()), self.settings.poll_timeout_s)

    async def _estimates(self) -> Mapping[RankKey, int] | None:
        if self._estimate is None:
            return None
        try:
            return await asyncio.wait_for(self._estimate(), self.settings.poll_timeout_s)
        except Exception as exc:  # ledger down: drift is unknown this round, truth is still recorded
            log.debug("estimate for drift failed: %s", _describe(exc))
            return None

    def _record(
        self,
        backend: Backend,
        result: list[RankTelemetry] | BaseException,
        estimates: Mapping[RankKey, int] | None,
    ) -> None:
        ranks = self.store.backend_ranks(backend.name)
        # Down until this round: every rank unhealthy and none has answered since.
        was_down = bool(ranks) and not any(t.healthy or t.consecutive_successes for t in ranks)
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancellation and friends are not a backend failure
            message = _describe(result)
            self.store.set_backend_error(backend.name, f"poll: {message}")
            for truth in ranks:
                self.store.record_failure(truth.key, message)
            return
        self.store.set_backend_error(backend.name, None)
        for telemetry in result:
            key = RankKey(backend.name, telemetry.rank)
            estimate = None if estimates is None else estimates.get(key, 0)
            self.store.record(key, telemetry, estimate)
        if was_down and any(t.healthy for t in result):
            self._rediscover.add(backend.name)  # it came back: it may have restarted with another shape

    # -- data-plane breaker probes -------------------------------------------------------------------------

    async def _probe_tripped(self) -> None:
        now = asyncio.get_running_loop().time()
        due = [k for k in self.store.tripped() if now >= self._next_probe_s.get(k, 0.0)]
        for key in due:
            self._next_probe_s[key] = now + self.settings.probe_interval_s
        if due:
            await asyncio.gather(*(self._probe(key) for key in due))

    async def _probe(self, key: RankKey) -> None:
        """One-token pinned completion: a 2xx closes the rank's breaker, anything else leaves it open."""
        backend = next((b for b in self.backends if b.name == key.backend), None)
        info = self.store.info(key.backend)
        if backend is None or info is None or not info.models:
            return
        try:
            up = backend.upstream(key.rank, "/v1/completions")
            body = {
                "model": info.models[0],
                "prompt": "ping",
                "max_tokens": 1,
                "stream": False,
                **up.body_fields,
            }
            timeout_s = self.settings.poll_timeout_s
            status = await asyncio.wait_for(
                fetch.post_json(self._client(), up.url, body, timeout_s, headers=up.headers), timeout_s
            )
        except (BackendError, TimeoutError) as exc:
            log.debug("%s: probe failed: %s", key, _describe(exc))
            return
        if 200 <= status < 300:
            log.info("%s: probe succeeded, rank back in rotation", key)
            self.store.report_upstream(key, True)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
