"""The over-commit budget: moments of uncovered growth, headroom, and a seeded run that stays on target."""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import pytest

from router.placement.admission import Action, decide
from router.placement.policies import kv_fit
from router.placement.snapshot import RankKey, RankView, RequestShape, Snapshot
from router.reservation.book import ReservationBook, ReservationSettings
from router.reservation.modes import ReservationMode, growth_check_after_tokens
from router.reservation.overcommit import (
    NO_GROWTH,
    bernstein_margin,
    budget_tokens,
    fresh_profile,
    headroom_tokens,
    population_profile,
    with_headroom,
)
from router.reservation.predictor import PredictorConfig, RequestKey

TWO_POINT = ((100.0, 0.5), (300.0, 0.5))


def test_bernstein_margin_covers_a_binomial_tail() -> None:
    # 1000 fair coins: P(heads - 500 >= x) <= 1e-3 needs x ~ 49 (normal: 3.09 sd of 15.8).
    x = bernstein_margin(250.0, 1.0, 1e-3)
    assert 49 <= x <= 65
    rng = random.Random(1)
    exceed = sum(sum(rng.random() < 0.5 for _ in range(1000)) - 500 >= x for _ in range(300))
    assert exceed == 0
    with pytest.raises(ValueError):
        bernstein_margin(1.0, 1.0, 0.0)


def test_fresh_profile_of_a_two_point_distribution() -> None:
    # Covered up to 100 of lengths {100, 300}: within t steps a fresh request grows (min(t, L) - 100)^+.
    p = fresh_profile(TWO_POINT, 100, 10_000)
    at = dict(zip(p.horizons_steps, zip(p.growth_mean_tokens, p.finish_prob, strict=True), strict=True))
    assert at[64] == (0.0, 0.0)
    assert at[128][0] == pytest.approx(0.5 * 28) and at[128][1] == 0.5  # long half grew 28, short half left
    assert at[512][0] == pytest.approx(100.0) and at[512][1] == 1.0
    assert fresh_profile(TWO_POINT, 300, 300) == NO_GROWTH  # covered up to max_tokens


def test_population_profile_catches_long_requests_more_often() -> None:
    # Seen at a random age, a 300-token request is caught 3x as often as a 100-token one: 3/4 of the
    # population, and over a long horizon it grows 200 past the cover on average from a uniform age...
    p = population_profile(TWO_POINT, 100)
    long_share, long_growth = 0.75, (200 * 100 + 200**2 / 2) / 300  # E over age of tokens past 100
    assert p.growth_mean_tokens[-1] == pytest.approx(long_share * long_growth, rel=0.02)
    assert p.finish_prob[-1] == pytest.approx(1.0)


def test_headroom_grows_with_inflight_and_shrinks_with_what_departures_free() -> None:
    pop = population_profile(TWO_POINT, 100)
    new = fresh_profile(TWO_POINT, 100, 10_000)
    assert headroom_tokens(0, 0.0, NO_GROWTH, NO_GROWTH, 0.01) == 0
    small = headroom_tokens(10, 1.0, pop, new, 0.01)  # departures free (almost) nothing
    big = headroom_tokens(100, 1.0, pop, new, 0.01)
    assert 0 < small < big
    # Requests that free a lot when they leave need less headroom than ones that free little.
    assert headroom_tokens(100, 50_000.0, pop, new, 0.01) < big
    assert headroom_tokens(100, 1.0, pop, new, 0.2) < big  # a looser target holds back less
    strict = headroom_tokens(100, 1.0, pop, new, 0.01, "bernstein")
    assert strict > big  # a guarantee costs more
    # ... but never more than "everyone at their final length at once" plus the Bernstein spread.
    assert strict <= 100 * 200 + 100 + bernstein_margin(101 * 200**2, 200, 0.005)
    with pytest.raises(ValueError, match="known: normal, bernstein"):
        headroom_tokens(1, 1.0, pop, new, 0.01, "guess")


def test_with_headroom_charges_reservations_and_leaves_capacity_alone() -> None:
    pop = population_profile(TWO_POINT, 100)
    new = fresh_profile(TWO_POINT, 100, 10_000)
    keys = [RankKey("b", i) for i in range(2)]
    snap = Snapshot((RankView(keys[0], 10**6, reserved_tokens=50_000, inflight=50), RankView(keys[1], 10**6)))
    out = with_headroom(snap, pop, new, 0.01)
    assert out.ranks[0].reserved_tokens == 50_000 + headroom_tokens(50, 1000.0, pop, new, 0.01)
    assert out.ranks[1].reserved_tokens == headroom_tokens(0, 0.0, pop, new, 0.01)
    assert [r.capacity_tokens for r in out.ranks] == [10**6, 10**6]
    assert budget_tokens(10**6, 5) == 10**6 - 5
    assert with_headroom(snap, NO_GROWTH, NO_GROWTH, 0.01) == snap


# ---- a seeded one-rank run -----------------------------------------------------------------------------
@dataclass
class _Running:
    rid: str
    prompt: int
    length: int
    generated: int = 0
    check_at: int = 0  # generated count at which the reservation may need to grow


def _run(
    target: float,
    quantile: float = 0.5,
    steps: int = 2500,
    seed: int = 7,
    budget: bool = True,
    bound: str = "normal",
) -> tuple[int, int, float]:
    """Saturated arrivals into one rank of 60k tokens, one token per request per step; a request whose
    growth overflows the pool preempts the newest (engine behaviour). Returns (finished, preempted, mean
    KV utilisation)."""
    rng = random.Random(seed)
    capacity, page, rank = 60_000, 16, RankKey("r", 0)
    settings = ReservationSettings(
        ReservationMode.PREDICTED,
        target_preemption_rate=target,
        bound=bound,
        predictor=PredictorConfig(quantile, prior_median_tokens=200, prior_sigma=1.0, half_life_obs=300),
    )
    book = ReservationBook(settings)
    reserved = 0
    running: dict[str, _Running] = {}
    finished = preempted = 0
    used_sum = 0.0
    pending: deque[tuple[int, int]] = deque()
    serial = 0
    for _ in range(steps):
        while len(pending) < 4:
            length = max(1, min(4000, round(rng.lognormvariate(math.log(300), 0.6))))
            pending.append((rng.randint(200, 1500), length))
        while pending:  # admit while the budget allows (FIFO head only)
            prompt, length = pending[0]
            plan = book.plan(RequestKey("/v1/chat/completions", "m", prompt), max_tokens=8 * length)
            shape = RequestShape(prompt, plan.output_tokens)
            view = RankView(rank, capacity, page, reserved_tokens=reserved, inflight=len(running))
            snap = book.adjust(Snapshot((view,)), plan) if budget else Snapshot((view,))
            if decide(snap, shape, kv_fit).action is not Action.PLACE:
                break
            pending.popleft()
            rid = f"q{serial}"
            serial += 1
            tokens = shape.reserve_tokens(page)
            reserved += tokens
            book.placed(rid, plan, rank, tokens)
            running[rid] = _Running(
                rid, prompt, length, 0, growth_check_after_tokens(0, tokens, prompt_tokens=prompt)
            )
        for req in list(running.values()):
            req.generated += 1
            if req.generated >= req.length:
                del running[req.rid]
                reserved -= book.reserved_tokens(req.rid) or 0
                book.finished(req.rid, req.generated)
                finished += 1
                continue
            if req.generated < req.check_at:
                continue
            grow = book.growth(req.rid, req.generated, page)
            if grow:
                ok = reserved + grow <= capacity
                reserved += grow if ok else 0
                book.grown(req.rid, grow, ok)
            held = book.reserved_tokens(req.rid) or 0
            req.check_at = req.generated + growth_check_after_tokens(
                req.generated, held, prompt_tokens=req.prompt
            )
        used = sum(math.ceil((r.prompt + r.generated + 1) / page) * page for r in running.values())
        while used > capacity:  # the engine's pool overflows: retract the newest
            victim = running.pop(next(reversed(running)))
            reserved -= book.reserved_tokens(victim.rid) or 0
            book.finished(victim.rid, None)
            pending.appendleft((victim.prompt, victim.length))  # it starts over
            preempted += 1
            used = sum(math.ceil((r.prompt + r.generated + 1) / page) * page for r in running.values())
        used_sum += used / capacity
    return finished, preempted, used_sum / steps


def test_the_budget_holds_preemptions_under_target_in_a_seeded_run() -> None:
    """A low quantile (p5) reserves little and grows a lot: the budget is what keeps it safe."""
    finished, preempted, utilisation = _run(target=0.01, quantile=0.05)
    assert finished > 330
    assert preempted / finished < 0.01, (preempted, finished)
    assert utilisation > 0.85, utilisation  # and it still fills the pool


def test_the_bernstein_bound_is_stricter_and_costs_little_here() -> None:
    finished, preempted, utilisation = _run(target=0.01, quantile=0.05, bound="bernstein")
    assert finished > 300
    assert preempted == 0
    assert utilisation > 0.8, utilisation


def test_without_the_budget_the_same_run_preempts() -> None:
    finished, preempted, _ = _run(target=0.01, quantile=0.05, budget=False)
    assert preempted / finished > 0.1, (preempted, finished)
