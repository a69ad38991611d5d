"""The gateway's admission and placement in virtual time: what a real router knows, and nothing more.

Per rank it keeps its own ledger (page-rounded reservations, in-flight count, prompts placed and not yet
answered) and a copy of the engine's ``used_tokens`` refreshed only every ``telemetry_interval_s``, like a
``/metrics`` scrape. ``context_tokens`` (KV the rank reads per step) is the sum of prompt + generated tokens
of the requests that have started answering: the gateway counts those from the streams it relays, so the
simulator reads them fresh from the engine, where the two are equal (they differ only after a preemption,
which does not happen behind the router's reservations).

Admission mirrors ``router.gateway.waitqueue``: requests that fit nowhere now wait in a bounded FIFO; only
the head tries to place itself; each waiter has a deadline. A blocked head claims one rank
(``router.placement.admission.claim_rank``) and the waiters behind it, newcomers included, backfill every
other rank in line order (``decide_behind``); those that fit only on the claimed rank keep waiting.
A policy's long-prefill gate (``router.placement.prefill_gate``) sees how long a request has waited
(virtual time since its arrival) and the queue deadline of a long request is extended by its hold, as in
the gateway.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from loadtest.engine_types import RankLoad
from loadtest.sim_reservation import SimReservations
from loadtest.workload import RequestSpec
from router.placement.admission import Action, Decision, claim_rank, decide, decide_behind, gate_of
from router.placement.policies import Policy
from router.placement.snapshot import RankKey, RankView, RequestShape, Snapshot

ReserveMode = Literal["gateway", "max"]
RESERVE_MODES: tuple[ReserveMode, ...] = ("gateway", "max")
_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: spreads request indices into policy entropy
_MASK = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """``reserve_mode``: ``gateway`` reserves ``max_tokens`` or ``default_max_tokens`` when absent (the
    gateway's default); ``max`` reserves the whole context window when absent (never under-reserves)."""

    ranks: int
    capacity_tokens: int
    page_size: int
    max_context_tokens: int
    default_max_tokens: int = 512
    reserve_mode: ReserveMode = "gateway"
    queue_max: int = 256
    queue_timeout_s: float = 30.0
    telemetry_interval_s: float = 1.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Placed:
    spec: RequestSpec
    rank: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Refused:
    spec: RequestSpec
    reason: str


class SimRouter:
    """Ledger arrays, the wait queue and the telemetry copy; the simulator loop feeds it engine events."""

    def __init__(
        self, config: RouterConfig, policy: Policy, reservations: SimReservations | None = None
    ) -> None:
        self.config = config
        self.policy = policy
        self.reservations = reservations  # None: reserve max_tokens (mode max)
        n = config.ranks
        self.reserved_tokens = [0] * n
        self.inflight = [0] * n
        self.prefill_tokens = [0] * n
        self.prefill_requests = [0] * n
        self.context_tokens = [0] * n
        self.engine_used_tokens: list[int | None] = [None] * n
        self.queue: deque[tuple[RequestSpec, RequestShape, float]] = deque()
        self.next_scrape_s = 0.0
        self.tick = 0
        self._keys = tuple(RankKey("sim", i) for i in range(n))
        self._held: dict[int, tuple[int, int, int]] = {}  # index -> (rank, tokens, prompt pending or 0)
        self.claimed: tuple[int, int] | None = None  # (request index of the blocked head, its claimed rank)

    # ---- sizing and snapshot -------------------------------------------------------------------------
    def shape(self, spec: RequestSpec) -> RequestShape:
        """Prompt and output reservation the way ``router.sizing`` clamps them to the context window."""
        cfg = self.config
        limit = spec.max_tokens
        if limit is None:
            limit = cfg.default_max_tokens if cfg.reserve_mode == "gateway" else cfg.max_context_tokens
        room = max(1, cfg.max_context_tokens - spec.prompt_tokens)
        output_tokens = min(limit, room)
        if self.reservations is not None:  # predicted: capped by what the engine will allow
            cap = min(spec.max_tokens, room) if spec.max_tokens is not None else room
            output_tokens = self.reservations.output_tokens(spec, cap)
        return RequestShape(
            prompt_tokens=spec.prompt_tokens,
            output_tokens=output_tokens,
            prefix_hash=spec.prefix_group,
            entropy=((spec.index + 1) * _MIX + self.config.seed) & _MASK,
        )

    def snapshot(self) -> Snapshot:
        cfg = self.config
        ranks = tuple(
            RankView(
                key=self._keys[i],
                capacity_tokens=cfg.capacity_tokens,
                page_size=cfg.page_size,
                reserved_tokens=self.reserved_tokens[i],
                inflight=self.inflight[i],
                context_tokens=self.context_tokens[i],
                prefill_tokens=self.prefill_tokens[i],
                engine_used_tokens=self.engine_used_tokens[i],
                prefill_requests=self.prefill_requests[i],
            )
            for i in range(cfg.ranks)
        )
        return Snapshot(ranks=ranks, tick=self.tick)

    # ---- admission -----------------------------------------------------------------------------------
    def _decide(
        self, snap: Snapshot, spec: RequestSpec, shape: RequestShape, head: bool, waited_s: float
    ) -> Decision:
        """The head may use any rank and claims one when blocked; anyone else keeps off the claimed rank."""
        limit = self.config.max_context_tokens
        claim = self.claimed
        if claim is not None and self.queue and self.queue[0][0].index != claim[0]:
            claim = self.claimed = None  # that head left (placed or timed out): its claim with it
        if not head:
            at = claim[1] if claim else None
            return decide_behind(snap, shape, self.policy, at, max_context_tokens=limit, waited_s=waited_s)
        d = decide(snap, shape, self.policy, max_context_tokens=limit, waited_s=waited_s)
        if d.action is Action.WAIT:
            held = self._keys[claim[1]] if claim is not None and claim[0] == spec.index else None
            at = claim_rank(snap, shape, held)
            self.claimed = (spec.index, at) if at is not None else None
        return d

    def _try(
        self, spec: RequestSpec, shape: RequestShape, head: bool = True, waited_s: float = 0.0
    ) -> Placed | Refused | None:
        """One decision: placed, refused for good, or None (no room now)."""
        snap = self.snapshot()
        if self.reservations is not None:
            snap = self.reservations.adjust(snap, spec.index)
        self.tick += 1
        d = self._decide(snap, spec, shape, head, waited_s)
        if d.action is Action.REJECT:
            assert d.reason is not None
            return Refused(spec, d.reason.value)
        if d.action is Action.WAIT:
            return None
        rank = d.candidates[0]
        tokens = shape.reserve_tokens(self.config.page_size)
        self.reserved_tokens[rank] += tokens
        self.inflight[rank] += 1
        self.prefill_tokens[rank] += spec.prompt_tokens
        self.prefill_requests[rank] += 1
        self._held[spec.index] = (rank, tokens, spec.prompt_tokens)
        if self.reservations is not None:
            self.reservations.placed(spec.index, self._keys[rank], tokens)
        return Placed(spec, rank, tokens)

    def offer(self, spec: RequestSpec, now_s: float) -> Placed | Refused | None:
        """A new arrival: placed now, refused, or queued (None)."""
        shape = self.shape(spec)
        if spec.prompt_tokens >= self.config.max_context_tokens:
            return Refused(spec, "context_length")
        # Behind a blocked head (any line is one: pump leaves a head only when it cannot place), backfill.
        got = self._try(spec, shape, head=not self.queue)
        return got if got is not None else self._enqueue(spec, shape, now_s)

    def _enqueue(self, spec: RequestSpec, shape: RequestShape, now_s: float) -> Refused | None:
        if len(self.queue) >= self.config.queue_max:
            return Refused(spec, "queue_full")
        gate = gate_of(self.policy)
        held_s = gate.max_hold_s(shape) if gate is not None else 0.0  # the deadline waits out the hold
        self.queue.append((spec, shape, now_s + held_s + self.config.queue_timeout_s))
        return None

    def pump(self, now_s: float) -> list[Placed | Refused]:
        """Expire waiters past their deadline, place from the head while it fits, then backfill behind
        the blocked head in line order."""
        out: list[Placed | Refused] = []
        while self.queue:
            spec, shape, deadline_s = self.queue[0]
            if now_s >= deadline_s:
                self.queue.popleft()
                out.append(Refused(spec, "queue_timeout"))
                continue
            got = self._try(spec, shape, waited_s=now_s - spec.arrival_s)
            if got is None:
                break
            self.queue.popleft()
            out.append(got)
        if len(self.queue) > 1:
            out.extend(self._backfill(now_s))
        return out

    def _backfill(self, now_s: float) -> list[Placed | Refused]:
        out: list[Placed | Refused] = []
        kept: deque[tuple[RequestSpec, RequestShape, float]] = deque([self.queue[0]])
        for waiter in list(self.queue)[1:]:
            spec, shape, deadline_s = waiter
            waited_s = now_s - spec.arrival_s
            got = (
                Refused(spec, "queue_timeout")
                if now_s >= deadline_s
                else self._try(spec, shape, head=False, waited_s=waited_s)
            )
            if got is None:
                kept.append(waiter)
            else:
                out.append(got)
        self.queue = kept
        return out

    # ---- engine feedback -----------------------------------------------------------------------------
    def first_token(self, index: int) -> None:
        held = self._held.get(index)
        if held is None or not held[2]:
            return
        rank, tokens, prompt = held
        self.prefill_tokens[rank] -= prompt
        self.prefill_requests[rank] -= 1
        self._held[index] = (rank, tokens, 0)

    def grow(self, index: int, tokens: int) -> bool:
        """Grow a live reservation if its rank has room (the ledger's ``grow``)."""
        held = self._held.get(index)
        if held is None or self.reserved_tokens[held[0]] + tokens > self.config.capacity_tokens:
            return False
        self.reserved_tokens[held[0]] += tokens
        self._held[index] = (held[0], held[1] + tokens, held[2])
        return True

    def release(self, index: int, generated_tokens: int | None = None) -> None:
        """The request finished or failed: return its reservation (exactly once). ``generated_tokens``:
        its length when it ended on its own (what the predictor learns from)."""
        if self.reservations is not None:
            self.reservations.finished(index, generated_tokens)
        self.first_token(index)
        held = self._held.pop(index, None)
        if held is None:
            return
        rank, tokens, _ = held
        self.reserved_tokens[rank] -= tokens
        self.inflight[rank] -= 1

    def observe(self, loads: list[RankLoad], now_s: float) -> None:
        """After every step: fresh context counts; the engine's used tokens only when a scrape is due."""
        for load in loads:
            self.context_tokens[load.rank] = load.context_tokens
        if now_s >= self.next_scrape_s:
            self.engine_used_tokens = [load.used_tokens for load in loads]
            self.next_scrape_s = now_s + self.config.telemetry_interval_s

    @property
    def held_requests(self) -> int:
        return len(self._held)

    def next_deadline_s(self) -> float | None:
        return self.queue[0][2] if self.queue else None
