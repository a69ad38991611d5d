"""SGLang with ``--enable-dp-attention``: discovery, rank pinning, per-rank load (reference/sglang.md).

One URL: every rank behind one HTTP server, pinned by the body fields ``routed_dp_rank`` (new servers)
and ``data_parallel_rank`` (old servers) plus, on OpenAI routes, the ``X-Data-Parallel-Rank`` header
(``/generate`` ignores the header upstream). Several URLs: per-rank HTTP ports (``SGLANG_RUST_SERVER=1``),
the URL is the pin; ``/server_info`` and ``/v1/loads`` are still read from the first URL (all ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import httpx

from router.backends import fetch, prom
from router.backends.base import (
    OPENAI_ROUTES,
    BackendError,
    BackendInfo,
    BackendSpec,
    NotDiscovered,
    RankOutOfRange,
    RankTelemetry,
    Route,
    UnsupportedRoute,
    Upstream,
)

log = logging.getLogger(__name__)

SGLANG_ROUTES: tuple[Route, ...] = ("/v1/chat/completions", "/v1/completions", "/generate")
_USED, _RUNNING, _QUEUED = "sglang:num_used_tokens", "sglang:num_running_reqs", "sglang:num_queue_reqs"
_CAPACITY, _RETRACTED = "sglang:max_total_num_tokens", "sglang:num_retracted_requests_total"
_METRIC_NAMES = (_USED, _RUNNING, _QUEUED, _CAPACITY, _RETRACTED)
# Per-rank load sources, best first: /v1/loads is exact and on demand; /metrics gauges refresh only every
# prefill or 40 decode steps; /get_load counts waiting-queue tokens as used.
LOAD_SOURCES = ("/v1/loads", "/metrics", "/get_load")


class SGLangBackend:
    def __init__(
        self, spec: BackendSpec, *, timeout_s: float = fetch.DEFAULT_TIMEOUT_S, metrics_every: int = 5
    ):
        if spec.engine != "sglang" or not spec.urls:
            raise ValueError(f"SGLangBackend needs an sglang spec with a URL, got {spec}")
        self.spec = spec
        self.timeout_s = timeout_s
        self.metrics_every = max(1, metrics_every)  # /metrics is scraped every Nth poll, for preemptions only
        self.info: BackendInfo | None = None
        self.load_source: str | None = None
        self._base = spec.urls[0]
        self._per_rank_urls = len(spec.urls) > 1
        self._upstreams: dict[tuple[int, str], Upstream] = {}
        self._preemptions: dict[int, int] = {}
        self._polls = 0

    @property
    def name(self) -> str:
        return self.spec.name

    # -- discovery ---------------------------------------------------------------------------------------

    async def discover(self, http: httpx.AsyncClient) -> BackendInfo:
        server_info = await self._server_info(http)
        dp_size = _attention_dp_size(server_info)
        if self._per_rank_urls and len(self.spec.urls) != dp_size:
            raise BackendError(
                f"{self._base}: dp_size is {dp_size} but {len(self.spec.urls)} per-rank URLs given"
            )
        page_size = fetch.as_int(server_info.get("page_size")) or 1
        capacities, capacity_source = await self._capacities(http, server_info, dp_size)
        models, max_model_len = await self._models(http, server_info)
        info = BackendInfo(
            name=self.name,
            engine="sglang",
            url=self.spec.display_url,
            models=models,
            dp_size=dp_size,
            page_size=page_size,
            max_model_len=max_model_len,
            capacities_tokens=capacities,
            extra={
                "model_path": server_info.get("model_path"),
                "served_model_name": server_info.get("served_model_name"),
                "version": server_info.get("version"),
                "enable_dp_attention": server_info.get("enable_dp_attention"),
                "capacity_source": capacity_source,
                "pin": "url" if self._per_rank_urls else "body+header",
            },
        )
        self._set_info(info)
        return info

    async def _server_info(self, http: httpx.AsyncClient) -> dict[str, Any]:
        try:
            body = await fetch.get_json(http, f"{self._base}/server_info", self.timeout_s)
        except fetch.EndpointMissing:  # servers before the rename only have the deprecated path
            body = await fetch.get_json(http, f"{self._base}/get_server_info", self.timeout_s)
        return fetch.as_dict(body, f"{self._base}/server_info")

    async def _capacities(
        self, http: httpx.AsyncClient, server_info: Mapping[str, Any], dp_size: int
    ) -> tuple[tuple[int, ...], str]:
        """Per-rank KV pool: internal_states, else /v1/loads, else rank 0's max_total_num_tokens for all."""
        states = server_info.get("internal_states")
        if isinstance(states, list) and len(states) == dp_size:
            caps = [_token_capacity(s) for s in states]
            if all(c is not None and c > 0 for c in caps):
                return tuple(c for c in caps if c is not None), "internal_states"
        try:
            loads = await self._loads_json(http)
            by_rank = {t.rank: t.capacity_tokens for t in loads}
            if all((by_rank.get(r) or 0) > 0 for r in range(dp_size)):
                return tuple(int(by_rank[r] or 0) for r in range(dp_size)), "/v1/loads"
        except BackendError as exc:
            log.debug("%s: /v1/loads unusable for capacity: %s", self.name, exc)
        rank0 = fetch.as_int(server_info.get("max_total_num_tokens"))
        if rank0 is None or rank0 <= 0:
            raise BackendError(f"{self._base}: no per-rank KV capacity in /server_info or /v1/loads")
        return (rank0,) * dp_size, "max_total_num_tokens"

    async def _models(
        self, http: httpx.AsyncClient, server_info: Mapping[str, Any]
    ) -> tuple[tuple[str, ...], int]:
        fallback_len = fetch.as_int(server_info.get("context_length"))
        if (
            fallback_len is None
            and (max_input := fetch.as_int(server_info.get("max_req_input_len"))) is not None
        ):
            fallback_len = max_input + 1
        try:
            ids, max_model_len = await fetch.get_models(http, self._base, self.timeout_s)
        except BackendError as exc:
            log.warning("%s: /v1/models failed (%s); using /server_info", self.name, exc)
            ids, max_model_len = (), None
        if not ids:
            served = server_info.get("served_model_name") or server_info.get("model_path")
            ids = (str(served),) if served else ()
        max_model_len = max_model_len or fallback_len
        if not max_model_len:
            raise BackendError(f"{self._base}: context length unknown (no max_model_len in /v1/models)")
        return ids, max_model_len

    def _set_info(self, info: BackendInfo) -> None:
        """Precompute every (rank, route) target: upstream() is on the request hot path."""
        upstreams: dict[tuple[int, str], Upstream] = {}
        for rank in range(info.dp_size):
            for route in SGLANG_ROUTES:
                upstreams[(rank, route)] = self._build_upstream(rank, route)
        self._upstreams = upstreams
        self.info = info

    # -- pinning -----------------------------------------------------------------------------------------

    def _build_upstream(self, rank: int, route: Route) -> Upstream:
        if self._per_rank_urls:
            return Upstream(url=self.spec.urls[rank] + route)
        body = MappingProxyType({"routed_dp_rank": rank, "data_parallel_rank": rank})
        headers: Mapping[str, str] = MappingProxyType(
            {"X-Data-Parallel-Rank": str(rank)} if route in OPENAI_ROUTES else {}
        )
        return Upstream(url=self._base + route, headers=headers, body_fields=body)

    def upstream(self, rank: int, route: Route) -> Upstream:
        target = self._upstreams.get((rank, route))
        if target is not None:
            return target
        if route not in SGLANG_ROUTES:
            raise UnsupportedRoute(f"{self.name}: SGLang backend does not serve {route}")
        if self.info is None:
            raise NotDiscovered(f"{self.name}: DP size not discovered yet")
        raise RankOutOfRange(f"{self.name}: rank {rank} out of range [0, {self.info.dp_size})")

    # -- telemetry ---------------------------------------------------------------------------------------

    async def poll(self, http: httpx.AsyncClient) -> list[RankTelemetry]:
        if self.info is None:
            raise NotDiscovered(f"{self.name}: DP size not discovered yet")
        self._polls += 1
        found = await self._poll_source(http)
        if self.load_source != "/metrics" and (self._polls - 1) % self.metrics_every == 0:
            await self._refresh_preemptions(http)
        by_rank = {t.rank: t for t in found if 0 <= t.rank < self.info.dp_size}
        out = []
        for rank in range(self.info.dp_size):
            t = by_rank.get(rank)
            if t is None:  # the engine did not report this rank: count it as a failed probe
                out.append(RankTelemetry(rank=rank, healthy=False))
            else:
                out.append(_with_preemptions(t, self._preemptions.get(rank)))
        return out

    async def _poll_source(self, http: httpx.AsyncClient) -> list[RankTelemetry]:
        sources = (self.load_source,) if self.load_source else LOAD_SOURCES
        last: BackendError | None = None
        for source in sources:
            try:
                found = await self._read(http, source)
            except fetch.EndpointMissing as exc:
                last = exc
                continue  # this version lacks it: try the next source
            if self.load_source != source:
                log.info("%s: per-rank load from %s", self.name, source)
                self.load_source = source
            return found
        self.load_source = None
        raise last or BackendError(f"{self.name}: no load source")

    async def _read(self, http: httpx.AsyncClient, source: str | None) -> list[RankTelemetry]:
        if source == "/v1/loads":
            return await self._loads_json(http)
        if source == "/metrics":
            found = await self._metrics(http)
            if not found:
                raise fetch.EndpointMissing(f"{self._base}/metrics: no sglang:* series with a dp_rank label")
            return found
        body = await fetch.get_json(http, f"{self._base}/get_load", self.timeout_s)
        return parse_get_load(body)

    async def _loads_json(self, http: httpx.AsyncClient) -> list[RankTelemetry]:
        return parse_v1_loads(await fetch.get_json(http, f"{self._base}/v1/loads", self.timeout_s))

    async def _metrics(self, http: httpx.AsyncClient) -> list[RankTelemetry]:
        text = await fetch.get_text(http, f"{self._base}/metrics", self.timeout_s)
        found = parse_metrics(text)
        self._preemptions.update(
            {t.rank: t.preemptions_total for t in found if t.preemptions_total is not None}
        )
        return found

    async def _refresh_preemptions(self, http: httpx.AsyncClient) -> None:
        try:
            await self._metrics(http)
        except BackendError as exc:  # preemption counts are a nice-to-have; /v1/loads already answered
            log.debug("%s: /metrics for preemptions failed: %s", self.name, exc)

    async def abort(self, http: httpx.AsyncClient, rank: int, request_id: str) -> None:
        base = self.spec.urls[rank] if self._per_rank_urls and 0 <= rank < len(self.spec.urls) else self._base
        try:
            status = await fetch.post_json(http, f"{base}/abort_request", {"rid": request_id}, self.timeout_s)
        except BackendError as exc:
            log.debug("%s: abort %s failed: %s", self.name, request_id, exc)
            return
        if status >= 400:
            log.debug("%s: abort %s: HTTP %d", self.name, request_id, status)


def _token_capacity(state: Any) -> int | None:
    if not isinstance(state, dict) or not isinstance(state.get("memory_usage"), dict):
        return None
    return fetch.as_int(state["memory_usage"].get("token_capacity"))


def _with_preemptions(t: RankTelemetry, preemptions: int | None) -> RankTelemetry:
    if preemptions is None or t.preemptions_total is not None:
        return t
    return RankTelemetry(
        rank=t.rank,
        used_tokens=t.used_tokens,
        running=t.running,
        waiting=t.waiting,
        capacity_tokens=t.capacity_tokens,
        preemptions_total=preemptions,
        healthy=t.healthy,
    )


def parse_v1_loads(body: Any) -> list[RankTelemetry]:
    """``/v1/loads`` JSON: ``{"loads": [{"dp_rank", "num_used_tokens", "num_running_reqs", ...}, ...]}``."""
    loads = fetch.as_dict(body, "/v1/loads").get("loads")
    if not isinstance(loads, list):
        raise BackendError("/v1/loads: no 'loads' list")
    out = []
    for entry in loads:
        rank = fetch.as_int(entry.get("dp_rank")) if isinstance(entry, dict) else None
        if rank is None:
            continue
        out.append(
            RankTelemetry(
                rank=rank,
                used_tokens=fetch.as_int(entry.get("num_used_tokens")),
                running=fetch.as_int(entry.get("num_running_reqs")),
                waiting=fetch.as_int(entry.get("num_waiting_reqs")),
                capacity_tokens=fetch.as_int(entry.get("max_total_num_tokens")),
            )
        )
    return out


def parse_get_load(body: Any) -> list[RankTelemetry]:
    """Deprecated ``/get_load``: one element per rank; ``num_tokens`` includes waiting-queue tokens."""
    if not isinstance(body, list):
        raise BackendError("/get_load: expected a JSON list")
    out = []
    for entry in body:
        rank = fetch.as_int(entry.get("dp_rank")) if isinstance(entry, dict) else None
        if rank is None:
            continue
        reqs, waiting = fetch.as_int(entry.get("num_reqs")), fetch.as_int(entry.get("num_waiting_reqs"))
        running = reqs - waiting if reqs is not None and waiting is not None else None
        out.append(
            RankTelemetry(
                rank=rank, used_tokens=fetch.as_int(entry.get("num_tokens")), running=running, waiting=waiting
            )
        )
    return out


def parse_metrics(text: str) -> list[RankTelemetry]:
    """``/metrics`` scheduler gauges, one series per ``dp_rank`` (``sglang:`` or ``sglang_`` names)."""
    samples = prom.parse_samples(text, _METRIC_NAMES)
    values: dict[int, dict[str, float]] = {}
    for s in samples:
        rank = fetch.as_int(s.labels.get("dp_rank", "0"))  # no dp_rank label: a single-rank server
        if rank is None:
            continue
        per_rank = values.setdefault(rank, {})
        per_rank[s.name] = max(per_rank.get(s.name, s.value), s.value)  # several schedulers per rank: max
    return [
        RankTelemetry(
            rank=rank,
            used_tokens=fetch.as_int(v.get(_USED)),
            running=fetch.as_int(v.get(_RUNNING)),
            waiting=fetch.as_int(v.get(_QUEUED)),
            capacity_tokens=fetch.as_int(v.get(_CAPACITY)),
            preemptions_total=fetch.as_int(v.get(_RETRACTED)),
        )
        for rank, v in sorted(values.items())
        if _USED in v
    ]


def _attention_dp_size(server_info: Mapping[str, Any]) -> int:
    """The number of attention-DP ranks (KV pools) the server runs.

    SGLang 0.5.23 replaced ``--enable-dp-attention`` with ``--attn-dp-size N``; when launched with the old
    spelling it reports ``dp_size: 1, attn_dp_size: 8`` (``handle_deprecated_dp_attention``), so reading
    ``dp_size`` alone would see one rank. Older servers have no ``attn_dp_size``.
    """
    dp_size = fetch.as_int(server_info.get("dp_size")) or 1
    attn_dp_size = fetch.as_int(server_info.get("attn_dp_size")) or 0
    return max(dp_size, attn_dp_size)
