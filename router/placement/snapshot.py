"""Immutable inputs of a placement decision: what the router knows of every rank, and the request.

Policies read only these objects (no clock, no I/O), so the gateway, the simulator and the unit tests
run the same code on the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.units import round_up


@dataclass(frozen=True, slots=True)
class RankKey:
    """One DP rank of one backend (an engine deployment)."""

    backend: str
    rank: int

    def __str__(self) -> str:
        return f"{self.backend}@{self.rank}"


@dataclass(frozen=True, slots=True)
class RankView:
    """What the router knows of one rank at decision time.

    ``reserved_tokens`` is the ledger's page-rounded reservation total (prompt + reserved output of every
    request pinned there, across router replicas). ``context_tokens`` is the KV actually holding context
    now (prompt + generated so far of running requests): it drives the per-step KV read. ``prefill_tokens``
    are prompt tokens admitted but not yet prefilled: under DP-attention lockstep they slow every rank.
    ``engine_used_tokens`` is the engine's own (lagging) report, or None when unknown.
    ``prefill_requests`` counts the requests behind ``prefill_tokens`` (placed, no first token yet): the
    engine's waiting queue as the router sees it.
    """

    key: RankKey
    capacity_tokens: int
    page_size: int = 1
    reserved_tokens: int = 0
    inflight: int = 0
    context_tokens: int = 0
    prefill_tokens: int = 0
    engine_used_tokens: int | None = None
    healthy: bool = True
    draining: bool = False
    prefill_requests: int = 0

    @property
    def used_tokens(self) -> int:
        """Occupancy as the router must assume it: its own reservations, or the engine's report if higher."""
        if self.engine_used_tokens is None:
            return self.reserved_tokens
        return max(self.reserved_tokens, self.engine_used_tokens)

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All ranks a request may go to, in a stable order, plus a decision counter for rotating policies."""

    ranks: tuple[RankView, ...]
    tick: int = 0

    def index_of(self, key: RankKey) -> int:
        for i, r in enumerate(self.ranks):
            if r.key == key:
                return i
        raise KeyError(str(key))


@dataclass(frozen=True, slots=True)
class RequestShape:
    """A request as placement sees it.

    ``output_tokens`` is the output reservation (already clamped and multiplied by ``n``).
    ``entropy`` is caller-supplied randomness so randomised policies (power of two) stay pure.
    """

    prompt_tokens: int
    output_tokens: int
    prefix_hash: int | None = None
    entropy: int = 0
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def reserve_tokens(self, page_size: int) -> int:
        """Tokens to reserve on a rank with this page size: whole pages only."""
        return round_up(max(1, self.total_tokens), page_size)

    def fits(self, rank: RankView) -> bool:
        return rank.usable and self.reserve_tokens(rank.page_size) <= rank.free_tokens

    def could_ever_fit(self, rank: RankView) -> bool:
        """Fits an empty rank of this capacity (health aside): false means refuse, not wait."""
        return self.reserve_tokens(rank.page_size) <= rank.capacity_tokens
