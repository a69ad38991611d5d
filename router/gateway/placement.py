"""Placement glue: snapshot (ledger + engine truth + local load) → policy → reserve, falling through.

The policy and the admission decision are pure (router/placement); this module is their I/O shell. A
request that fits nowhere now waits in the :class:`WaitQueue`; one that can never fit is refused at once.
A blocked head of the line claims a rank (held here, valid while its flight is the head); the waiters
behind it backfill every other rank. A policy's long-prefill gate may hold a long request in the queue
(router/placement/prefill_gate.py): its queue deadline is extended by the longest hold.
"""

from __future__ import annotations

import random
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from router.backends.base import BackendInfo, Route
from router.ledger.base import Ledger, LedgerUnavailable, RankUsage
from router.placement.admission import (
    Action,
    Decision,
    RejectReason,
    claim_rank,
    decide,
    decide_behind,
    gate_of,
)
from router.placement.policies import Policy
from router.placement.snapshot import RankKey, RankView, Snapshot
from router.reservation.book import ReservationBook
from router.telemetry import Metrics
from router.telemetry_store import RankTruth, TelemetryStore

from .errors import ApiError
from .flight import Flight, LocalLoad, RankLoad
from .output_plan import growth_check_at
from .waitqueue import QueueClosed, QueueFull, QueueTimeout, WaitQueue

GENERATE_ENGINES = frozenset({"sglang"})


@dataclass(frozen=True, slots=True)
class Candidates:
    """The ranks that may serve a request (route and model match), and their smallest context window."""

    keys: tuple[RankKey, ...]
    context_tokens: int
    capacity_tokens: int | None = None  # the largest rank's KV pool, in whole pages (None: unknown)


def serves(info: BackendInfo, route: Route, model: str | None) -> bool:
    if route == "/generate" and info.engine not in GENERATE_ENGINES:
        return False
    return model is None or model in info.models


class CandidateCache:
    """:func:`candidates` per (route, model), kept until discovery changes what the backends serve (the
    store's ``infos_version``): the same key tuple every time, not a new one per request."""

    def __init__(self, store: TelemetryStore) -> None:
        self.store = store
        self._version = -1
        self._found: dict[tuple[str, str | None], Candidates] = {}

    def get(self, route: Route, model: str | None) -> Candidates:
        if self._version != self.store.infos_version:
            self._found.clear()
            self._version = self.store.infos_version
        found = self._found.get((route, model))
        if found is None:
            found = candidates(self.store, route, model)  # raises for unknown models: those are not kept
            self._found[(route, model)] = found
        return found


def candidates(store: TelemetryStore, route: Route, model: str | None) -> Candidates:
    """Ranks of every discovered backend serving ``model`` on ``route``; 404 for an unknown model."""
    infos = [i for i in store.infos().values() if serves(i, route, model)]
    if not infos:
        if not store.infos():
            raise ApiError(503, "no backend discovered yet", code="not_ready", headers={"Retry-After": "1"})
        known = sorted({m for i in store.infos().values() for m in i.models})
        raise ApiError(
            404,
            f"The model '{model}' does not exist (served: {', '.join(known) or 'none'}).",
            code="model_not_found",
            param="model",
        )
    keys = tuple(RankKey(i.name, r) for i in infos for r in range(i.dp_size))
    pools = [c // max(1, i.page_size) * max(1, i.page_size) for i in infos for c in i.capacities_tokens]
    return Candidates(keys, min(i.max_model_len for i in infos), max(pools, default=None))


@dataclass(slots=True)
class _Slot:
    """One candidate rank: its local load (a stable object), its last view and what that was built from.
    The in-process ledger hands back the same ``usage`` object while a rank is unchanged, so most ranks
    are checked by identity; other ledgers by value."""

    key: RankKey
    load: RankLoad
    usage: RankUsage | None = None
    loads: tuple[int, int, int] = (0, 0, 0)
    drained: bool = False
    truth: RankTruth | None = None
    view: RankView | None = None


def _usage_shown(u: RankUsage | None) -> tuple[int, int, int] | None:
    """What a view shows of a rank's ledger usage (generated tokens are not shown)."""
    return None if u is None else (u.capacity_tokens, u.reserved_tokens, u.inflight)


def _build_view(
    key: RankKey,
    usage: RankUsage | None,
    truth: RankTruth | None,
    load: RankLoad,
    info: BackendInfo | None,
    draining: bool,
) -> RankView:
    capacity = usage.capacity_tokens if usage is not None else (truth.capacity_tokens if truth else 0)
    return RankView(
        key=key,
        capacity_tokens=capacity,
        page_size=info.page_size if info is not None else 1,
        reserved_tokens=usage.reserved_tokens if usage is not None else 0,
        inflight=usage.inflight if usage is not None else 0,
        context_tokens=max(0, load.context_tokens),
        prefill_tokens=max(0, load.prefill_tokens),
        prefill_requests=max(0, load.prefill_requests),
        engine_used_tokens=truth.engine_used_tokens if truth is not None else None,
        healthy=truth is not None and truth.healthy and usage is not None,
        draining=draining,
    )


class Placer:
    def __init__(
        self,
        ledger: Ledger,
        store: TelemetryStore,
        policy: Policy,
        load: LocalLoad,
        queue: WaitQueue,
        metrics: Metrics,
        retry_after_s: int = 1,
        book: ReservationBook | None = None,
    ) -> None:
        self.ledger = ledger
        self.book = book  # output reservations: headroom at placement, what each request holds
        self.store = store
        self.policy = policy
        self.load = load
        self.queue = queue
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self._tick = 0
        self._rng = random.Random()
        self.drained: set[RankKey] = set()  # operator-drained ranks (router/gateway/drain.py): no new work
        self._slots_by_keys: dict[tuple[RankKey, ...], list[_Slot]] = {}
        self._slots_version = -1
        self._last: tuple[list[_Slot], tuple[RankView, ...]] | None = None
        self._claim: tuple[Flight, RankKey] | None = None  # (head of the line, the rank it claimed)

    async def snapshot(self, keys: Sequence[RankKey]) -> Snapshot:
        """Every candidate's view; a rank's view is rebuilt only when what it shows changed (most ranks do
        not between two placements), and the whole tuple is reused when none did."""
        usage = await self.ledger.usage()
        self._tick += 1
        slots = self._slots(keys)
        truths, drained = self.store.rank, self.drained
        changed = False
        for slot in slots:
            key = slot.key
            u = usage.get(key)
            load = slot.load
            loads = (load.context_tokens, load.prefill_tokens, load.prefill_requests)
            draining = bool(drained) and key in drained
            truth = truths(key)
            if (
                (u is not slot.usage and _usage_shown(u) != _usage_shown(slot.usage))
                or truth is not slot.truth
                or loads != slot.loads
                or draining is not slot.drained
                or slot.view is None
            ):
                slot.view = _build_view(key, u, truth, load, self.store.info(key.backend), draining)
                slot.loads, slot.drained, slot.truth = loads, draining, truth
                changed = True
            slot.usage = u
        if changed or self._last is None or self._last[0] is not slots:
            self._last = (slots, tuple([v for s in slots if (v := s.view) is not None]))
        return Snapshot(self._last[1], tick=self._tick)

    def _slots(self, keys: Sequence[RankKey]) -> list[_Slot]:
        """The per-rank cache of this candidate list (one per list; rebuilt when discovery changes)."""
        if self._slots_version != self.store.infos_version:
            self._slots_by_keys.clear()
            self._slots_version = self.store.infos_version
        slots = self._slots_by_keys.get(tuple(keys))
        if slots is None:
            slots = self._slots_by_keys[tuple(keys)] = [_Slot(k, self.load.get(k)) for k in keys]
        return slots

    def claimed(self) -> RankKey | None:
        """The rank the head of the line holds, if the head that claimed it is still the head."""
        claim = self._claim
        return claim[1] if claim is not None and claim[0] is self.queue.head_owner else None

    def _decide(self, snap: Snapshot, flight: Flight, behind: bool) -> Decision:
        """The head (or a newcomer) may use any rank, and claims one when blocked; a waiter behind a
        blocked head may use any rank but the claimed one."""
        held = self.claimed()
        waited_s = time.perf_counter() - flight.arrived_s
        if behind:
            at = next((i for i, r in enumerate(snap.ranks) if r.key == held), None)
            return decide_behind(snap, flight.shape, self.policy, at, waited_s=waited_s)
        decision = decide(snap, flight.shape, self.policy, waited_s=waited_s)
        if decision.action is Action.WAIT and self.queue.head_owner is flight:
            mine = held if self._claim is not None and self._claim[0] is flight else None
            at = claim_rank(snap, flight.shape, mine)
            self._claim = (flight, snap.ranks[at].key) if at is not None else None
        return decision

    async def _attempt(self, flight: Flight, keys: Sequence[RankKey], behind: bool = False) -> RankKey | None:
        """One placement try: None = no room now; raises ApiError when the request can never run."""
        snap = await self.snapshot(keys)
        book, plan = self.book, flight.plan
        if book is not None and plan is not None:  # predicted: keep each rank's over-commit headroom free
            snap = book.adjust(snap, plan)
        decision = self._decide(snap, flight, behind)
        if decision.action is Action.REJECT:
            if decision.reason is RejectReason.NO_HEALTHY_RANK:
                raise ApiError(503, decision.detail, code="no_healthy_rank", headers={"Retry-After": "1"})
            raise ApiError(400, decision.detail, code="too_large", param="max_tokens")
        if decision.action is Action.WAIT:
            return None
        chosen = [snap.ranks[i] for i in decision.candidates]
        tokens = flight.shape.reserve_tokens(max(r.page_size for r in chosen))
        key = await self.ledger.reserve(flight.request_id, [r.key for r in chosen], tokens)
        if key is not None and book is not None and plan is not None:
            book.placed(flight.request_id, plan, key, tokens)
            page = snap.ranks[snap.index_of(key)].page_size
            flight.grow_at_tokens = growth_check_at(book, flight.request_id, 0, page)
        return key

    async def place(
        self, flight: Flight, keys: Sequence[RankKey], exclude: Collection[RankKey] = ()
    ) -> RankKey:
        """Reserve a rank for ``flight`` (waiting in line if need be) and account it locally."""
        allowed = [k for k in keys if k not in exclude] if exclude else keys
        if not allowed:
            raise ApiError(503, "no rank left to try", code="no_healthy_rank", headers={"Retry-After": "1"})
        start_s = time.perf_counter()
        queue = self.queue
        try:
            # Nobody waits: the one attempt the queue would make first, without its machinery.
            tried = not queue.closed and not queue.depth
            key = await self._attempt(flight, allowed) if tried else None
            if key is None:
                gate = gate_of(self.policy)
                key = await queue.admit(
                    lambda: self._attempt(flight, allowed),
                    behind=lambda: self._attempt(flight, allowed, behind=True),
                    owner=flight,
                    hold_s=gate.max_hold_s(flight.shape) if gate is not None else 0.0,
                    tried=tried,
                )
        except QueueFull:
            raise ApiError(
                429,
                f"The router's queue is full ({self.queue.max_waiting} requests wait for KV capacity).",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        except QueueTimeout:
            self.metrics.queue_waited("timeout", time.perf_counter() - start_s)
            raise ApiError(
                503,
                f"No KV capacity freed within {self.queue.timeout_s:g} s.",
                code="queue_timeout",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        except LedgerUnavailable as exc:
            raise ApiError(503, f"ledger unavailable: {exc}", code="ledger_unavailable") from None
        except QueueClosed:
            raise ApiError(
                503, "The router is shutting down.", code="shutting_down", headers={"Retry-After": "1"}
            ) from None
        self.metrics.queue_waited("placed", time.perf_counter() - start_s)
        self.metrics.placed(key)
        flight.on_placed(self.load, key)
        return key

    def entropy(self) -> int:
        return self._rng.getrandbits(32)
