"""vLLM data parallelism (reference/vllm.md §1, §2, §5, §10).

Internal LB (``vllm=URL``): one API server fronts every rank; the rank is pinned with the
``X-data-parallel-rank`` header and each rank's series carry an ``engine`` label. ``num_gpu_blocks`` in
``vllm:cache_config_info`` is summed over the ranks there, so it is divided by the DP size unless the
per-engine ``kv_cache_size_tokens`` label is present.

External LB (``vllm-external=URL0,URL1,...``): one API server per rank, the URL is the pin (a header
other than 0 would be a 400), and each server's ``/metrics`` shows only its own engine.

vLLM has no ``/generate``: :meth:`upstream` raises :class:`UnsupportedRoute` for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import httpx

from router.backends import fetch, prom
from router.backends.base import (
    BackendError,
    BackendInfo,
    BackendSpec,
    EngineKind,
    NotDiscovered,
    RankOutOfRange,
    RankTelemetry,
    Route,
    UnsupportedRoute,
    Upstream,
)

log = logging.getLogger(__name__)

VLLM_ROUTES: tuple[Route, ...] = ("/v1/chat/completions", "/v1/completions")
PIN_HEADER = "X-data-parallel-rank"
CACHE_INFO = "vllm:cache_config_info"
_USAGE, _USAGE_V0 = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
_RUNNING, _WAITING, _PREEMPT = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
)
LOAD_NAMES = (_USAGE, _USAGE_V0, _RUNNING, _WAITING, _PREEMPT)


@dataclass(frozen=True, slots=True)
class EngineCache:
    """One ``engine`` label's ``vllm:cache_config_info``."""

    engine: str
    block_size: int
    num_gpu_blocks: int | None
    kv_cache_size_tokens: int | None

    def capacity_tokens(self, engines_sharing_blocks: int) -> int | None:
        if self.kv_cache_size_tokens:
            return self.kv_cache_size_tokens - self.kv_cache_size_tokens % self.block_size
        if not self.num_gpu_blocks:
            return None
        return (self.num_gpu_blocks // engines_sharing_blocks) * self.block_size


def _engine_order(label: str) -> tuple[int, str]:
    n = fetch.as_int(label)
    return (n if n is not None else 1 << 30, label)


def parse_cache_config(samples: Collection[prom.Sample]) -> dict[str, EngineCache]:
    out: dict[str, EngineCache] = {}
    for s in samples:
        if s.name != CACHE_INFO:
            continue
        engine = s.labels.get("engine", "0")
        out[engine] = EngineCache(
            engine=engine,
            block_size=fetch.as_int(s.labels.get("block_size")) or 16,
            num_gpu_blocks=fetch.as_int(s.labels.get("num_gpu_blocks")),
            kv_cache_size_tokens=fetch.as_int(s.labels.get("kv_cache_size_tokens")),
        )
    return dict(sorted(out.items(), key=lambda kv: _engine_order(kv[0])))


@dataclass(slots=True)
class EngineLoad:
    usage_frac: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: int | None = None


def _add(a: int | None, b: float) -> int:
    return (a or 0) + int(b)


def parse_loads(samples: Collection[prom.Sample]) -> dict[str, EngineLoad]:
    """Per ``engine`` label; several ``model_name`` series (LoRA) of one engine are summed."""
    out: dict[str, EngineLoad] = {}
    for s in samples:
        if s.value != s.value:  # NaN
            continue
        load = out.setdefault(s.labels.get("engine", "0"), EngineLoad())
        if s.name == _USAGE or (s.name == _USAGE_V0 and load.usage_frac is None):
            load.usage_frac = max(load.usage_frac or 0.0, s.value)
        elif s.name == _RUNNING:
            load.running = _add(load.running, s.value)
        elif s.name == _WAITING:
            load.waiting = _add(load.waiting, s.value)
        elif s.name == _PREEMPT:
            load.preemptions_total = _add(load.preemptions_total, s.value)
    return out


def to_telemetry(rank: int, load: EngineLoad | None, capacity_tokens: int) -> RankTelemetry:
    if load is None:  # the engine's series vanished: count it as a failed probe
        return RankTelemetry(rank=rank, healthy=False)
    used = None if load.usage_frac is None else round(min(max(load.usage_frac, 0.0), 1.0) * capacity_tokens)
    return RankTelemetry(
        rank=rank,
        used_tokens=used,
        running=load.running,
        waiting=load.waiting,
        capacity_tokens=capacity_tokens,
        preemptions_total=load.preemptions_total,
    )


class _VLLMBase:
    """What both LB modes share: models, timeouts, route checks, precomputed upstreams."""

    engine_kind: EngineKind = "vllm"

    def __init__(self, spec: BackendSpec, *, timeout_s: float = fetch.DEFAULT_TIMEOUT_S):
        if spec.engine != self.engine_kind or not spec.urls:
            raise ValueError(f"{type(self).__name__} needs a {self.engine_kind} spec with URLs, got {spec}")
        self.spec = spec
        self.timeout_s = timeout_s
        self.info: BackendInfo | None = None
        self._upstreams: dict[tuple[int, str], Upstream] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    async def _scrape(self, http: httpx.AsyncClient, url: str, names: Collection[str]) -> list[prom.Sample]:
        return prom.parse_samples(await fetch.get_text(http, f"{url}/metrics", self.timeout_s), names)

    async def _models_from(self, http: httpx.AsyncClient, urls: Sequence[str]) -> tuple[tuple[str, ...], int]:
        """``/v1/models`` of the first URL that answers (all ranks serve the same model)."""
        last: BackendError = BackendError(f"{self.name}: no URL to ask for /v1/models")
        for url in urls:
            try:
                ids, max_model_len = await fetch.get_models(http, url, self.timeout_s)
            except BackendError as exc:
                last = exc
                continue
            if not max_model_len:
                raise BackendError(f"{url}/v1/models: no max_model_len")
            return ids, max_model_len
        raise last

    def _build_upstream(self, rank: int, route: Route) -> Upstream:
        raise NotImplementedError

    def _set_info(self, info: BackendInfo) -> None:
        self._upstreams = {
            (r, route): self._build_upstream(r, route) for r in range(info.dp_size) for route in VLLM_ROUTES
        }
        self.info = info

    def upstream(self, rank: int, route: Route) -> Upstream:
        target = self._upstreams.get((rank, route))
        if target is not None:
            return target
        if route not in VLLM_ROUTES:
            raise UnsupportedRoute(f"{self.name}: vLLM has no {route} route (use /v1/completions)")
        if self.info is None:
            raise NotDiscovered(f"{self.name}: DP size not discovered yet")
        raise RankOutOfRange(f"{self.name}: rank {rank} out of range [0, {self.info.dp_size})")

    async def abort(self, http: httpx.AsyncClient, rank: int, request_id: str) -> None:
        """vLLM aborts a request when its HTTP connection closes; there is no abort endpoint."""


class VLLMBackend(_VLLMBase):
    """Internal LB: one URL, rank pinned by header; rank i is the i-th ``engine`` label in order."""

    engine_kind: EngineKind = "vllm"

    def __init__(self, spec: BackendSpec, *, timeout_s: float = fetch.DEFAULT_TIMEOUT_S):
        super().__init__(spec, timeout_s=timeout_s)
        self._engines: dict[str, int] = {}  # engine label -> rank index (node-local under hybrid LB)

    async def discover(self, http: httpx.AsyncClient) -> BackendInfo:
        url = self.spec.urls[0]
        samples, (models, max_model_len) = await asyncio.gather(
            self._scrape(http, url, (CACHE_INFO,)), self._models_from(http, [url])
        )
        caches = parse_cache_config(samples)
        if not caches:
            raise BackendError(f"{url}/metrics: no {CACHE_INFO} series (engine not ready?)")
        capacities = tuple(c.capacity_tokens(len(caches)) for c in caches.values())
        if any(c is None or c <= 0 for c in capacities):
            raise BackendError(f"{url}/metrics: {CACHE_INFO} has no usable num_gpu_blocks yet")
        info = BackendInfo(
            name=self.name,
            engine="vllm",
            url=url,
            models=models,
            dp_size=len(caches),
            page_size=next(iter(caches.values())).block_size,
            max_model_len=max_model_len,
            capacities_tokens=tuple(c for c in capacities if c is not None),
            extra={"engines": list(caches), "pin": "header"},
        )
        self._engines = {label: i for i, label in enumerate(caches)}
        self._set_info(info)
        return info

    def _build_upstream(self, rank: int, route: Route) -> Upstream:
        return Upstream(url=self.spec.urls[0] + route, headers=MappingProxyType({PIN_HEADER: str(rank)}))

    async def poll(self, http: httpx.AsyncClient) -> list[RankTelemetry]:
        info = self.info
        if info is None:
            raise NotDiscovered(f"{self.name}: DP size not discovered yet")
        loads = parse_loads(await self._scrape(http, self.spec.urls[0], LOAD_NAMES))
        by_rank = {self._engines[e]: load for e, load in loads.items() if e in self._engines}
        return [to_telemetry(r, by_rank.get(r), info.capacities_tokens[r]) for r in range(info.dp_size)]


class VLLMExternalBackend(_VLLMBase):
    """External LB: URL i serves rank i alone; no header (any value but 0 is a 400 there)."""

    engine_kind: EngineKind = "vllm-external"

    async def discover(self, http: httpx.AsyncClient) -> BackendInfo:
        """Every rank that answers gives its own pool; a rank that does not (one pod restarting) must not
        keep the others out: it is listed in ``extra["unverified_ranks"]``, assumed as large as the
        smallest answering rank, starts unhealthy, and the reconcile loop re-discovers until it answers."""
        results = await asyncio.gather(
            *(self._rank_cache(http, u) for u in self.spec.urls), return_exceptions=True
        )
        caches = [r for r in results if isinstance(r, EngineCache)]
        errors = [r for r in results if isinstance(r, BaseException)]
        for err in errors:
            if not isinstance(err, BackendError):
                raise err
        if not caches:
            raise errors[0]
        answered = [u for u, r in zip(self.spec.urls, results, strict=True) if isinstance(r, EngineCache)]
        models, max_model_len = await self._models_from(http, answered)
        fallback_tokens = min(c.capacity_tokens(1) or 0 for c in caches)
        block_sizes = sorted({c.block_size for c in caches})
        if len(block_sizes) != 1:
            log.warning("%s: ranks disagree on block_size %s; using the largest", self.name, block_sizes)
        info = BackendInfo(
            name=self.name,
            engine="vllm-external",
            url=self.spec.display_url,
            models=models,
            dp_size=len(self.spec.urls),
            page_size=block_sizes[-1],
            max_model_len=max_model_len,
            capacities_tokens=tuple(
                (r.capacity_tokens(1) or 0) if isinstance(r, EngineCache) else fallback_tokens
                for r in results
            ),
            extra={
                "engines": [r.engine if isinstance(r, EngineCache) else None for r in results],
                "pin": "url",
                "unverified_ranks": tuple(i for i, r in enumerate(results) if not isinstance(r, EngineCache)),
            },
        )
        self._set_info(info)
        return info

    async def _rank_cache(self, http: httpx.AsyncClient, url: str) -> EngineCache:
        caches = parse_cache_config(await self._scrape(http, url, (CACHE_INFO,)))
        if len(caches) != 1:
            raise BackendError(f"{url}/metrics: expected one engine's {CACHE_INFO}, found {len(caches)}")
        cache = next(iter(caches.values()))
        if not cache.capacity_tokens(1):  # one engine per server: its own, unsummed count
            raise BackendError(f"{url}/metrics: {CACHE_INFO} has no usable num_gpu_blocks yet")
        return cache

    def _build_upstream(self, rank: int, route: Route) -> Upstream:
        return Upstream(url=self.spec.urls[rank] + route)

    async def poll(self, http: httpx.AsyncClient) -> list[RankTelemetry]:
        info = self.info
        if info is None:
            raise NotDiscovered(f"{self.name}: DP size not discovered yet")
        scrapes = await asyncio.gather(
            *(self._scrape(http, u, LOAD_NAMES) for u in self.spec.urls), return_exceptions=True
        )
        out = []
        for rank, result in enumerate(scrapes):
            if isinstance(result, BaseException):
                if not isinstance(result, BackendError):
                    raise result
                log.debug("%s: rank %d: %s", self.name, rank, result)
                out.append(RankTelemetry(rank=rank, healthy=False))
                continue
            loads = parse_loads(result)
            load = next(iter(loads.values())) if len(loads) == 1 else None
            out.append(to_telemetry(rank, load, info.capacities_tokens[rank]))
        return out
