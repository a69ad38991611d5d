"""The over-commit budget: how much of a rank predicted reservations may fill, given how wrong they may be.

A predicted reservation covers a request up to a quantile of its likely length; the rest arrives later as
*uncovered growth*, which the router grants from the rank's free tokens (``ledger.grow``). If growth
cannot be granted the request still runs, and if the rank's pool overflows the engine preempts. So each
rank keeps ``headroom`` tokens free of new placements, sized so that growth is refused with probability
at most ``target``:

After the last placement, reservations change by ``G(t) - F(t)``: ``G`` the uncovered growth of the
rank's requests over the next ``t`` steps (at most one token per request per step), ``F`` the
reservations their departures free. Growth is refused only if ``G(t) - F(t) > headroom`` for some
``t``, so, for every horizon ``t`` on a doubling grid,

    headroom >= upper(G(t)) - lower(F(t)),

each bound at ``target / 2``: by default the central-limit (normal) estimate of the sums; with
``bound="bernstein"`` Bernstein's inequality, a guarantee assuming only independent requests that grow
at most ``t`` tokens in ``t`` steps, but one that holds back several times more when a rank has few
requests with a long tail (small pools). Counting every
request at its final length at once (no departures) would hold back several times more: prompts
dominate chat KV, and a finished request returns its prompt.

The moments come from the predicted length distribution: for the requests already on a rank, from a
request seen at a random age in steady state (long requests are caught more often than short ones); for
the one being placed, from a fresh request. ``budget_tokens = capacity - headroom`` is how much of a rank
reservations may fill, while the prompt + max_tokens of what it admits may exceed the pool many times.
All pure: :func:`with_headroom` maps a Snapshot to the Snapshot the unchanged placement policies use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import NormalDist

from router.placement.snapshot import Snapshot
from router.reservation.predictor import Distribution

HORIZONS_STEPS: tuple[int, ...] = tuple(2**i for i in range(18))
_AGE_SAMPLES = 16


@dataclass(frozen=True, slots=True)
class GrowthProfile:
    """One request, for each horizon ``t`` in ``horizons_steps``: mean and variance of the uncovered tokens
    it generates within ``t`` steps, and the probability that it finishes within ``t`` steps."""

    horizons_steps: tuple[int, ...] = ()
    growth_mean_tokens: tuple[float, ...] = ()
    growth_var_tokens2: tuple[float, ...] = ()
    finish_prob: tuple[float, ...] = ()
    growth_bound_tokens: float = 0.0  # the most one request can grow past its cover


NO_GROWTH = GrowthProfile()


def normal_margin(var_sum: float, term_bound: float, target_rate: float) -> float:
    """``z * sd`` with P(N(0,1) > z) = target_rate: the central-limit estimate of the same tail. Much
    tighter than Bernstein when few requests carry a long tail, but an estimate, not a bound."""
    if not 0.0 < target_rate < 1.0:
        raise ValueError(f"target preemption rate must be in (0, 1), got {target_rate}")
    return NormalDist().inv_cdf(1.0 - target_rate) * math.sqrt(max(0.0, var_sum))


def bernstein_margin(var_sum: float, term_bound: float, target_rate: float) -> float:
    """``x`` such that P(S - E[S] >= x) <= target_rate for a sum S of independent terms, each within
    ``term_bound`` of its mean, with variances summing to ``var_sum`` (Bernstein's inequality, solved
    for x: exp(-x^2 / (2 var + 2 b x / 3)) = target). The same bound holds for the lower tail."""
    if not 0.0 < target_rate < 1.0:
        raise ValueError(f"target preemption rate must be in (0, 1), got {target_rate}")
    log_term = math.log(1.0 / target_rate)
    linear = term_bound * log_term / 3.0
    return linear + math.sqrt(linear * linear + 2.0 * max(0.0, var_sum) * log_term)


def _horizons(dist: Distribution, cap: float) -> tuple[int, ...]:
    longest = min(cap, max((v for v, _ in dist), default=1.0))
    return tuple(t for t in HORIZONS_STEPS if t < 2 * longest)


def _profile(
    rows: list[tuple[float, float, float]], horizons: tuple[int, ...], cover: float
) -> GrowthProfile:
    """``rows``: (length, age, weight) samples. Moments of growth past ``cover`` and of finishing."""
    means, vars_, finish = [], [], []
    for t in horizons:
        m1 = m2 = done = 0.0
        for length, age, w in rows:
            grown = min(age + t, length) - max(age, cover)
            if grown > 0:
                m1 += w * grown
                m2 += w * grown * grown
            if length - age <= t:
                done += w
        means.append(m1)
        vars_.append(max(0.0, m2 - m1 * m1))
        finish.append(min(1.0, done))
    bound = max((length - cover for length, _, w in rows if w > 0), default=0.0)
    return GrowthProfile(horizons, tuple(means), tuple(vars_), tuple(finish), max(0.0, bound))


def population_profile(dist: Distribution, cover_tokens: int, cap_tokens: int | None = None) -> GrowthProfile:
    """A request already running, seen at a uniformly random age; lengths weighted by how long they stay."""
    cap = float(cap_tokens) if cap_tokens is not None else math.inf
    total = math.fsum(p * min(v, cap) for v, p in dist)
    if total <= 0:
        return NO_GROWTH
    rows: list[tuple[float, float, float]] = []
    for value, prob in dist:
        length = min(value, cap)
        w = prob * length / total / _AGE_SAMPLES
        rows.extend((length, length * (j + 0.5) / _AGE_SAMPLES, w) for j in range(_AGE_SAMPLES))
    return _profile(rows, _horizons(dist, cap), float(cover_tokens))


def fresh_profile(dist: Distribution, cover_tokens: int, max_tokens: int) -> GrowthProfile:
    """The request being placed: age 0, covered up to ``cover_tokens``, stopped at ``max_tokens``."""
    if cover_tokens >= max_tokens or not dist:
        return NO_GROWTH
    rows = [(min(v, float(max_tokens)), 0.0, p) for v, p in dist]
    return _profile(rows, _horizons(dist, float(max_tokens)), float(cover_tokens))


def headroom_tokens(
    inflight: int,
    mean_reserved_tokens: float,
    population: GrowthProfile,
    new_request: GrowthProfile,
    target_rate: float,
    bound: str = "normal",
) -> int:
    """Tokens a rank with ``inflight`` requests (holding ``mean_reserved_tokens`` each) keeps free of new
    placements so that, with ``new_request`` placed, growth is refused with probability <= target
    (``bound``: ``normal``, the central-limit estimate, or ``bernstein``, a guarantee that costs more
    headroom when a rank holds few requests)."""
    margin = _MARGINS.get(bound)
    if margin is None:
        raise ValueError(f"unknown bound {bound!r} (known: {', '.join(_MARGINS)})")
    half = target_rate / 2.0  # one half for each of the two bounds (union bound)
    n = max(0, inflight)
    worst = 0.0
    for i, t in enumerate(_merged_horizons(population, new_request)):
        g_mean, g_var, p_pop = _at(population, i, t)
        n_mean, n_var, p_new = _at(new_request, i, t)
        if n == 0 and n_mean == 0.0:
            continue
        pop_bound = population.growth_bound_tokens if n else 0.0
        term_bound = min(float(t), max(pop_bound, new_request.growth_bound_tokens))
        grow_hi = n * g_mean + n_mean + margin(n * g_var + n_var, term_bound, half)
        leaving = n * p_pop + p_new
        leaving_var = n * p_pop * (1 - p_pop) + p_new * (1 - p_new)
        freed_lo = mean_reserved_tokens * max(0.0, leaving - margin(leaving_var, 1.0, half))
        worst = max(worst, grow_hi - freed_lo)
    return math.ceil(worst)


_MARGINS: dict[str, Callable[[float, float, float], float]] = {
    "normal": normal_margin,
    "bernstein": bernstein_margin,
}
BOUNDS: tuple[str, ...] = tuple(_MARGINS)


def _merged_horizons(a: GrowthProfile, b: GrowthProfile) -> tuple[int, ...]:
    return a.horizons_steps if len(a.horizons_steps) >= len(b.horizons_steps) else b.horizons_steps


def _at(p: GrowthProfile, i: int, t: int) -> tuple[float, float, float]:
    """A profile's moments at horizon index ``i`` (past its last horizon: growth is over, it finished)."""
    if not p.horizons_steps:
        return 0.0, 0.0, 0.0
    if i < len(p.horizons_steps):
        return p.growth_mean_tokens[i], p.growth_var_tokens2[i], p.finish_prob[i]
    return p.growth_mean_tokens[-1], p.growth_var_tokens2[-1], 1.0


def with_headroom(
    snapshot: Snapshot,
    population: GrowthProfile,
    new_request: GrowthProfile,
    target_rate: float,
    bound: str = "normal",
) -> Snapshot:
    """The snapshot as placement must see it: each rank's headroom added to its reservations."""
    views = []
    for view in snapshot.ranks:
        mean_reserved = view.reserved_tokens / view.inflight if view.inflight > 0 else 0.0
        extra = headroom_tokens(view.inflight, mean_reserved, population, new_request, target_rate, bound)
        views.append(replace(view, reserved_tokens=view.reserved_tokens + extra) if extra else view)
    return replace(snapshot, ranks=tuple(views))


def budget_tokens(capacity_tokens: int, headroom: int) -> int:
    """Reservations a rank may hold: its pool minus the headroom its requests' growth needs."""
    return max(0, capacity_tokens - headroom)
