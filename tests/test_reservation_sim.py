"""Reservation modes end to end in the simulator (small pools so it stays fast)."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.sim import SimConfig, run_policy
from loadtest.workload import Scenario, load_scenario


@pytest.fixture(scope="module")
def overask() -> Scenario:
    return load_scenario("chat-overask").with_overrides(duration_s=120, rate_rps=3)


def _run(sc: Scenario, reservation: str, policy: str = "lockstep") -> dict[str, Any]:
    cfg = SimConfig(capacity_scale=0.05, page_size=16, reserve_mode="max", reservation=reservation)
    return run_policy(sc, sc.generate(), policy, cfg)


def test_predicted_beats_max_without_preempting_and_returns_the_ledger_to_zero(overask: Scenario) -> None:
    by_max = _run(overask, "max")
    predicted = _run(overask, "predicted")
    assert predicted["request_goodput"] >= 1.5 * by_max["request_goodput"]
    assert predicted["preemptions"] <= 0.01 * predicted["completed"]
    assert predicted["reservation_growths"] > 0  # it did reserve less than it used, and grew
    assert predicted["ledger_reserved_tokens_at_end"] == 0  # growth and release are exact
    assert predicted["mean_kv_utilisation"] > by_max["mean_kv_utilisation"]


def test_unknown_reservation_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown reservation mode"):
        SimConfig(reservation="guess").reservation_settings()
