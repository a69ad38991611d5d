"""Simple placement policies and the helpers every policy shares.

Every policy is ``(Snapshot, RequestShape) -> list[int]``: indices into ``snapshot.ranks`` of the usable
ranks where the request fits now, best first, without duplicates. Ties are broken deterministically (by a
rotation from ``snapshot.tick`` or by index), so equal inputs give equal outputs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.placement.snapshot import RankView, RequestShape, Snapshot
from router.units import round_up

Policy = Callable[[Snapshot, RequestShape], list[int]]


def feasible(snapshot: Snapshot, request: RequestShape) -> list[int]:
    """Indices of usable ranks where the request fits now: ``RequestShape.fits`` inlined (every policy
    runs it over every rank on every placement)."""
    need = request.need_tokens
    return [
        i
        for i, r in enumerate(snapshot.ranks)
        if r.usable and (need if r.page_size == 1 else round_up(need, r.page_size)) <= r.free_tokens
    ]


def rotation(snapshot: Snapshot, index: int) -> int:
    """Distance of ``index`` from this decision's starting rank: a fair, deterministic tie-break."""
    n = len(snapshot.ranks)
    return (index - snapshot.tick) % n if n else 0


def token_load(rank: RankView) -> float:
    """KV occupancy as a fraction of capacity (reservations or the engine's report, whichever is higher)."""
    return rank.used_tokens / rank.capacity_tokens if rank.capacity_tokens > 0 else 1.0


# The orders below sort (key..., rotation, index) tuples rather than calling a key function per rank: the
# rotation is distinct per index, so the trailing index never decides and the order is the key order.


def round_robin(snapshot: Snapshot, request: RequestShape) -> list[int]:
    """Start at ``tick mod n`` and walk forward, skipping ranks where the request does not fit."""
    fit = feasible(snapshot, request)
    start = snapshot.tick % len(snapshot.ranks) if snapshot.ranks else 0
    return [i for i in fit if i >= start] + [i for i in fit if i < start]


def least_requests(snapshot: Snapshot, request: RequestShape) -> list[int]:
    """Fewest in-flight requests first (SGLang ``total_requests``); ties rotate so rank 0 is not favoured."""
    fit = feasible(snapshot, request)
    ranks, n, tick = snapshot.ranks, len(snapshot.ranks), snapshot.tick
    return [t[-1] for t in sorted([(ranks[i].inflight, (i - tick) % n, i) for i in fit])]


def kv_fit(snapshot: Snapshot, request: RequestShape) -> list[int]:
    """Most free latent-cache tokens first: spreads reservations, ignores step time."""
    fit = feasible(snapshot, request)
    ranks, n, tick = snapshot.ranks, len(snapshot.ranks), snapshot.tick
    return [t[-1] for t in sorted([(-ranks[i].free_tokens, (i - tick) % n, i) for i in fit])]


def _by_load(snapshot: Snapshot, indices: Sequence[int]) -> list[int]:
    ranks, n, tick = snapshot.ranks, len(snapshot.ranks), snapshot.tick
    keyed = [(token_load(ranks[i]), ranks[i].inflight, (i - tick) % n, i) for i in indices]
    return [t[-1] for t in sorted(keyed)]


def power_of_two(snapshot: Snapshot, request: RequestShape) -> list[int]:
    """Two distinct candidates drawn from ``request.entropy``, the less loaded first, then the rest by load.

    Load is KV occupancy (as sgl-router's token load), then in-flight count. The rest follow so a
    reservation that lost a race still has somewhere to go.
    """
    fit = feasible(snapshot, request)
    m = len(fit)
    if m <= 1:
        return fit
    first = request.entropy % m
    second = (first + 1 + (request.entropy // m) % (m - 1)) % m
    pair = _by_load(snapshot, [fit[first], fit[second]])
    rest = _by_load(snapshot, [i for i in fit if i not in pair])
    return pair + rest


def random_choice(snapshot: Snapshot, request: RequestShape) -> list[int]:
    """A uniform random order of the feasible ranks, seeded by ``request.entropy`` (so still pure)."""
    fit = feasible(snapshot, request)
    random.Random(request.entropy).shuffle(fit)
    return fit


@dataclass(frozen=True, slots=True)
class CacheAware:
    """sgl-router's ``cache_aware``, approximated without its radix tree.

    When in-flight counts are imbalanced (``max - min > balance_abs_threshold`` and
    ``max > min * balance_rel_threshold``) go to the least-loaded rank; otherwise send requests of one
    prefix to one rank (``prefix_hash mod n``, standing in for the tree's best match), falling back to the
    least-loaded rank when the prefix is unknown or its rank is full.
    """

    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __call__(self, snapshot: Snapshot, request: RequestShape) -> list[int]:
        fit = least_requests(snapshot, request)
        if not fit or request.prefix_hash is None:
            return fit
        usable = [r.inflight for r in snapshot.ranks if r.usable]
        lo, hi = min(usable), max(usable)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return fit
        target = request.prefix_hash % len(snapshot.ranks)
        if target in fit:
            return [target] + [i for i in fit if i != target]
        return fit
