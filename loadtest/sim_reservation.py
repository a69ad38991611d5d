"""Reservation modes in the simulator: the router's :class:`~router.reservation.book.ReservationBook` in
virtual time.

``max`` changes nothing (the simulated router reserves ``max_tokens`` as it always did). ``predicted``
sizes each request from the learned length quantile, charges each rank the over-commit headroom at
placement, and grows reservations page by page as the engine reports generated tokens. Generation is
checked only when a request may have reached its reservation (it advances at most one token per step),
so the cost is O(growths), not O(tokens). A growth the rank cannot fit is refused and the request keeps
running: the engine model decides whether its pool overflows and preempts.
"""

from __future__ import annotations

import heapq
from typing import Final, Protocol

from loadtest.workload import RequestSpec
from router.placement.snapshot import RankKey, Snapshot
from router.reservation.book import Plan, ReservationBook, ReservationSettings
from router.reservation.modes import ReservationMode, growth_check_after_tokens
from router.reservation.predictor import RequestKey

RESERVATION_MODES: Final[tuple[str, ...]] = tuple(m.value for m in ReservationMode)
SIM_ROUTE: Final[str] = "/v1/chat/completions"


class GeneratedSource(Protocol):
    """What the simulator's engine tells about one request (``Engine.generated_tokens``)."""

    def generated_tokens(self, rid: str) -> int | None: ...


class Grower(Protocol):
    """The simulated router's ledger: grow a live reservation if the rank has room."""

    def grow(self, index: int, tokens: int) -> bool: ...


class SimReservations:
    """Book + growth schedule for one simulated run (``predicted`` mode only)."""

    def __init__(self, settings: ReservationSettings, page_size: int) -> None:
        self.book = ReservationBook(settings)
        self.page_size = page_size
        self.steps = 0
        self.growths = 0
        self._plans: dict[int, Plan] = {}
        self._due: list[tuple[int, int]] = []  # (engine step to look again, request index)

    def output_tokens(self, spec: RequestSpec, max_tokens: int) -> int:
        """Output part of the first reservation; remembers the plan until the request is placed."""
        plan = self.book.plan(RequestKey(SIM_ROUTE, "sim", spec.prompt_tokens), max_tokens)
        self._plans[spec.index] = plan
        return plan.output_tokens

    def adjust(self, snapshot: Snapshot, index: int) -> Snapshot:
        plan = self._plans.get(index)
        return snapshot if plan is None else self.book.adjust(snapshot, plan)

    def placed(self, index: int, rank: RankKey, tokens: int) -> None:
        plan = self._plans.pop(index)
        self.book.placed(str(index), plan, rank, tokens)
        self._schedule(index, 0, tokens, plan.prompt_tokens)

    def _schedule(self, index: int, generated: int, reserved: int, prompt: int) -> None:
        wait = growth_check_after_tokens(generated, reserved, prompt_tokens=prompt)
        heapq.heappush(self._due, (self.steps + max(1, wait), index))

    def after_step(self, engine: GeneratedSource, ledger: Grower) -> None:
        """One engine step happened: grow the reservations generation may have reached."""
        self.steps += 1
        due = self._due
        while due and due[0][0] <= self.steps:
            _, index = heapq.heappop(due)
            rid = str(index)
            reserved = self.book.reserved_tokens(rid)
            generated = engine.generated_tokens(rid)
            if reserved is None or generated is None:
                continue  # finished or aborted meanwhile
            grow = self.book.growth(rid, generated, self.page_size)
            if grow:
                ok = ledger.grow(index, grow)
                self.book.grown(rid, grow, ok)
                self.growths += ok
                reserved += grow if ok else 0
            prompt = self.book.prompt_tokens(rid)
            self._schedule(index, generated, reserved, prompt)

    def finished(self, index: int, generated_tokens: int | None) -> None:
        """Left the engine: learn its length (None for an abort) and stop watching it."""
        self._plans.pop(index, None)
        self.book.finished(str(index), generated_tokens)

    def stats(self) -> dict[str, int]:
        return {"reservation_growths": self.growths, "reservation_growth_refusals": self.book.growth_failures}
