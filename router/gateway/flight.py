"""One request in flight, and the router-local load every flight contributes to its rank.

The ledger holds reservations (shared across replicas). What only this process knows cheaply is how much
of each rank's reservation is live context (prompt + generated so far) and how much prompt still waits for
prefill; policies want both (lockstep: one rank's prefill slows every rank), so :class:`LocalLoad` keeps
them, updated by the flight at placement, first byte, each counted batch of tokens, and release.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.placement.snapshot import RankKey, RequestShape
from router.reservation.book import Plan
from router.sizing import Sized


@dataclass(slots=True)
class RankLoad:
    context_tokens: int = 0
    prefill_tokens: int = 0
    prefill_requests: int = 0


class LocalLoad:
    def __init__(self) -> None:
        self._by_key: dict[RankKey, RankLoad] = {}

    def get(self, key: RankKey) -> RankLoad:
        load = self._by_key.get(key)
        if load is None:
            load = self._by_key[key] = RankLoad()
        return load


@dataclass(slots=True)
class Flight:
    """A request from placement to release. ``finished`` flips once; release happens exactly then."""

    request_id: str
    route: str
    sized: Sized
    shape: RequestShape
    stream: bool
    arrived_s: float = field(default_factory=time.perf_counter)
    key: RankKey | None = None
    rid: str | None = None  # the id the engine knows the request by (for SGLang abort)
    first_byte_s: float | None = None
    generated_tokens: int = 0
    reported_tokens: int = 0  # generated tokens already told to the ledger
    grown_tokens: int = 0
    finished: bool = False
    outcome: str = "ok"
    model: str = ""  # metrics label: a served model (set once the request was matched to backends)
    plan: Plan | None = None  # output reservation plan (None: not followed by the reservation book)
    grow_at_tokens: int = sys.maxsize  # generated tokens at which to look at growth next
    cut: Callable[[], None] | None = None  # ends the relay now, with an in-band error (shutdown)
    role_events: int = 0  # OpenAI chat role chunks still to come (relay): events without a token

    def on_placed(self, load: LocalLoad, key: RankKey) -> None:
        self.key = key
        rank = load.get(key)
        rank.context_tokens += self.sized.prompt_tokens
        rank.prefill_tokens += self.sized.prompt_tokens
        rank.prefill_requests += 1

    def on_first_byte(self, load: LocalLoad) -> None:
        if self.first_byte_s is not None or self.key is None:
            return
        self.first_byte_s = time.perf_counter()
        rank = load.get(self.key)
        rank.prefill_tokens -= self.sized.prompt_tokens
        rank.prefill_requests -= 1

    def on_tokens(self, load: LocalLoad, tokens: int) -> None:
        """``tokens`` more generated; negative: the engine's exact count corrects an over-count."""
        if not tokens or self.key is None:
            return
        self.generated_tokens += tokens
        load.get(self.key).context_tokens += tokens

    def on_unplaced(self, load: LocalLoad) -> None:
        """Undo this flight's local load (release, or a retry moving it to another rank)."""
        if self.key is None:
            return
        rank = load.get(self.key)
        rank.context_tokens -= self.sized.prompt_tokens + self.generated_tokens
        if self.first_byte_s is None:
            rank.prefill_tokens -= self.sized.prompt_tokens
            rank.prefill_requests -= 1
        self.key = None
        self.generated_tokens = 0
        self.reported_tokens = 0
        self.grown_tokens = 0
        self.grow_at_tokens = sys.maxsize
