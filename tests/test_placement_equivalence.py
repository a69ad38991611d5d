"""The placement hot path (inlined fit checks, tuple sorts, precomputed view fields) decides exactly as the
straightforward definitions do: the reference below is the policies' plain form, computed from a rank's
raw fields, compared over random snapshots and requests."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from router.placement import get_policy
from router.placement.admission import Action, decide
from router.placement.lockstep import Lockstep
from router.placement.policies import kv_fit, least_requests, power_of_two, round_robin
from router.placement.snapshot import RankKey, RankView, RequestShape, Snapshot
from router.units import round_up


def used(r: RankView) -> int:
    return r.reserved_tokens if r.engine_used_tokens is None else max(r.reserved_tokens, r.engine_used_tokens)


def free(r: RankView) -> int:
    return r.capacity_tokens - used(r)


def fits(q: RequestShape, r: RankView) -> bool:
    return r.healthy and not r.draining and round_up(max(1, q.total_tokens), r.page_size) <= free(r)


def ref_feasible(s: Snapshot, q: RequestShape) -> list[int]:
    return [i for i, r in enumerate(s.ranks) if fits(q, r)]


def rot(s: Snapshot, i: int) -> int:
    return (i - s.tick) % len(s.ranks)


def ref_lockstep(policy: Lockstep, s: Snapshot, q: RequestShape) -> list[int]:
    fit = ref_feasible(s, q)
    if len(fit) <= 1:
        return fit
    w, aw = policy.prefill_weight, policy.prefill_attn_weight

    def load(r: RankView) -> float:
        x = r.context_tokens + w * r.prefill_tokens
        if aw and r.prefill_tokens:
            x += aw * (r.prefill_tokens * r.prefill_tokens / max(1, r.prefill_requests)) / 2.0
        return x

    loads = [load(r) for r in s.ranks]
    added = q.prompt_tokens * (1.0 + w) + aw * q.prompt_tokens * q.prompt_tokens / 2.0

    def key(i: int) -> tuple[float, float, int, int]:
        group = [j for j, r in enumerate(s.ranks) if r.key.backend == s.ranks[i].key.backend]
        first = max(loads[j] for j in group)
        others = max((loads[j] for j in group if j != i), default=float("-inf"))
        mine = loads[i] + added
        return (max(others, mine) - first, mine, -free(s.ranks[i]), i)

    return sorted(fit, key=key)


REFERENCES: dict[str, Callable[[Snapshot, RequestShape], list[int]]] = {
    "kv_fit": lambda s, q: sorted(ref_feasible(s, q), key=lambda i: (-free(s.ranks[i]), rot(s, i))),
    "round_robin": lambda s, q: sorted(ref_feasible(s, q), key=lambda i: rot(s, i)),
    "least_requests": lambda s, q: sorted(ref_feasible(s, q), key=lambda i: (s.ranks[i].inflight, rot(s, i))),
}
POLICIES = {"kv_fit": kv_fit, "round_robin": round_robin, "least_requests": least_requests}


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    n = draw(st.integers(1, 9))
    small = st.integers(0, 3_000)
    ranks = []
    for i in range(n):
        capacity = draw(st.integers(0, 4_000))
        ranks.append(
            RankView(
                key=RankKey(draw(st.sampled_from("ab")), i),
                capacity_tokens=capacity,
                page_size=draw(st.sampled_from((1, 1, 16, 64))),
                reserved_tokens=draw(st.integers(0, capacity)),
                inflight=draw(st.integers(0, 5)),
                context_tokens=draw(small),
                prefill_tokens=draw(st.sampled_from((0, 0, 500, 9_000, 40_000))),
                prefill_requests=draw(st.integers(0, 3)),
                engine_used_tokens=draw(st.none() | st.integers(0, 4_000)),
                healthy=draw(st.sampled_from((True, True, False))),
                draining=draw(st.sampled_from((False, False, True))),
            )
        )
    return Snapshot(tuple(ranks), tick=draw(st.integers(0, 100)))


requests = st.builds(
    RequestShape, st.integers(0, 20_000), st.integers(0, 2_000), entropy=st.integers(0, 2**32 - 1)
)


@settings(max_examples=300, deadline=None)
@given(snapshots(), requests)
def test_policies_rank_as_the_plain_definitions(snap: Snapshot, q: RequestShape) -> None:
    for r in snap.ranks:
        assert (r.used_tokens, r.free_tokens, r.usable) == (used(r), free(r), r.healthy and not r.draining)
    assert ref_feasible(snap, q) == [i for i, r in enumerate(snap.ranks) if q.fits(r)]
    for name, policy in POLICIES.items():
        assert policy(snap, q) == REFERENCES[name](snap, q), name
    for lockstep in (Lockstep(), Lockstep(prefill_attn_weight=0.0), Lockstep(prefill_weight=3.0)):
        assert lockstep(snap, q) == ref_lockstep(lockstep, snap, q)
    pair = power_of_two(snap, q)
    assert sorted(pair) == ref_feasible(snap, q)


@settings(max_examples=200, deadline=None)
@given(snapshots(), requests, st.floats(0.0, 100.0))
def test_decide_matches_the_plain_checks(snap: Snapshot, q: RequestShape, waited_s: float) -> None:
    ever = [r for r in snap.ranks if round_up(max(1, q.total_tokens), r.page_size) <= r.capacity_tokens]
    for name in ("lockstep", "lockstep_eager", "kv_fit"):
        decision = decide(snap, q, get_policy(name), waited_s=waited_s)
        if not ever:
            assert decision.action is Action.REJECT and decision.reason == "too_large"
        elif not any(r.healthy and not r.draining for r in ever):
            assert decision.action is Action.REJECT and decision.reason == "no_healthy_rank"
        elif not ref_feasible(snap, q):
            assert decision.action is Action.WAIT
        elif name == "kv_fit":  # no gate: every feasible rank, in the policy's order
            assert decision.candidates == tuple(REFERENCES["kv_fit"](snap, q))
        elif decision.action is Action.PLACE:
            assert set(decision.candidates) <= set(ref_feasible(snap, q))


def test_a_shuffled_policy_answer_is_rechecked() -> None:
    """decide keeps only in-range, fitting, first occurrences of what a policy says, in its order."""
    snap = Snapshot(tuple(RankView(RankKey("a", i), 100, reserved_tokens=30 * i) for i in range(4)))
    q = RequestShape(40, 0)
    order = [3, 1, -1, 9, 1, 0, 2]
    random.Random(0).shuffle(order)
    decision = decide(snap, q, lambda s, r: order)
    assert decision.candidates == tuple(i for i in dict.fromkeys(order) if 0 <= i < 4 and i != 3)
