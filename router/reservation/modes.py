"""Reservation modes: how many KV tokens a request holds when it is placed, and how that grows.

* ``max``: prompt + the client's ``max_tokens`` (clamped by the caller to the context window). The
  request can never outgrow its reservation, so the router never causes a preemption, but a client that
  asks 32k for a 300-token answer holds 100x the KV it uses.
* ``predicted``: prompt + a quantile of what similar requests generated lately (never more than
  ``max_tokens``). When generation reaches the reservation it grows, whole pages at a time, exactly to
  the next page boundary past what is held (plus ``step_tokens`` of slack rounded to pages, so a
  ``page_size`` of 1 does not cost one ledger write per token). The over-commit budget
  (:mod:`router.reservation.overcommit`) keeps room on each rank for the growth the quantile leaves out.

All functions are pure and integer-exact.
"""

from __future__ import annotations

from enum import StrEnum

from router.units import round_up


class ReservationMode(StrEnum):
    MAX = "max"
    PREDICTED = "predicted"

    @classmethod
    def parse(cls, value: str) -> ReservationMode:
        """``"max"`` / ``"predicted"`` (any case); ValueError with the known names otherwise."""
        try:
            return cls(value.strip().lower())
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown reservation mode {value!r} (known: {known})") from None


def _check(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def initial_output_tokens(
    max_tokens: int, predicted_output_tokens: int | None, mode: ReservationMode = ReservationMode.PREDICTED
) -> int:
    """The output part of the first reservation: ``max_tokens`` (mode max, or no prediction yet) or the
    prediction clamped to ``[1, max_tokens]``."""
    _check("max_tokens", max_tokens, 1)
    if mode is ReservationMode.MAX or predicted_output_tokens is None:
        return max_tokens
    return max(1, min(max_tokens, predicted_output_tokens))


def initial_reservation(
    prompt_tokens: int,
    max_tokens: int,
    predicted_output_tokens: int | None,
    page_size: int,
    mode: ReservationMode = ReservationMode.PREDICTED,
) -> int:
    """Tokens to reserve at placement: prompt + output part, rounded up to whole pages.

    Never less than the prompt plus its first token, never more than prompt + ``max_tokens`` (rounded).
    """
    _check("prompt_tokens", prompt_tokens, 0)
    _check("page_size", page_size, 1)
    output = initial_output_tokens(max_tokens, predicted_output_tokens, mode)
    return round_up(prompt_tokens + output, page_size)


def next_growth(
    generated_tokens: int,
    reserved_tokens: int,
    page_size: int,
    *,
    prompt_tokens: int = 0,
    step_tokens: int = 0,
    max_total_tokens: int | None = None,
) -> int:
    """Tokens to add to a reservation of ``reserved_tokens`` once ``generated_tokens`` are out, or 0.

    The request holds ``prompt_tokens + generated_tokens`` KV slots and needs one more for the token it
    generates next. When that exceeds the reservation, the answer brings the reservation to the page
    boundary at or above ``held + 1 + step_tokens`` (``step_tokens`` = 0: exactly the next page), capped at
    ``max_total_tokens`` (prompt + ``max_tokens``, rounded) since the engine stops there. Always a whole
    number of pages when ``reserved_tokens`` is page-aligned.
    """
    _check("generated_tokens", generated_tokens, 0)
    _check("reserved_tokens", reserved_tokens, 0)
    _check("page_size", page_size, 1)
    _check("prompt_tokens", prompt_tokens, 0)
    _check("step_tokens", step_tokens, 0)
    need = prompt_tokens + generated_tokens + 1
    if need <= reserved_tokens:
        return 0
    target = round_up(need + step_tokens, page_size)
    if max_total_tokens is not None:
        target = min(target, max(round_up(max_total_tokens, page_size), round_up(need, page_size)))
    return target - reserved_tokens


def growth_check_after_tokens(generated_tokens: int, reserved_tokens: int, *, prompt_tokens: int = 0) -> int:
    """How many more tokens may be generated before :func:`next_growth` can answer non-zero (>= 0).

    Lets a caller that sees token counts in bulk (the simulator, a relay counting SSE events) schedule
    its next check instead of testing every token.
    """
    return max(0, reserved_tokens - (prompt_tokens + generated_tokens + 1))
