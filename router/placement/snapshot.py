"""Immutable inputs of a placement decision: what the router knows of every rank, and the request.

Policies read only these objects (no clock, no I/O), so the gateway, the simulator and the unit tests
run the same code on the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from router.units import round_up


class RankKey(NamedTuple):
    """One DP rank of one backend (an engine deployment).

    A named tuple, not a frozen dataclass: every ledger, store and load lookup hashes it, and a tuple
    hashes and compares in C where a dataclass runs a Python ``__hash__``/``__eq__`` per lookup.
    """

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
    # Derived once per view: every placement reads them for every rank, and a view is built only when
    # its inputs change (router/gateway/placement.py), so attributes beat properties here.
    used_tokens: int = field(init=False, repr=False, compare=False)
    """Occupancy as the router must assume it: its own reservations, or the engine's report if higher."""
    free_tokens: int = field(init=False, repr=False, compare=False)
    usable: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        engine = self.engine_used_tokens
        used = self.reserved_tokens if engine is None or engine <= self.reserved_tokens else engine
        object.__setattr__(self, "used_tokens", used)
        object.__setattr__(self, "free_tokens", self.capacity_tokens - used)
        object.__setattr__(self, "usable", self.healthy and not self.draining)


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
    need_tokens: int = field(init=False, repr=False, compare=False, hash=False)
    """Tokens to reserve before page rounding (at least one): fixed per request, read per rank."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "need_tokens", max(1, self.prompt_tokens + self.output_tokens))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def reserve_tokens(self, page_size: int) -> int:
        """Tokens to reserve on a rank with this page size: whole pages only."""
        return self.need_tokens if page_size == 1 else round_up(self.need_tokens, page_size)

    def fits(self, rank: RankView) -> bool:
        if not rank.usable:
            return False
        page = rank.page_size
        return (self.need_tokens if page == 1 else round_up(self.need_tokens, page)) <= rank.free_tokens

    def could_ever_fit(self, rank: RankView) -> bool:
        """Fits an empty rank of this capacity (health aside): false means refuse, not wait."""
        page = rank.page_size
        return (self.need_tokens if page == 1 else round_up(self.need_tokens, page)) <= rank.capacity_tokens
