"""Output reservations in the gateway: what a request is planned to hold, when to look at its growth, and
what it teaches the predictor once it ends. The arithmetic is :mod:`router.reservation`'s; this is glue.

The book follows a request only when the router can watch its generation: a single-sequence stream. A
non-streamed answer shows its tokens only at the end and several sequences grow side by side (the book
grows one), so those reserve ``max_tokens`` as in mode ``max`` (non-streamed ones still teach the
predictor their length).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from router.config import Settings
from router.reservation.book import Plan, ReservationBook
from router.reservation.overcommit import NO_GROWTH
from router.reservation.predictor import RequestKey
from router.reservation.shared import PredictorShare, SharedPredictor
from router.sizing import Sized
from router.telemetry_reservation import ReservationMetrics

from .errors import ApiError

if TYPE_CHECKING:
    from .flight import Flight

HINT_HEADER: Final[str] = "x-kvrouter-output-hint"
MAX_HINT_CHARS: Final[int] = 64
_HINT = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_HINT_CHARS}}}")
NEVER: Final[int] = sys.maxsize


def build_book(
    settings: Settings, meter: ReservationMetrics | None = None
) -> tuple[ReservationBook, PredictorShare | None]:
    """The app's one book; with ``redis_url`` in mode predicted, the share that pools what replicas learn
    (run by the gateway as a background task). ``meter``: the metrics told what the book decides, reading
    its predictor at scrape time."""
    res = settings.reservation_settings()
    book = ReservationBook(res, meter=meter)
    share = None
    if settings.redis_url and book.predicted:
        predictor = SharedPredictor(res.predictor)
        share = PredictorShare.from_url(settings.redis_url, predictor, namespace=settings.ledger_namespace)
        book = ReservationBook(res, predictor, meter)
    if meter is not None:
        meter.watch(book.predictor)
    return book, share


def output_hint(headers: Mapping[str, str]) -> str:
    """The client's label for similar requests (e.g. a task name), "" when absent. Untrusted: bounded and
    plain here, and the predictor caps how many keys it keeps."""
    raw = headers.get(HINT_HEADER)
    if not raw:
        return ""
    if not _HINT.fullmatch(raw):
        raise ApiError(
            400,
            f"X-KVRouter-Output-Hint must be 1-{MAX_HINT_CHARS} characters of A-Z a-z 0-9 _ . -",
            code="invalid_request",
            param="X-KVRouter-Output-Hint",
        )
    return raw


def plan_request(
    book: ReservationBook, route: str, model: str, sized: Sized, hint: str, stream: bool
) -> Plan | None:
    """The request's plan, or None when the book does not follow it (several sequences, no output)."""
    limit = sized.output_limit_tokens
    if sized.sequences != 1 or limit < 1:
        return None
    key = RequestKey(route, model, sized.prompt_tokens, hint)
    if not stream:
        return Plan(key, sized.prompt_tokens, limit, limit, NO_GROWTH)
    return book.plan(key, limit)


def growth_check_at(book: ReservationBook, request_id: str, generated_tokens: int, page_size: int) -> int:
    """Generated-token count at which to ask the book about growth next: when the reservation no longer
    holds the next token (``prompt + generated + 1 > reserved``), or a page later after a refusal."""
    reserved = book.reserved_tokens(request_id)
    if reserved is None or not book.predicted:
        return NEVER
    due = reserved - book.prompt_tokens(request_id)
    return due if due > generated_tokens else generated_tokens + max(1, page_size)


def learned_tokens(flight: Flight, status: int) -> int | None:
    """The length a finished request teaches: it stopped on its own or at its limit. None otherwise
    (aborts, errors, disconnects teach nothing)."""
    if status != 200 or flight.outcome != "ok" or flight.generated_tokens < 1:
        return None
    return flight.generated_tokens
