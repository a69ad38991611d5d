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

Why ``prefill_weight`` ≈ 1,767 (calibration.md §2.2-2.3, 8×H200, DeepSeek-V3, DP8+EP8):
a cached token costs ``t_attn`` = 28.3 ns per decode step (MLA decode is compute-bound); a prompt token
being prefilled costs 50 µs on its own rank (``t_prefill_local``) plus 48 µs on the node
(``t_prefill_shared``, paid by the whole group wherever the prompt lands, so placement cannot change it).
One pending prompt token thus weighs 50 µs / 28.3 ns ≈ 1,767 cached tokens. In practice this makes the
policy balance pending prefill first (one rank's 1,024-token chunk adds ~100 ms to every rank's step, the
T4 effect) and spread long contexts when prefills are equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from router.placement.policies import feasible
from router.placement.snapshot import RankView, RequestShape, Snapshot

ATTN_NS_PER_CACHED_TOKEN: Final[float] = 28.3
PREFILL_LOCAL_NS_PER_TOKEN: Final[float] = 50_000.0
DEFAULT_PREFILL_WEIGHT: Final[float] = PREFILL_LOCAL_NS_PER_TOKEN / ATTN_NS_PER_CACHED_TOKEN


def step_load(rank: RankView, prefill_weight: float) -> float:
    """Cached-token equivalents this rank adds to every lockstep step now."""
    return rank.context_tokens + prefill_weight * rank.prefill_tokens


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

    def __post_init__(self) -> None:
        if not self.prefill_weight >= 0.0:
            raise ValueError(f"prefill_weight must be >= 0, got {self.prefill_weight}")

    def __call__(self, snapshot: Snapshot, request: RequestShape) -> list[int]:
        fit = feasible(snapshot, request)
        if len(fit) <= 1:
            return fit
        loads = [step_load(r, self.prefill_weight) for r in snapshot.ranks]
        top = _group_top_two(snapshot, loads)
        added = request.prompt_tokens * (1.0 + self.prefill_weight)

        def key(i: int) -> tuple[float, float, int, int]:
            idx, first, second = top[snapshot.ranks[i].key.backend]
            others = second if idx == i else first
            mine = loads[i] + added
            return (max(others, mine) - first, mine, -snapshot.ranks[i].free_tokens, i)

        return sorted(fit, key=key)
