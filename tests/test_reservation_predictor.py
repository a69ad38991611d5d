"""The output-length predictor: converges, adapts after a shift, falls back sensibly, shares its state."""

from __future__ import annotations

import json
import math
import random

import pytest

from router.reservation.histogram import DecayedHistogram, bin_of, bin_upper_tokens, quantile_tokens
from router.reservation.predictor import Predictor, PredictorConfig, RequestKey

CHAT = RequestKey("/v1/chat/completions", "deepseek-v3", 1500)
BIN_RATIO = 2 ** (1 / 8)  # one bin: a quantile may read this much high, never lower than the truth's bin


def lognormal_lengths(rng: random.Random, median: float, sigma: float, n: int) -> list[int]:
    return [max(1, round(rng.lognormvariate(math.log(median), sigma))) for _ in range(n)]


def true_quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def test_bins_round_quantiles_up_within_one_bin() -> None:
    for tokens in (1, 2, 7, 100, 333, 4096, 100_000):
        assert bin_upper_tokens(bin_of(tokens)) >= tokens
        assert bin_upper_tokens(bin_of(tokens)) <= math.ceil(tokens * BIN_RATIO) + 1


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_converges_on_a_stationary_distribution(q: float) -> None:
    rng = random.Random(3)
    p = Predictor(PredictorConfig(prior_median_tokens=4000, half_life_obs=2000))  # a prior far off
    lengths = lognormal_lengths(rng, 350, 0.6, 8000)
    for n in lengths:
        p.observe(CHAT, n)
    want = true_quantile(lengths[-2000:], q)
    got = p.quantile_tokens(CHAT, q)
    assert want / BIN_RATIO**1.5 <= got <= want * BIN_RATIO**2.5, (q, want, got)


def test_adapts_after_a_shift() -> None:
    rng = random.Random(5)
    half_life = 200
    p = Predictor(PredictorConfig(half_life_obs=half_life))
    for n in lognormal_lengths(rng, 300, 0.5, 5 * half_life):
        p.observe(CHAT, n)
    before = p.quantile_tokens(CHAT, 0.5)
    assert 250 <= before <= 360
    for n in lognormal_lengths(rng, 1200, 0.5, 4 * half_life):  # answers got 4x longer
        p.observe(CHAT, n)
    after = p.quantile_tokens(CHAT, 0.5)
    assert 1000 <= after <= 1450, after


def test_half_life_is_what_it_says() -> None:
    h = DecayedHistogram(half_life_obs=100)
    h.add(10)
    for _ in range(100):
        h.add(1000)
    old = h.normalised()[bin_of(10)]
    assert old == pytest.approx(0.5, rel=1e-9)


def test_cold_start_answers_from_the_prior() -> None:
    p = Predictor(PredictorConfig(prior_median_tokens=512, prior_sigma=0.5))
    assert 480 <= p.quantile_tokens(CHAT, 0.5) <= 560
    assert p.weight(CHAT) == 0.0


def test_buckets_keep_different_populations_apart_and_sparse_ones_fall_back() -> None:
    p = Predictor(PredictorConfig(min_weight=16))
    short = RequestKey("/v1/chat/completions", "m", 200)
    long = RequestKey("/v1/chat/completions", "m", 30_000)
    for _ in range(100):
        p.observe(short, 50)
        p.observe(long, 2000)
    assert p.quantile_tokens(short) < 60
    assert p.quantile_tokens(long) >= 2000
    # A hint seen 5 times is too sparse: its requests use the hint-free level of their bucket.
    hinted = RequestKey("/v1/chat/completions", "m", 200, hint="summarise")
    for _ in range(5):
        p.observe(hinted, 5000)
    assert p.quantile_tokens(hinted) < 60
    for _ in range(40):
        p.observe(hinted, 5000)
    assert p.quantile_tokens(hinted) >= 5000
    # An unseen bucket of a known route uses the route's level: a mix of both populations.
    mid = RequestKey("/v1/chat/completions", "m", 3000)
    assert 50 <= p.quantile_tokens(mid, 0.5) <= 5000


def test_untrusted_hints_cannot_grow_the_state_without_bound() -> None:
    p = Predictor(PredictorConfig(max_keys=32))
    for i in range(1000):
        p.observe(RequestKey("/generate", "m", 100, hint=f"h{i}"), 10)
    assert len(p) <= 32
    assert p.quantile_tokens(RequestKey("/generate", "m", 100, hint="new")) <= 11


def test_state_round_trips_through_json() -> None:
    rng = random.Random(9)
    p = Predictor()
    for n in lognormal_lengths(rng, 400, 0.7, 500):
        p.observe(CHAT, n)
    data = json.loads(json.dumps(p.to_dict()))
    assert all(isinstance(v, int | float) for bins in data["keys"].values() for v in bins.values())
    q = Predictor.from_dict(data)
    for quantile in (0.1, 0.5, 0.9):
        assert q.quantile_tokens(CHAT, quantile) == p.quantile_tokens(CHAT, quantile)
    assert q.weight(CHAT) == pytest.approx(p.weight(CHAT))


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"version": 2, "keys": {}},
        {"version": 1, "keys": {"no-separators": {}}},
        {"version": 1, "keys": {"a|b|1|": {"x": 1.0}}},
        {"version": 1, "keys": {"a|b|1|": {"3": -1.0}}},
        {"version": 1, "keys": {"a|b|1|": {"999": 1.0}}},
        {"version": 1, "keys": {"a|b|1|": {"n": "many"}}},
    ],
)
def test_malformed_state_is_refused_with_a_clear_error(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Predictor.from_dict(bad)


def test_merging_a_delta_equals_observing_it_here() -> None:
    rng = random.Random(11)
    first = lognormal_lengths(rng, 300, 0.5, 400)
    second = lognormal_lengths(rng, 900, 0.5, 150)
    cfg = PredictorConfig(half_life_obs=100)
    sequential = Predictor(cfg)
    for n in first + second:
        sequential.observe(CHAT, n)
    shared, delta = Predictor(cfg), Predictor(cfg)
    for n in first:
        shared.observe(CHAT, n)
    for n in second:
        delta.observe(CHAT, n)
    shared.merge(Predictor.from_dict(delta.to_dict(), cfg))
    for level in CHAT.levels():
        a = sequential._hists[level].normalised()
        b = shared._hists[level].normalised()
        assert a.keys() == b.keys()
        for i in a:
            assert b[i] == pytest.approx(a[i], rel=1e-9)


def test_quantile_of_empty_bins_is_none() -> None:
    assert quantile_tokens({}, 0.5) is None
