"""The default policy: keep the slowest rank of each lockstep group as fast as possible.

Under DP attention every rank of a deployment steps together (the MoE all-to-all), so a step lasts as long
as the most loaded rank's. A rank's *step load* is what it adds to a step, in cached-token equivalents:

    load = context_tokens + prefill_weight * prefill_tokens

``context_tokens`` is the latent cache the rank reads every decode step; ``prefill_tokens`` are prompt
tokens placed there and not yet prefilled. Placing a request adds its prompt to both. The policy ranks
the feasible ranks by how much the placement raises the maximum step load of the rank's group (its
backend), then by the rank's own resulting load, then by free tokens. Within one group that is "the lowest
resulting maximum"; across backends (which do not step together) it prefers filling a rank that sits below
its group's slowest rank, which costs no step time, over slowing another group.

Weights (calibration.md §2.2-2.3, 8×H200, DeepSeek-V3, DP8+EP8), in cached-token equivalents:
a cached token costs ``t_attn`` = 28.3 ns per decode step (MLA decode is compute-bound); a prompt token
being prefilled at position ``pos`` costs ``50 µs + 11.1 ns × pos`` on its own rank (``t_prefill_local``)
plus 48 µs on the node (``t_prefill_shared``, paid by the whole group wherever the prompt lands, so
placement cannot change it). So ``prefill_weight`` = 50 µs / 28.3 ns ≈ 1,767 per pending prompt token and
``prefill_attn_weight`` = 11.1 / 28.3 ≈ 0.39 per token-position: a prompt of P tokens costs
``1,767 P + 0.39 P²/2``. The quadratic part dominates past ~9k tokens (a 128k prompt is ~100 s of ~0.9 s
steps for every rank), so a short request must not queue behind a long prefill on its rank. The snapshot
carries only the sum of pending prompt tokens and their count, so Σ P² is estimated as
``prefill_tokens² / prefill_requests`` (exact when the pending prompts are equal, low otherwise).
In practice the policy balances pending prefill work first (one rank's 1,024-token chunk adds ~100 ms to
every rank's step, the T4 effect) and spreads long contexts when prefills are equal.

It also carries a long-prefill gate (:mod:`router.placement.prefill_gate`, applied by admission): long
prompts are held in the router's queue, a bounded time, so that their slow prefill steps overlap instead of
following each other. ``hold_stretch=0`` turns it off (policy ``lockstep_eager``, the behaviour before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from router.placement.policies import feasible
from router.placement.prefill_gate import DEFAULT_HOLD_STRETCH, DEFAULT_LONG_PROMPT_TOKENS, LongPrefillGate
from router.placement.snapshot import RankView, RequestShape, Snapshot

ATTN_NS_PER_CACHED_TOKEN: Final[float] = 28.3
PREFILL_LOCAL_NS_PER_TOKEN: Final[float] = 50_000.0
PREFILL_ATTN_NS_PER_TOKEN_POS: Final[float] = 11.1
DEFAULT_PREFILL_WEIGHT: Final[float] = PREFILL_LOCAL_NS_PER_TOKEN / ATTN_NS_PER_CACHED_TOKEN
DEFAULT_PREFILL_ATTN_WEIGHT: Final[float] = PREFILL_ATTN_NS_PER_TOKEN_POS / ATTN_NS_PER_CACHED_TOKEN


def step_load(rank: RankView, prefill_weight: float, prefill_attn_weight: float = 0.0) -> float:
    """Cached-token equivalents of the work this rank adds to the lockstep: KV read per step plus the
    pending prefill (linear and position-dependent parts)."""
    load = rank.context_tokens + prefill_weight * rank.prefill_tokens
    if prefill_attn_weight and rank.prefill_tokens:
        sum_sq = rank.prefill_tokens * rank.prefill_tokens / max(1, rank.prefill_requests)
        load += prefill_attn_weight * sum_sq / 2.0
    return load


def request_load(request: RequestShape, prefill_weight: float, prefill_attn_weight: float = 0.0) -> float:
    """What placing ``request`` adds to a rank's :func:`step_load` (the same on every rank)."""
    p = request.prompt_tokens
    return p * (1.0 + prefill_weight) + prefill_attn_weight * p * p / 2.0


def _group_top_two(snapshot: Snapshot, loads: list[float]) -> dict[str, tuple[int, float, float]]:
    """Per backend: (index of the max, max load, second-highest load). All ranks count, even unusable ones:
    a draining rank still steps with its group."""
    top: dict[str, tuple[int, float, float]] = {}
    for i, rank in enumerate(snapshot.ranks):
        load = loads[i]
        backend = rank.key.backend
        if backend not in top:
            top[backend] = (i, load, float("-inf"))
            continue
        idx, first, second = top[backend]
        if load > first:
            top[backend] = (i, load, first)
        elif load > second:
            top[backend] = (idx, first, load)
    return top


@dataclass(frozen=True, slots=True)
class Lockstep:
    """Minimise the rise of the group's maximum step load (see the module docstring)."""

    prefill_weight: float = DEFAULT_PREFILL_WEIGHT
    prefill_attn_weight: float = DEFAULT_PREFILL_ATTN_WEIGHT
    long_prompt_tokens: int = DEFAULT_LONG_PROMPT_TOKENS
    hold_stretch: float = DEFAULT_HOLD_STRETCH  # 0: long prompts are placed as soon as they fit
    max_long_prefills: int | None = None
    # Built (and validated) once: admission asks for it on every placement.
    _gate: LongPrefillGate | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("prefill_weight", "prefill_attn_weight", "hold_stretch"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0.0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        gate = None
        if self.hold_stretch:
            gate = LongPrefillGate(self.long_prompt_tokens, float(self.hold_stretch), self.max_long_prefills)
        object.__setattr__(self, "_gate", gate)

    @property
    def gate(self) -> LongPrefillGate | None:
        """The long-prefill gate admission applies (None when ``hold_stretch`` is 0)."""
        return self._gate

    def __call__(self, snapshot: Snapshot, request: RequestShape) -> list[int]:
        fit = feasible(snapshot, request)
        if len(fit) <= 1:
            return fit
        ranks = snapshot.ranks
        weight, attn_weight = self.prefill_weight, self.prefill_attn_weight
        loads: list[float] = []
        for r in ranks:  # step_load, inlined (same operations in the same order)
            p = r.prefill_tokens
            load = r.context_tokens + weight * p
            if attn_weight and p:
                load += attn_weight * (p * p / max(1, r.prefill_requests)) / 2.0
            loads.append(load)
        top = _group_top_two(snapshot, loads)
        added = request_load(request, weight, attn_weight)
        keyed: list[tuple[float, float, int, int]] = []
        for i in fit:  # (rise of the group's max, own load, -free, index): the index never decides
            rank = ranks[i]
            idx, first, second = top[rank.key.backend]
            mine = loads[i] + added
            others = second if idx == i else first
            keyed.append((max(others, mine) - first, mine, -rank.free_tokens, i))
        keyed.sort()
        return [t[3] for t in keyed]
