"""Per-request reservation bookkeeping shared by the gateway and the simulator (no I/O, no clock).

The book sizes a request (:meth:`ReservationBook.plan`), adjusts the placement snapshot with the
over-commit headroom (:meth:`ReservationBook.adjust`), remembers what each placed request holds, says
how much to grow when generation passes the reservation (:meth:`ReservationBook.growth`), and feeds
finished lengths to the predictor. The caller does the ledger calls (``reserve``, ``grow``,
``release``) and reports their outcome back, so the ledger stays the one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from router.placement.snapshot import RankKey, Snapshot
from router.reservation.modes import ReservationMode, initial_output_tokens, next_growth
from router.reservation.overcommit import (
    BOUNDS,
    NO_GROWTH,
    GrowthProfile,
    fresh_profile,
    population_profile,
    with_headroom,
)
from router.reservation.predictor import Predictor, PredictorConfig, RequestKey

_REFRESH_OBS = 32  # recompute a growth profile after this many new lengths behind it
_CACHE_MAX = 4096


def _stale(computed_at: int, seen: int) -> bool:
    """A profile computed after ``computed_at`` lengths is stale once ``_REFRESH_OBS`` more arrived, or
    once the count doubled (so a cold start learns fast)."""
    return seen - computed_at >= min(_REFRESH_OBS, max(1, computed_at))


@dataclass(frozen=True, slots=True)
class ReservationSettings:
    """``target_preemption_rate``: the over-commit budget's bound on a rank outgrowing its pool per
    placement. ``step_tokens``: slack added on each growth (rounded up to the page)."""

    mode: ReservationMode = ReservationMode.PREDICTED
    target_preemption_rate: float = 0.01
    step_tokens: int = 0
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    bound: str = "normal"

    def __post_init__(self) -> None:
        if not 0.0 < self.target_preemption_rate < 1.0:
            raise ValueError(f"target_preemption_rate must be in (0, 1), got {self.target_preemption_rate}")
        if self.step_tokens < 0:
            raise ValueError(f"step_tokens must be >= 0, got {self.step_tokens}")
        if self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, got {self.bound!r}")


@dataclass(frozen=True, slots=True)
class Plan:
    """A sized request: ``output_tokens`` is the output part of the first reservation (before pages)."""

    key: RequestKey
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    growth: GrowthProfile


class BookMeter(Protocol):
    """Told what the book decides, for metrics (router/telemetry_reservation.py). Calls are cheap and never
    fail; the book works the same without one."""

    def planned(self, key: RequestKey, output_tokens: int) -> None:
        """A stream was sized from the prediction: ``output_tokens`` of output in its first reservation."""

    def grown(self, ok: bool) -> None:
        """The ledger granted (``ok``) or refused a growth."""

    def learned(self, key: RequestKey) -> None:
        """The predictor learned the length of a finished request of ``key``."""


@dataclass(slots=True)
class _Held:
    plan: Plan
    rank: RankKey
    reserved_tokens: int
    generated_tokens: int = 0


class ReservationBook:
    def __init__(
        self,
        settings: ReservationSettings,
        predictor: Predictor | None = None,
        meter: BookMeter | None = None,
    ) -> None:
        self.settings = settings
        self.predictor = predictor if predictor is not None else Predictor(settings.predictor)
        self.meter = meter
        self._held: dict[str, _Held] = {}
        self._population: tuple[int, GrowthProfile] | None = None
        self._fresh: dict[tuple[str, int, int], tuple[int, GrowthProfile]] = {}
        self.growth_failures = 0

    @property
    def predicted(self) -> bool:
        return self.settings.mode is ReservationMode.PREDICTED

    def plan(self, key: RequestKey, max_tokens: int) -> Plan:
        """Size a request of ``key`` (its prompt tokens inside) that may generate ``max_tokens``."""
        if not self.predicted:
            return Plan(key, key.prompt_tokens, max_tokens, max_tokens, NO_GROWTH)
        output = initial_output_tokens(max_tokens, self.predictor.quantile_tokens(key), self.settings.mode)
        if self.meter is not None:
            self.meter.planned(key, output)
        return Plan(key, key.prompt_tokens, max_tokens, output, self._fresh_profile(key, output, max_tokens))

    def _fresh_profile(self, key: RequestKey, output: int, max_tokens: int) -> GrowthProfile:
        """Cached per (answering level, cover, cap), recomputed after ``_REFRESH_OBS`` new lengths there."""
        level, seen = self.predictor.version(key)
        cache_key = (level, output, max_tokens)
        cached = self._fresh.get(cache_key)
        if cached is None or _stale(cached[0], seen):
            if len(self._fresh) >= _CACHE_MAX:
                self._fresh.clear()
            profile = fresh_profile(self.predictor.distribution(key), output, max_tokens)
            cached = self._fresh[cache_key] = (seen, profile)
        return cached[1]

    def adjust(self, snapshot: Snapshot, plan: Plan) -> Snapshot:
        """The snapshot with every rank's over-commit headroom charged (unchanged in mode max)."""
        if not self.predicted:
            return snapshot
        s = self.settings
        return with_headroom(snapshot, self.population(), plan.growth, s.target_preemption_rate, s.bound)

    def population(self) -> GrowthProfile:
        """Growth profile of a request already running anywhere (all routes), refreshed as lengths arrive."""
        _, seen = self.predictor.version(None)
        if self._population is None or _stale(self._population[0], seen):
            cover = self.predictor.quantile_tokens(None)
            self._population = (seen, population_profile(self.predictor.distribution(None), cover))
        return self._population[1]

    def placed(self, request_id: str, plan: Plan, rank: RankKey, reserved_tokens: int) -> None:
        """The ledger reserved ``reserved_tokens`` for ``request_id`` on ``rank``."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already in the book")
        self._held[request_id] = _Held(plan, rank, reserved_tokens)

    def growth(self, request_id: str, generated_tokens: int, page_size: int) -> int:
        """Tokens to ask the ledger to grow by now that ``generated_tokens`` are out (0: nothing to do)."""
        held = self._held.get(request_id)
        if held is None or not self.predicted:
            return 0
        held.generated_tokens = max(held.generated_tokens, generated_tokens)
        plan = held.plan
        return next_growth(
            held.generated_tokens,
            held.reserved_tokens,
            page_size,
            prompt_tokens=plan.prompt_tokens,
            step_tokens=self.settings.step_tokens,
            max_total_tokens=plan.prompt_tokens + plan.max_tokens,
        )

    def grown(self, request_id: str, tokens: int, ok: bool) -> None:
        """The ledger's answer to a growth of ``tokens``; a refused growth leaves the request running."""
        held = self._held.get(request_id)
        if held is None:
            return
        if ok:
            held.reserved_tokens += tokens
        else:
            self.growth_failures += 1
        if self.meter is not None:
            self.meter.grown(ok)

    def finished(self, request_id: str, generated_tokens: int | None) -> None:
        """The request left (the caller releases the ledger). ``generated_tokens``: its real length when it
        ended on its own or at its limit; None for an abort or error (not a length to learn from)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        if generated_tokens is not None:
            self.observe(held.plan.key, generated_tokens)

    def observe(self, key: RequestKey, generated_tokens: int) -> None:
        """Learn from a request that was never in the book (e.g. placed by the engine itself)."""
        self.predictor.observe(key, generated_tokens)
        if self.meter is not None:
            self.meter.learned(key)

    def reserved_tokens(self, request_id: str) -> int | None:
        held = self._held.get(request_id)
        return None if held is None else held.reserved_tokens

    def prompt_tokens(self, request_id: str) -> int:
        held = self._held.get(request_id)
        return 0 if held is None else held.plan.prompt_tokens

    def __len__(self) -> int:
        return len(self._held)
