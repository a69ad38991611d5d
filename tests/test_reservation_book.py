"""The reservation book: sizing by mode, growth exact to the page, learning from finished requests."""

from __future__ import annotations

import pytest

from router.placement.snapshot import RankKey, RankView, Snapshot
from router.reservation.book import ReservationBook, ReservationSettings
from router.reservation.modes import ReservationMode
from router.reservation.predictor import PredictorConfig, RequestKey

KEY = RequestKey("/v1/chat/completions", "deepseek-v3", 1000)
RANK = RankKey("b", 0)


def _book(mode: ReservationMode = ReservationMode.PREDICTED, **kw: object) -> ReservationBook:
    cfg = PredictorConfig(prior_median_tokens=300, prior_sigma=0.5)
    return ReservationBook(ReservationSettings(mode, predictor=cfg, **kw))  # type: ignore[arg-type]


def test_max_mode_reserves_max_tokens_grows_never_and_charges_no_headroom() -> None:
    book = _book(ReservationMode.MAX)
    plan = book.plan(KEY, 8192)
    assert plan.output_tokens == 8192
    snap = Snapshot((RankView(RANK, 100_000, reserved_tokens=5000, inflight=3),))
    assert book.adjust(snap, plan) == snap
    book.placed("a", plan, RANK, 9192)
    assert book.growth("a", 9000, 1) == 0


def test_predicted_mode_reserves_the_quantile_and_grows_to_the_page() -> None:
    book = _book()
    plan = book.plan(KEY, 8192)
    assert 280 <= plan.output_tokens <= 330  # the prior's median, rounded up to its bin
    reserved = -(-(1000 + plan.output_tokens) // 64) * 64
    book.placed("a", plan, RANK, reserved)
    covered = reserved - 1000
    assert book.growth("a", covered - 2, 64) == 0
    grow = book.growth("a", covered, 64)  # the next token needs a slot past the reservation: one page
    assert grow == 64
    book.grown("a", grow, ok=True)
    assert book.reserved_tokens("a") == reserved + 64
    assert book.growth("a", covered + 63, 64) == 0
    # A refused growth leaves the request running and is counted; it is asked again next time.
    assert book.growth("a", covered + 64, 64) == 64
    book.grown("a", 64, ok=False)
    assert book.growth_failures == 1 and book.reserved_tokens("a") == reserved + 64


def test_headroom_is_charged_on_every_rank_in_predicted_mode() -> None:
    book = _book()
    plan = book.plan(KEY, 8192)
    snap = Snapshot((RankView(RANK, 500_000, reserved_tokens=200_000, inflight=150),))
    adjusted = book.adjust(snap, plan)
    assert adjusted.ranks[0].reserved_tokens > 200_000
    assert adjusted.ranks[0].capacity_tokens == 500_000


def test_finished_requests_teach_the_predictor_and_aborts_do_not() -> None:
    book = _book()
    for i in range(200):
        plan = book.plan(KEY, 8192)
        book.placed(f"r{i}", plan, RANK, 2000)
        book.finished(f"r{i}", 40)
    assert book.plan(KEY, 8192).output_tokens <= 45
    for i in range(200):
        plan = book.plan(KEY, 8192)
        book.placed(f"x{i}", plan, RANK, 2000)
        book.finished(f"x{i}", None)  # aborted: says nothing about its length
    assert book.plan(KEY, 8192).output_tokens <= 45
    assert len(book) == 0
    book.finished("never-placed", 10)  # unknown ids are ignored


def test_a_request_id_is_booked_once_and_settings_are_checked() -> None:
    book = _book()
    plan = book.plan(KEY, 100)
    book.placed("a", plan, RANK, 1100)
    with pytest.raises(ValueError):
        book.placed("a", plan, RANK, 1100)
    with pytest.raises(ValueError):
        ReservationSettings(target_preemption_rate=0.0)
    with pytest.raises(ValueError):
        ReservationSettings(step_tokens=-1)
