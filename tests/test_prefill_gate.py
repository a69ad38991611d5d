"""The long-prefill gate: long prompts are held until a slow phase they fit in runs (or their hold ends);
short ones never wait for it. Pure functions over snapshots, plus admission and the policy registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.placement import UnknownPolicy, get_policy, parse_spec
from router.placement.admission import Action, decide, decide_behind, gate_of
from router.placement.lockstep import Lockstep
from router.placement.prefill_gate import LongPrefillGate, prefill_s
from router.placement.snapshot import RankKey, RankView, RequestShape, Snapshot

GATE = LongPrefillGate(long_prompt_tokens=8_192, hold_stretch=2.0)


def _rank(i: int, backend: str = "b", prefill_tokens: int = 0) -> RankView:
    return RankView(RankKey(backend, i), 200_000, prefill_tokens=prefill_tokens)


def _snap(*ranks: RankView) -> Snapshot:
    return Snapshot(ranks=ranks)


def test_prefill_time_follows_the_calibrated_constants() -> None:
    # 128k tokens: 95 s of causal attention (11.1 ns x 128k^2 / 2), 12.8 s (98 us x 128k), 3.8 s of floor.
    assert prefill_s(131_072) == pytest.approx(112.0, abs=0.1)
    assert prefill_s(0) == 0.0
    assert prefill_s(1_024) < prefill_s(8_192) < prefill_s(32_768)


def test_short_requests_are_never_held() -> None:
    snap = _snap(_rank(0), _rank(1, prefill_tokens=100_000))
    assert GATE.allowed(snap, RequestShape(8_191, 100), [1, 0], waited_s=0.0) == (1, 0)


def test_a_long_request_waits_for_a_phase_then_goes_alone_when_its_hold_ends() -> None:
    snap = _snap(_rank(0), _rank(1))
    long = RequestShape(40_000, 1_000)
    hold_s = GATE.max_hold_s(long)
    assert hold_s == pytest.approx(2.0 * prefill_s(40_000))
    assert GATE.allowed(snap, long, [0, 1], waited_s=hold_s - 0.01) == ()
    assert GATE.allowed(snap, long, [0, 1], waited_s=hold_s) == (0, 1)


def test_a_long_request_rides_along_a_longer_phase_on_another_rank() -> None:
    snap = _snap(_rank(0, prefill_tokens=60_000), _rank(1), _rank(2, prefill_tokens=500))
    assert GATE.allowed(snap, RequestShape(40_000, 10), [2, 0, 1], waited_s=0.0) == (2, 1)
    # Longer than what is left of the phase: it would add slow steps, so it is still held.
    assert GATE.allowed(snap, RequestShape(70_000, 10), [2, 0, 1], waited_s=0.0) == ()


def test_groups_step_apart_so_a_phase_in_one_does_not_admit_to_another() -> None:
    snap = _snap(_rank(0, "a", prefill_tokens=60_000), _rank(1, "a"), _rank(0, "c"))
    assert GATE.allowed(snap, RequestShape(40_000, 10), [2, 1], waited_s=0.0) == (1,)


def test_the_optional_cap_bounds_ranks_prefilling_long_prompts() -> None:
    capped = LongPrefillGate(hold_stretch=2.0, max_long_prefills=2)
    one = _snap(_rank(0, prefill_tokens=60_000), _rank(1), _rank(2))
    two = _snap(_rank(0, prefill_tokens=60_000), _rank(1, prefill_tokens=60_000), _rank(2))
    req = RequestShape(20_000, 10)
    assert capped.allowed(one, req, [1, 2], waited_s=0.0) == (1, 2)
    assert capped.allowed(two, req, [2], waited_s=0.0) == ()


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        LongPrefillGate(long_prompt_tokens=0)
    with pytest.raises(ValueError):
        LongPrefillGate(hold_stretch=-1.0)
    with pytest.raises(ValueError):
        LongPrefillGate(max_long_prefills=0)


def test_admission_holds_through_the_lockstep_policy_and_not_through_eager() -> None:
    snap = _snap(_rank(0), _rank(1))
    long = RequestShape(40_000, 1_000)
    lockstep = get_policy("lockstep")
    held = decide(snap, long, lockstep, waited_s=0.0)
    assert held.action is Action.WAIT and "batch" in held.detail
    assert decide(snap, long, lockstep, waited_s=1e6).action is Action.PLACE
    assert decide(snap, long, get_policy("lockstep_eager")).action is Action.PLACE
    assert gate_of(get_policy("lockstep_eager")) is None and gate_of(get_policy("kv_fit")) is None
    # Behind a blocked head the same hold applies, minus the claimed rank.
    assert decide_behind(snap, long, lockstep, 0, waited_s=0.0).action is Action.WAIT
    assert decide_behind(snap, long, lockstep, 0, waited_s=1e6).candidates == (1,)


def test_policy_specs_carry_parameters() -> None:
    assert parse_spec("lockstep:hold_stretch=0.1;max_long_prefills=none") == (
        "lockstep",
        {"hold_stretch": 0.1, "max_long_prefills": None},
    )
    policy = get_policy("lockstep:hold_stretch=0.5,long_prompt_tokens=4000")
    assert isinstance(policy, Lockstep) and policy.gate == LongPrefillGate(4_000, 0.5)
    for bad in (
        "lockstep:nope=1",
        "lockstep:hold_stretch",
        "lockstep:hold_stretch=x",
        "lockstep:hold_stretch=-2",
    ):
        with pytest.raises(UnknownPolicy):
            get_policy(bad)


@st.composite
def gated_cases(draw: st.DrawFn) -> tuple[LongPrefillGate, Snapshot, RequestShape, list[int], float]:
    gate = LongPrefillGate(
        long_prompt_tokens=draw(st.integers(1, 20_000)),
        hold_stretch=draw(st.floats(0.0, 5.0)),
        max_long_prefills=draw(st.none() | st.integers(1, 4)),
    )
    n = draw(st.integers(1, 8))
    ranks = tuple(
        _rank(i, f"b{draw(st.integers(0, 1))}", prefill_tokens=draw(st.integers(0, 150_000)))
        for i in range(n)
    )
    order = draw(st.permutations(range(n)))
    candidates = order[: draw(st.integers(0, n))]
    request = RequestShape(draw(st.integers(1, 150_000)), draw(st.integers(0, 4_000)))
    return gate, Snapshot(ranks), request, list(candidates), draw(st.floats(0.0, 500.0))


@settings(max_examples=300, deadline=None)
@given(gated_cases())
def test_gate_properties(case: tuple[LongPrefillGate, Snapshot, RequestShape, list[int], float]) -> None:
    gate, snap, request, candidates, waited_s = case
    allowed = gate.allowed(snap, request, candidates, waited_s)
    # A subset, in the policy's order.
    assert list(allowed) == [i for i in candidates if i in allowed]
    # No starvation: once held its whole hold, nothing of the gate applies.
    assert gate.allowed(snap, request, candidates, gate.max_hold_s(request)) == tuple(candidates)
    if not gate.is_long(request):
        assert allowed == tuple(candidates)
        return
    if waited_s >= gate.max_hold_s(request) or not allowed:
        return
    # Held regime: it only rides along a running phase it fits in, on a rank not prefilling a long prompt,
    # and placing it keeps the group within the cap.
    for i in allowed:
        rank = snap.ranks[i]
        group = [r for r in snap.ranks if r.key.backend == rank.key.backend]
        busy = [r for r in group if gate.prefilling_long(r)]
        assert busy and not gate.prefilling_long(rank)
        assert prefill_s(request.prompt_tokens) <= max(prefill_s(r.prefill_tokens) for r in busy)
        if gate.max_long_prefills is not None:
            assert len(busy) + 1 <= gate.max_long_prefills
