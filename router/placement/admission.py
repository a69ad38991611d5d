"""The admission decision: place now, wait for room, or refuse with a reason. Pure.

The order of the checks is the order of permanence: a request longer than the model's context window or
larger than every rank's whole pool can never run (refuse at once, 400); no usable rank may change (503);
a request that fits an empty usable rank but no rank now waits in the gateway's bounded queue. A head of
the line that cannot be placed claims one rank (:func:`claim_rank`); requests behind it may be placed on
any other rank (:func:`decide_behind`: backfill), so one huge request does not hold up the small ones.
A policy may carry a long-prefill gate (:mod:`router.placement.prefill_gate`) that holds a long prompt for
a bounded time (WAIT) so that long prefills overlap; the caller says how long the request has waited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from router.placement.policies import Policy
from router.placement.prefill_gate import LongPrefillGate
from router.placement.snapshot import RankKey, RequestShape, Snapshot
from router.units import round_up


class Action(StrEnum):
    PLACE = "place"
    WAIT = "wait"
    REJECT = "reject"


class RejectReason(StrEnum):
    CONTEXT_LENGTH = "context_length"
    TOO_LARGE = "too_large"
    NO_HEALTHY_RANK = "no_healthy_rank"


@dataclass(frozen=True, slots=True)
class Decision:
    """``candidates`` are snapshot indices, best first (PLACE only); ``reason`` is set for REJECT only."""

    action: Action
    candidates: tuple[int, ...] = ()
    reason: RejectReason | None = None
    detail: str = field(default="", compare=False)

    def keys(self, snapshot: Snapshot) -> list[RankKey]:
        """The candidates as rank keys, the form the ledger's ``reserve`` takes."""
        return [snapshot.ranks[i].key for i in self.candidates]


def _reject(reason: RejectReason, detail: str) -> Decision:
    return Decision(Action.REJECT, reason=reason, detail=detail)


def gate_of(policy: Policy) -> LongPrefillGate | None:
    """The policy's long-prefill gate (:mod:`router.placement.prefill_gate`), if it has one."""
    gate = getattr(policy, "gate", None)
    return gate if isinstance(gate, LongPrefillGate) else None


def decide(
    snapshot: Snapshot,
    request: RequestShape,
    policy: Policy,
    *,
    max_context_tokens: int | None = None,
    waited_s: float = 0.0,
) -> Decision:
    """Apply the policy to a request and say what the gateway must do with it.

    The policy's answer is re-checked (in range, fits now, first occurrence only), so a faulty policy can
    make a request wait but never place it where it does not fit. A policy with a long-prefill gate
    (:mod:`router.placement.prefill_gate`) may hold a long request (WAIT) that has waited ``waited_s``.
    """
    if max_context_tokens is not None and request.total_tokens > max_context_tokens:
        return _reject(
            RejectReason.CONTEXT_LENGTH,
            f"prompt ({request.prompt_tokens}) + output ({request.output_tokens}) tokens exceed the "
            f"context length of {max_context_tokens}",
        )
    ranks = snapshot.ranks
    need = request.need_tokens
    ever = usable_ever = False  # some rank's whole pool holds it; some usable rank's does
    for r in ranks:  # RequestShape.could_ever_fit, inlined: this runs on every placement
        if (need if r.page_size == 1 else round_up(need, r.page_size)) <= r.capacity_tokens:
            ever = True
            if r.usable:
                usable_ever = True
                break
    if not ever:
        largest = max((r.capacity_tokens for r in ranks), default=0)
        return _reject(
            RejectReason.TOO_LARGE,
            f"request needs {request.total_tokens} KV tokens; the largest rank holds {largest}",
        )
    if not usable_ever:
        return _reject(RejectReason.NO_HEALTHY_RANK, "no healthy rank can hold this request")
    n = len(ranks)
    seen: set[int] = set()
    candidates: list[int] = []
    for i in policy(snapshot, request):
        if 0 <= i < n and i not in seen:
            r = ranks[i]
            if r.usable and (need if r.page_size == 1 else round_up(need, r.page_size)) <= r.free_tokens:
                seen.add(i)
                candidates.append(i)
    if not candidates:
        return Decision(Action.WAIT, detail="no rank has room now")
    gate = gate_of(policy)
    allowed = tuple(candidates) if gate is None else gate.allowed(snapshot, request, candidates, waited_s)
    if not allowed:
        return Decision(Action.WAIT, detail="held: long prefills go in batches")
    return Decision(Action.PLACE, candidates=allowed)


def claim_rank(snapshot: Snapshot, head: RequestShape, held: RankKey | None = None) -> int | None:
    """The rank a blocked head of the line claims, so that it drains for it: no one else is placed there.

    The claim sticks (``held``) while that rank stays usable and can ever hold the head, so a draining rank
    is never abandoned half-way; otherwise the usable rank with the most free tokens among those whose
    whole pool can hold the head (where it fits soonest), lowest index on a tie. None: no rank can.
    """
    best: int | None = None
    for i, rank in enumerate(snapshot.ranks):
        if not (rank.usable and head.could_ever_fit(rank)):
            continue
        if rank.key == held:
            return i
        if best is None or rank.free_tokens > snapshot.ranks[best].free_tokens:
            best = i
    return best


def decide_behind(
    snapshot: Snapshot,
    request: RequestShape,
    policy: Policy,
    claimed: int | None,
    *,
    max_context_tokens: int | None = None,
    waited_s: float = 0.0,
) -> Decision:
    """:func:`decide` for a request waiting behind a blocked head (backfill): the policy's ranking minus
    the head's ``claimed`` rank. A request that fits only there waits, in line, for the head to go first."""
    decision = decide(
        snapshot,
        request,
        policy,
        max_context_tokens=max_context_tokens,
        waited_s=waited_s,
    )
    if decision.action is not Action.PLACE or claimed is None:
        return decision
    others = tuple(i for i in decision.candidates if i != claimed)
    if not others:
        return Decision(Action.WAIT, detail="the only rank with room is claimed by the head of the line")
    return Decision(Action.PLACE, candidates=others)
