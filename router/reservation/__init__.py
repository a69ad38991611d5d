"""Output reservations that learn: modes (max | predicted), the length predictor, the over-commit budget."""

from router.reservation.book import Plan, ReservationBook, ReservationSettings
from router.reservation.modes import ReservationMode, initial_reservation, next_growth
from router.reservation.overcommit import (
    GrowthProfile,
    fresh_profile,
    headroom_tokens,
    population_profile,
    with_headroom,
)
from router.reservation.predictor import Predictor, PredictorConfig, RequestKey

__all__ = [
    "GrowthProfile",
    "Plan",
    "Predictor",
    "PredictorConfig",
    "RequestKey",
    "ReservationBook",
    "ReservationMode",
    "ReservationSettings",
    "fresh_profile",
    "headroom_tokens",
    "initial_reservation",
    "next_growth",
    "population_profile",
    "with_headroom",
]
