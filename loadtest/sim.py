"""Virtual-time simulation: the engine model driven by a scenario, placed by the router's own policy code.

No sockets and no clock: :class:`~loadtest.engine.Engine` reports each lockstep step's duration and the
simulator adds it up. Between steps the simulated router (:mod:`loadtest.sim_router`) admits arrivals and
places its wait-queue head with the same ``router.placement`` code the gateway runs. The ``engine`` policy
has no router at all: requests go straight to the engine's own dispatch (SGLang round robin or vLLM's
internal score) with no admission, which is what shows preemptions.

Cost per policy: O(steps × ranks + requests). The engine runs without per-token events; the loop touches
a request only at arrival, placement, first token and finish.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.engine import Engine, EngineConfig, EngineError, EngineRequest, StepResult
from loadtest.engine_types import EngineMode
from loadtest.sim_metrics import MAX_SAMPLES, SimMetrics
from loadtest.sim_reservation import SimReservations
from loadtest.sim_router import Placed, Refused, ReserveMode, RouterConfig, SimRouter
from loadtest.workload import RequestSpec, Scenario
from router.placement import POLICY_NAMES, get_policy
from router.reservation import PredictorConfig, ReservationMode, ReservationSettings

ENGINE_ONLY = "engine"
SIM_POLICY_NAMES: tuple[str, ...] = (*POLICY_NAMES, ENGINE_ONLY)
DEFAULT_SIM_POLICIES: tuple[str, ...] = (
    "lockstep",
    "kv_fit",
    "round_robin",
    "least_requests",
    "power_of_two",
    "vllm_internal",
    ENGINE_ONLY,
)
Progress = Callable[[float], None]


@dataclass(frozen=True, slots=True)
class SimConfig:
    engine: EngineMode = "sglang"
    capacity_scale: float = 1.0
    page_size: int = 1
    default_max_tokens: int = 512
    reserve_mode: ReserveMode = "gateway"
    queue_max: int = 256
    queue_timeout_s: float = 30.0
    telemetry_interval_s: float = 1.0
    drain_limit_s: float = 1800.0
    # Output reservations (router.reservation): max_tokens, or a learned quantile grown page by page.
    reservation: str = "max"
    target_preemption_rate: float = 0.01
    reservation_quantile: float = 0.5

    def reservation_settings(self) -> ReservationSettings:
        """Raises ValueError for an unknown mode or a target / quantile outside (0, 1)."""
        return ReservationSettings(
            ReservationMode.parse(self.reservation),
            self.target_preemption_rate,
            predictor=PredictorConfig(quantile=self.reservation_quantile),
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig.for_engine(
            self.engine, capacity_scale=self.capacity_scale, page_size=self.page_size, token_events=False
        )


def normalise_policy(name: str) -> str:
    """Canonical policy name, parameters kept (``lockstep:hold_stretch=1``); ``none`` is an alias of
    ``engine``. Raises ValueError on unknown names."""
    base, sep, params = name.partition(":")
    key = base.strip().lower().replace("-", "_")
    key = ENGINE_ONLY if key == "none" else key
    if key not in SIM_POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(SIM_POLICY_NAMES)}, none)")
    if sep and key != ENGINE_ONLY:
        get_policy(f"{key}:{params}")  # raises UnknownPolicy (a ValueError) for a bad parameter
    return f"{key}:{params.strip()}" if sep and key != ENGINE_ONLY else key


class _Run:
    """One policy over one request list; ``run()`` returns the policy's result dict."""

    def __init__(self, requests: Sequence[RequestSpec], policy: str, config: SimConfig, scenario: Scenario):
        self.requests = requests
        self.engine_cfg = config.engine_config()
        self.engine = Engine(self.engine_cfg)
        n = self.engine_cfg.dp_size
        self.router: SimRouter | None = None
        self.reservations: SimReservations | None = None
        if policy != ENGINE_ONLY:
            rcfg = RouterConfig(
                ranks=n,
                capacity_tokens=self.engine_cfg.kv_tokens_per_rank,
                page_size=self.engine_cfg.page_size,
                max_context_tokens=self.engine_cfg.max_model_len,
                default_max_tokens=config.default_max_tokens,
                reserve_mode=config.reserve_mode,
                queue_max=config.queue_max,
                queue_timeout_s=config.queue_timeout_s,
                telemetry_interval_s=config.telemetry_interval_s,
                seed=scenario.seed,
            )
            settings = config.reservation_settings()
            self.reservations = (
                SimReservations(settings, self.engine_cfg.page_size)
                if settings.mode is ReservationMode.PREDICTED
                else None
            )
            self.router = SimRouter(rcfg, get_policy(policy), self.reservations)
        span_s = requests[-1].arrival_s if requests else 0.0
        self.metrics = SimMetrics(n, scenario.slo, max(span_s, 1.0) / MAX_SAMPLES)
        self.horizon_s = span_s + config.drain_limit_s
        self.live: dict[int, list[Any]] = {}  # index -> [spec, first token time or None]
        self.rejected: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.firsts = [0] * n
        self.now_s = 0.0

    # ---- requests in -----------------------------------------------------------------------------------
    def _submit(self, spec: RequestSpec, rank: int | None) -> None:
        limit = spec.max_tokens
        if limit is None:  # no max_tokens: the engine allows the rest of the context window
            limit = max(1, self.engine_cfg.max_model_len - spec.prompt_tokens)
        req = EngineRequest(str(spec.index), spec.prompt_tokens, limit, spec.output_tokens)
        try:
            self.engine.submit(req, rank)
        except EngineError as exc:
            self.failed[f"engine_{type(exc).__name__}"] += 1
            if self.router is not None:
                self.router.release(spec.index)
            return
        self.live[spec.index] = [spec, None]

    def _handle(self, out: Placed | Refused | None) -> None:
        if isinstance(out, Placed):
            self._submit(out.spec, out.rank)
        elif isinstance(out, Refused):
            self.rejected[out.reason] += 1

    def _arrive(self, spec: RequestSpec) -> None:
        if self.router is None:
            self._submit(spec, None)
        else:
            self._handle(self.router.offer(spec, self.now_s))

    # ---- engine out ------------------------------------------------------------------------------------
    def _events(self, res: StepResult) -> None:
        now = self.now_s
        firsts = self.firsts
        for i in range(len(firsts)):
            firsts[i] = 0
        for ev in res.events:
            idx = int(ev.rid)
            entry = self.live.get(idx)
            if entry is None:
                continue
            if ev.first_token:
                entry[1] = now
                firsts[ev.rank] += 1
                if self.router is not None:
                    self.router.first_token(idx)
            if ev.finished:
                del self.live[idx]
                if self.router is not None:
                    self.router.release(idx, None if ev.finish_reason == "abort" else ev.generated_tokens)
                spec: RequestSpec = entry[0]
                if ev.finish_reason == "abort" or entry[1] is None:
                    self.failed["abort"] += 1
                else:
                    self.metrics.on_finish(
                        spec.arrival_s, entry[1], now, spec.prompt_tokens, ev.generated_tokens
                    )

    def _idle_until(self, next_arrival_s: float | None) -> bool:
        """Nothing runs: jump to the next arrival, queue deadline or telemetry scrape. False = done."""
        candidates = [] if next_arrival_s is None else [next_arrival_s]
        if self.router is not None and self.router.queue:
            candidates.append(self.router.next_scrape_s)
            deadline = self.router.next_deadline_s()
            if deadline is not None:
                candidates.append(deadline)
        later = [t for t in candidates if t > self.now_s]
        if not later:
            return False
        nxt = min(later)
        self.metrics.on_idle(nxt - self.now_s)
        self.now_s = nxt
        if self.router is not None:
            self.router.observe(self.engine.rank_loads(), self.now_s)
        return True

    def _abort_remaining(self) -> None:
        for idx in list(self.live):
            self.engine.abort(str(idx))
            del self.live[idx]
            self.failed["unfinished"] += 1
            if self.router is not None:
                self.router.release(idx)
        if self.router is not None:
            self.rejected["unfinished_in_queue"] += len(self.router.queue)
            self.router.queue.clear()

    def run(self, progress: Progress | None = None) -> dict[str, Any]:
        reqs, engine, router = self.requests, self.engine, self.router
        i, n = 0, len(reqs)
        while True:
            while i < n and reqs[i].arrival_s <= self.now_s:
                self._arrive(reqs[i])
                i += 1
            if router is not None:
                for out in router.pump(self.now_s):
                    self._handle(out)
            if engine.idle:
                if self._idle_until(reqs[i].arrival_s if i < n else None):
                    continue
                break
            if self.now_s > self.horizon_s:
                self._abort_remaining()
                break
            res = engine.step()
            self.now_s += res.duration_s
            self._events(res)
            if self.reservations is not None and router is not None:
                self.reservations.after_step(engine, router)
            loads = engine.rank_loads()
            self.metrics.on_step(self.now_s, res.duration_s, loads, self.firsts)
            if router is not None:
                router.observe(loads, self.now_s)
            if progress is not None and engine.steps % 256 == 0:
                progress(self.now_s)
        return self._result(n)

    def _result(self, n: int) -> dict[str, Any]:
        out = self.metrics.summary(self.now_s)
        rejected = sum(self.rejected.values())
        failed = sum(self.failed.values())
        out |= {
            "requests": n,
            "failed": failed + rejected,
            "rejected": rejected,
            "rejected_reasons": dict(sorted(self.rejected.items())),
            "failed_reasons": dict(sorted(self.failed.items())),
            "preemptions": self.engine.preemptions_total,
            **(self.reservations.stats() if self.reservations is not None else {}),
            "ledger_reserved_tokens_at_end": sum(self.router.reserved_tokens) if self.router else 0,
            "timeseries": self.metrics.timeseries(),
        }
        return out


def run_policy(
    scenario: Scenario,
    requests: Sequence[RequestSpec],
    policy: str,
    config: SimConfig,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Simulate one policy; the result carries vLLM bench keys plus ``preemptions`` and ``wall_s``."""
    start = time.perf_counter()
    result = _Run(requests, normalise_policy(policy), config, scenario).run(progress)
    result["wall_s"] = time.perf_counter() - start
    return result


def run_sim(
    scenario: Scenario,
    policies: Sequence[str],
    config: SimConfig,
    progress: Callable[[str, float], None] | None = None,
) -> dict[str, Any]:
    """Every policy over the same generated requests: ``{"scenario", "config", "results": {policy: ...}}``."""
    names = [normalise_policy(p) for p in policies]
    requests = scenario.generate()
    results: dict[str, Any] = {}
    for name in names:
        cb = None if progress is None else (lambda t, _n=name: progress(_n, t))
        results[name] = run_policy(scenario, requests, name, config, cb)
    cfg = config.engine_config()
    return {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "requests": len(requests),
        "config": {
            "engine": config.engine,
            "dp_size": cfg.dp_size,
            "kv_tokens_per_rank": cfg.kv_tokens_per_rank,
            "page_size": cfg.page_size,
            "capacity_scale": config.capacity_scale,
            "reserve_mode": config.reserve_mode,
            "default_max_tokens": config.default_max_tokens,
            "queue_max": config.queue_max,
            "queue_timeout_s": config.queue_timeout_s,
            "telemetry_interval_s": config.telemetry_interval_s,
        },
        "results": results,
    }
