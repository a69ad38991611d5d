"""Reservation modes: initial sizes never below the prompt, growth exact to the page."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.reservation.modes import (
    ReservationMode,
    growth_check_after_tokens,
    initial_reservation,
    next_growth,
)
from router.units import round_up

MAX, PRED = ReservationMode.MAX, ReservationMode.PREDICTED


def test_mode_names_parse_and_unknown_ones_say_what_is_known() -> None:
    assert ReservationMode.parse(" Predicted ") is PRED
    assert ReservationMode.parse("max") is MAX
    with pytest.raises(ValueError, match="known: max, predicted"):
        ReservationMode.parse("guess")


def test_max_reserves_the_whole_limit_and_predicted_the_prediction() -> None:
    assert initial_reservation(1000, 4096, 300, 64, MAX) == round_up(5096, 64)
    assert initial_reservation(1000, 4096, 300, 64, PRED) == round_up(1300, 64)
    assert initial_reservation(1000, 4096, None, 64, PRED) == round_up(5096, 64)  # nothing to predict from
    assert initial_reservation(1000, 200, 300, 1, PRED) == 1200  # never past max_tokens


@given(
    prompt=st.integers(0, 200_000),
    max_tokens=st.integers(1, 100_000),
    predicted=st.one_of(st.none(), st.integers(-5, 200_000)),
    page=st.sampled_from([1, 16, 64, 128]),
    mode=st.sampled_from([MAX, PRED]),
)
def test_never_less_than_the_prompt_never_more_than_the_limit(
    prompt: int, max_tokens: int, predicted: int | None, page: int, mode: ReservationMode
) -> None:
    got = initial_reservation(prompt, max_tokens, predicted, page, mode)
    assert got % page == 0
    assert got >= prompt + 1
    assert got <= round_up(prompt + max_tokens, page)


@given(
    prompt=st.integers(0, 50_000),
    predicted=st.integers(1, 2_000),
    length=st.integers(1, 6_000),
    page=st.sampled_from([1, 16, 64]),
)
def test_growth_past_the_prediction_is_exact_to_the_page(
    prompt: int, predicted: int, length: int, page: int
) -> None:
    """Token by token: the reservation always covers the next token, and after every growth it ends at
    the first page boundary that does, so it over-holds less than one page."""
    max_tokens = 8_000
    reserved = initial_reservation(prompt, max_tokens, predicted, page, PRED)
    grown_total = 0
    for generated in range(length):
        step = next_growth(
            generated, reserved, page, prompt_tokens=prompt, max_total_tokens=prompt + max_tokens
        )
        if step:
            assert step % page == 0
            reserved += step
            grown_total += step
            assert reserved == round_up(prompt + generated + 1, page)
        assert reserved >= prompt + generated + 1
    # What was grown is exactly what the final length needed beyond the first reservation.
    first = initial_reservation(prompt, max_tokens, predicted, page, PRED)
    assert first + grown_total == max(first, round_up(prompt + length, page))


def test_step_slack_is_rounded_to_pages_and_capped_at_the_limit() -> None:
    assert next_growth(100, 100, 16, step_tokens=40) == round_up(141, 16) - 100
    assert next_growth(100, 100, 1, step_tokens=64, max_total_tokens=120) == 20
    assert next_growth(50, 100, 16) == 0
    assert growth_check_after_tokens(50, 100) == 49
    assert next_growth(99, 100, 1) == 0 and growth_check_after_tokens(99, 100) == 0
    assert next_growth(100, 100, 1) == 1


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_bad_counts_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        next_growth(bad, 10, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        initial_reservation(10, 10, 5, bad)  # type: ignore[arg-type]
