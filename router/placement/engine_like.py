"""What the engines do on their own, rebuilt from a snapshot: the baselines the router is measured against.

``vllm_internal`` is vLLM's internal DP load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``,
v0.33, reference/vllm.md §3) with one client::

    score = max(inflight, waiting + running)
    if waiting: score += waiting * 6.0 * max(0.0, kv - 0.5)      # 0 at <= 50 % KV, +3 x waiting at 100 %
    keep the strict minimum, scanning from a start index that rotates every request

Approximated from the snapshot: ``waiting`` = requests placed whose prefill is pending
(``prefill_requests``), ``running`` = the other in-flight requests, ``kv`` = used / capacity.
"""

from __future__ import annotations

from router.placement.policies import feasible, rotation
from router.placement.snapshot import RankView, RequestShape, Snapshot


def vllm_score(rank: RankView) -> float:
    """vLLM's per-engine score (lower is better) from the router's view of one rank."""
    waiting = min(rank.prefill_requests, rank.inflight)
    running = rank.inflight - waiting
    score = float(max(rank.inflight, waiting + running))
    if waiting and rank.capacity_tokens > 0:
        kv = rank.used_tokens / rank.capacity_tokens
        score += waiting * 6.0 * max(0.0, kv - 0.5)
    return score


def vllm_order(snapshot: Snapshot, indices: list[int]) -> list[int]:
    """``indices`` by vLLM's score, ties going to the first rank at or after the rotating start index."""
    return sorted(indices, key=lambda i: (vllm_score(snapshot.ranks[i]), rotation(snapshot, i)))


def vllm_internal(snapshot: Snapshot, request: RequestShape) -> list[int]:
    """vLLM's internal-LB choice restricted to ranks where the request fits (the engine itself does not
    check fit; the simulator's engine-only baseline calls :func:`vllm_order` on every usable rank)."""
    return vllm_order(snapshot, feasible(snapshot, request))
