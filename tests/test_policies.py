"""Placement policies: properties every policy must keep, and the behaviour that tells them apart."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.placement import DEFAULT_POLICY, POLICY_NAMES, UnknownPolicy, get_policy
from router.placement.lockstep import DEFAULT_PREFILL_WEIGHT, Lockstep, request_load, step_load
from router.placement.snapshot import RankKey, RankView, RequestShape, Snapshot


@st.composite
def rank_views(draw: st.DrawFn, index: int, backend: str) -> RankView:
    capacity = draw(st.integers(1, 20_000))
    return RankView(
        key=RankKey(backend, index),
        capacity_tokens=capacity,
        page_size=draw(st.sampled_from([1, 16, 64])),
        reserved_tokens=draw(st.integers(0, capacity)),
        inflight=draw(st.integers(0, 40)),
        context_tokens=draw(st.integers(0, capacity)),
        prefill_tokens=draw(st.integers(0, 5_000)),
        prefill_requests=draw(st.integers(0, 5)),
        engine_used_tokens=draw(st.none() | st.integers(0, capacity)),
        healthy=draw(st.booleans() | st.just(True)),
        draining=draw(st.just(False) | st.booleans()),
    )


@st.composite
def snapshots(draw: st.DrawFn, backends: int = 2) -> Snapshot:
    n = draw(st.integers(1, 8))
    names = [f"b{draw(st.integers(0, backends - 1))}" for _ in range(n)]
    ranks = tuple(draw(rank_views(i, names[i])) for i in range(n))
    return Snapshot(ranks=ranks, tick=draw(st.integers(0, 1_000)))


requests = st.builds(
    RequestShape,
    prompt_tokens=st.integers(1, 6_000),
    output_tokens=st.integers(0, 3_000),
    prefix_hash=st.none() | st.integers(0, 2**63),
    entropy=st.integers(0, 2**32),
)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(snapshot=snapshots(), request=requests)
def test_every_policy_returns_only_fitting_usable_ranks_once(
    name: str, snapshot: Snapshot, request: RequestShape
) -> None:
    policy = get_policy(name)
    out = policy(snapshot, request)
    assert len(out) == len(set(out))
    for i in out:
        rank = snapshot.ranks[i]
        assert rank.usable
        assert request.fits(rank)
    # Complete: every feasible rank is offered, so a lost reservation race can fall through.
    assert set(out) == {i for i, r in enumerate(snapshot.ranks) if request.fits(r)}
    assert policy(snapshot, request) == out  # deterministic for equal inputs


def _max_after(snapshot: Snapshot, request: RequestShape, chosen: int, weight: float, attn: float) -> float:
    loads = [step_load(r, weight, attn) for r in snapshot.ranks]
    loads[chosen] += request_load(request, weight, attn)
    return max(loads)


@settings(max_examples=80, deadline=None)
@given(
    snapshot=snapshots(backends=1),
    request=requests,
    weight=st.sampled_from([0.0, 1.0, 1767.0]),
    attn=st.sampled_from([0.0, 0.39]),
)
def test_lockstep_keeps_the_maximum_rank_load_lowest(
    snapshot: Snapshot, request: RequestShape, weight: float, attn: float
) -> None:
    out = Lockstep(prefill_weight=weight, prefill_attn_weight=attn)(snapshot, request)
    if not out:
        return
    own = request_load(request, weight, attn)
    best = _max_after(snapshot, request, out[0], weight, attn)
    for other in out[1:]:
        assert best <= _max_after(snapshot, request, other, weight, attn) + own
        # Exact minimisation, in fact: the slack the contract allows is not needed.
        assert best <= _max_after(snapshot, request, other, weight, attn)


@settings(max_examples=50, deadline=None)
@given(snapshot=snapshots(), request=requests)
def test_round_robin_visits_every_feasible_rank(snapshot: Snapshot, request: RequestShape) -> None:
    policy = get_policy("round_robin")
    n = len(snapshot.ranks)
    firsts = set()
    for t in range(n):
        out = policy(Snapshot(snapshot.ranks, tick=t), request)
        if out:
            firsts.add(out[0])
    assert firsts == {i for i, r in enumerate(snapshot.ranks) if request.fits(r)}


def _ranks(*specs: dict[str, int], backend: str = "b") -> tuple[RankView, ...]:
    out = []
    for i, spec in enumerate(specs):
        fields = {"capacity_tokens": 100_000} | spec
        out.append(RankView(key=RankKey(backend, i), **fields))  # type: ignore[arg-type]
    return tuple(out)


def test_lockstep_spreads_long_contexts_and_avoids_pending_prefill() -> None:
    policy = get_policy("lockstep")
    req = RequestShape(prompt_tokens=60_000, output_tokens=1_000)
    busy = _ranks(
        {"context_tokens": 80_000, "reserved_tokens": 80_000},
        {"context_tokens": 10_000, "reserved_tokens": 10_000},
        {"context_tokens": 30_000, "reserved_tokens": 30_000},
    )
    assert policy(Snapshot(busy), req) == [1, 2]  # rank 0 is too full for 61k
    # A rank with the least context but a pending prompt loses to one with more context and no prefill:
    # one pending prompt token weighs ~1,767 cached tokens.
    pending = _ranks({"context_tokens": 0, "prefill_tokens": 100}, {"context_tokens": 50_000})
    assert policy(Snapshot(pending), RequestShape(prompt_tokens=10, output_tokens=10))[0] == 1
    assert 1_700 < DEFAULT_PREFILL_WEIGHT < 1_800


def test_lockstep_groups_ranks_by_backend() -> None:
    # Backend a steps at its 90k rank whatever happens to a1, so filling a1 costs no step time; b0 would
    # raise b's step. Across backends the policy minimises the rise of the chosen group's maximum.
    ranks = (
        RankView(RankKey("a", 0), 100_000, context_tokens=90_000),
        RankView(RankKey("a", 1), 100_000, context_tokens=0),
        RankView(RankKey("b", 0), 100_000, context_tokens=5_000),
    )
    policy = Lockstep(prefill_weight=0.0, prefill_attn_weight=0.0)
    out = policy(Snapshot(ranks), RequestShape(prompt_tokens=1_000, output_tokens=0))
    assert out == [1, 2, 0]  # a0 would raise a's maximum by the whole request


def test_kv_fit_least_requests_power_of_two_orders() -> None:
    snap = Snapshot(
        _ranks(
            {"reserved_tokens": 50_000, "inflight": 1},
            {"reserved_tokens": 10_000, "inflight": 9},
            {"reserved_tokens": 30_000, "inflight": 3},
        )
    )
    req = RequestShape(prompt_tokens=100, output_tokens=100)
    assert get_policy("kv_fit")(snap, req) == [1, 2, 0]
    assert get_policy("least_requests")(snap, req) == [0, 2, 1]
    p2 = get_policy("power_of_two")
    for entropy in range(12):
        out = p2(snap, RequestShape(100, 100, entropy=entropy))
        assert token_order(snap, out[:2])
        assert sorted(out) == [0, 1, 2]


def token_order(snap: Snapshot, pair: list[int]) -> bool:
    a, b = (snap.ranks[i].used_tokens for i in pair)
    return a <= b


def test_vllm_internal_penalises_waiting_only_above_half_kv() -> None:
    snap = Snapshot(
        _ranks(
            {"inflight": 4, "prefill_requests": 2, "reserved_tokens": 90_000},
            {"inflight": 5, "prefill_requests": 0, "reserved_tokens": 10_000},
            {"inflight": 4, "prefill_requests": 2, "reserved_tokens": 40_000},
        )
    )
    # rank 0: 4 + 2*6*0.4 = 8.8; rank 1: 5; rank 2: 4 (KV under 50 %: no penalty).
    assert get_policy("vllm_internal")(snap, RequestShape(10, 10)) == [2, 1, 0]


def test_registry_names_and_errors() -> None:
    assert DEFAULT_POLICY == "lockstep"
    assert {"lockstep", "kv_fit", "round_robin", "least_requests", "power_of_two", "vllm_internal"} <= set(
        POLICY_NAMES
    )
    assert get_policy("Round-Robin") is get_policy("round_robin")
    assert get_policy("lockstep", prefill_weight=10.0) == Lockstep(10.0)
    assert get_policy("lockstep", prefill_attn_weight=0.0).prefill_attn_weight == 0.0  # type: ignore[attr-defined]
    with pytest.raises(UnknownPolicy, match="unknown policy 'nope'"):
        get_policy("nope")
    with pytest.raises(UnknownPolicy, match="does not take"):
        get_policy("kv_fit", weight=2)
    with pytest.raises(ValueError, match="prefill_weight"):
        get_policy("lockstep", prefill_weight=-1.0)


def test_cache_aware_sticks_to_prefix_until_imbalanced() -> None:
    policy = get_policy("sglang_cache_aware")
    req = RequestShape(10, 10, prefix_hash=2 + 4 * 1_000)
    balanced = Snapshot(_ranks(*({"inflight": 3} for _ in range(4))))
    assert policy(balanced, req)[0] == 2
    skewed = Snapshot(_ranks({"inflight": 1}, {"inflight": 1}, {"inflight": 200}, {"inflight": 2}))
    assert policy(skewed, req)[0] in (0, 1)


def test_lockstep_counts_long_prompts_quadratically() -> None:
    # Rank 0 waits on one 40k prompt, rank 1 on twenty 3k prompts (60k tokens): a short request queues
    # behind ~40k x (50 us + 11.1 ns x 20k) ~ 11 s of prefill on rank 0 but ~4 s on rank 1.
    snap = Snapshot(
        _ranks(
            {"prefill_tokens": 40_000, "prefill_requests": 1},
            {"prefill_tokens": 60_000, "prefill_requests": 20},
        )
    )
    req = RequestShape(prompt_tokens=500, output_tokens=100)
    assert get_policy("lockstep")(snap, req)[0] == 1
    assert get_policy("lockstep", prefill_attn_weight=0.0)(snap, req)[0] == 0
