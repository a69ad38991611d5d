"""The admission decision: place / wait / reject, and the reason a refusal carries."""

from __future__ import annotations

from router.placement import get_policy
from router.placement.admission import Action, RejectReason, decide
from router.placement.snapshot import RankKey, RankView, RequestShape, Snapshot


def _snap(*ranks: RankView) -> Snapshot:
    return Snapshot(ranks=ranks)


def _rank(i: int, capacity: int = 10_000, **kw: int | bool) -> RankView:
    return RankView(RankKey("b", i), capacity, **kw)  # type: ignore[arg-type]


LOCKSTEP = get_policy("lockstep")


def test_places_on_the_ranks_with_room_best_first() -> None:
    snap = _snap(_rank(0, reserved_tokens=9_000), _rank(1, reserved_tokens=1_000), _rank(2))
    d = decide(snap, RequestShape(2_000, 500), LOCKSTEP, max_context_tokens=8_192)
    assert d.action is Action.PLACE
    assert d.reason is None
    assert set(d.candidates) == {1, 2}
    assert d.keys(snap) == [snap.ranks[i].key for i in d.candidates]


def test_waits_when_it_fits_an_empty_rank_but_no_rank_now() -> None:
    snap = _snap(_rank(0, reserved_tokens=9_000), _rank(1, reserved_tokens=8_000))
    d = decide(snap, RequestShape(2_000, 500), LOCKSTEP)
    assert d.action is Action.WAIT
    assert d.candidates == ()


def test_context_length_is_checked_first() -> None:
    snap = _snap(_rank(0, capacity=100))
    d = decide(snap, RequestShape(8_000, 500), LOCKSTEP, max_context_tokens=8_192)
    assert (d.action, d.reason) == (Action.REJECT, RejectReason.CONTEXT_LENGTH)
    assert "8192" in d.detail
    # Exactly the window is fine.
    ok = decide(_snap(_rank(0)), RequestShape(8_000, 192), LOCKSTEP, max_context_tokens=8_192)
    assert ok.action is Action.PLACE


def test_too_large_counts_page_rounding_and_every_rank() -> None:
    snap = _snap(_rank(0, capacity=1_000, page_size=64), _rank(1, capacity=960, page_size=64, healthy=False))
    # 961 tokens round to 1,024 on a 64-token page: more than either pool.
    d = decide(snap, RequestShape(900, 61), LOCKSTEP)
    assert (d.action, d.reason) == (Action.REJECT, RejectReason.TOO_LARGE)
    assert decide(snap, RequestShape(900, 60), LOCKSTEP).action is Action.PLACE


def test_no_healthy_rank_when_only_unusable_ranks_could_hold_it() -> None:
    snap = _snap(_rank(0, capacity=500), _rank(1, healthy=False), _rank(2, draining=True))
    d = decide(snap, RequestShape(1_000, 0), LOCKSTEP)
    assert (d.action, d.reason) == (Action.REJECT, RejectReason.NO_HEALTHY_RANK)
    assert decide(_snap(), RequestShape(1, 1), LOCKSTEP).reason is RejectReason.TOO_LARGE


def test_a_faulty_policy_cannot_place_where_the_request_does_not_fit() -> None:
    snap = _snap(_rank(0, reserved_tokens=10_000), _rank(1), _rank(2, healthy=False))

    def liar(_s: Snapshot, _r: RequestShape) -> list[int]:
        return [0, 7, -1, 2, 1, 1]

    d = decide(snap, RequestShape(100, 100), liar)
    assert d.candidates == (1,)
    assert decide(snap, RequestShape(100, 100), lambda _s, _r: [0]).action is Action.WAIT


def test_a_blocked_head_claims_the_rank_where_it_fits_soonest_and_keeps_it() -> None:
    from router.placement.admission import claim_rank

    snap = _snap(
        _rank(0, reserved_tokens=6_000),
        _rank(1, reserved_tokens=3_000),
        _rank(2, reserved_tokens=3_000),  # a tie with rank 1: the lower index wins
        _rank(3, reserved_tokens=0, healthy=False),
        _rank(4, capacity=5_000),  # its whole pool can never hold the head
    )
    head = RequestShape(9_000, 500)
    assert claim_rank(snap, head) == 1
    # Sticky: once claimed, a rank that drains is not abandoned for one that happens to be freer now.
    assert claim_rank(snap, head, held=RankKey("b", 0)) == 0
    # A held rank that turned unusable or is gone is replaced.
    assert claim_rank(snap, head, held=RankKey("b", 3)) == 1
    assert claim_rank(snap, head, held=RankKey("b", 9)) == 1
    assert claim_rank(_snap(_rank(0, capacity=5_000)), head) is None


def test_requests_behind_the_head_keep_off_its_claimed_rank() -> None:
    from router.placement.admission import decide_behind

    snap = _snap(_rank(0, reserved_tokens=2_000), _rank(1, reserved_tokens=9_500), _rank(2))
    small, medium = RequestShape(200, 400), RequestShape(4_000, 1_000)
    placed = decide_behind(snap, small, LOCKSTEP, claimed=2)
    assert placed.action is Action.PLACE and 2 not in placed.candidates and placed.candidates == (0,)
    assert set(decide_behind(snap, small, LOCKSTEP, claimed=None).candidates) == {0, 2}
    # Fits only on the claimed rank: it waits (in line) rather than take the head's room.
    assert decide_behind(snap, RequestShape(9_000, 0), LOCKSTEP, claimed=2).action is Action.WAIT
    assert decide_behind(snap, medium, LOCKSTEP, claimed=0).candidates == (2,)
    # Refusals are unchanged.
    too_big = decide_behind(snap, RequestShape(20_000, 0), LOCKSTEP, claimed=2)
    assert (too_big.action, too_big.reason) == (Action.REJECT, RejectReason.TOO_LARGE)
