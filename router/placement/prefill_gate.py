"""When a long prompt may enter a lockstep (DP-attention) group: the long-prefill gate. Pure.

Under DP attention every rank of a deployment steps together, and a step that carries a chunk of a long
prompt is slow on *every* rank: a 1,024-token chunk at position ``pos`` costs ``1,024 × (50 µs + 11.1 ns ×
pos)`` on its own rank (calibration.md §2.3), ~0.4 s at 30k and ~1.4 s at 128k, against ~50 ms for a
decode step. A 128k prompt alone makes ~100 s of such steps, and a short request decoding meanwhile misses
a 250 ms TPOT. The per-rank part of a step is a *maximum* over ranks, so long prefills running in the same
steps on different ranks cost little more than one: what hurts is slow phases one after another, not
several long prefills at once. (Bounding how many run at once serialises them: in the simulator that cut
goodput 2-5x; see docs/placement.md.)

So the gate batches long prefills. A long request (prompt >= ``long_prompt_tokens``) is held in the
router's queue until a slow phase is running in its group that its own prefill fits in (it rides along on
another rank and adds no slow step), or until it has waited ``hold_stretch`` × its own prefill time; then
it goes, opening a phase that later long requests can join. It is never held longer (no starvation), and
short requests are never held: they pass held ones in the queue (backfill) and run in the fast gaps.
``max_long_prefills`` optionally caps the ranks of a group prefilling long prompts at once (None: no cap).

A rank is in a slow phase while its pending prompt tokens (placed, no first token yet; the snapshot's
``prefill_tokens``) reach ``long_prompt_tokens``; the phase's remaining time is estimated from those
tokens as if they started at position 0 (a low estimate, so a request rides along only when it surely fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from router.placement.snapshot import RankView, RequestShape, Snapshot

# Where a prompt's prefill turns attention-bound: 11.1 ns x pos passes the fixed 50 us per token at
# pos ~4.5k, i.e. on average over a prompt of ~9k tokens.
DEFAULT_LONG_PROMPT_TOKENS: Final[int] = 8_192
DEFAULT_HOLD_STRETCH: Final[float] = 2.0
# One prompt's prefill alone (calibration.md §2.2-2.3): per 1,024-token chunk a ~30 ms step floor, per
# token 50 us local + 48 us node-shared, per token-position 11.1 ns of causal attention.
CHUNK_TOKENS: Final[int] = 1_024
STEP_FLOOR_S: Final[float] = 0.030
PREFILL_S_PER_TOKEN: Final[float] = 98e-6
PREFILL_ATTN_S_PER_TOKEN_POS: Final[float] = 11.1e-9


def prefill_s(prompt_tokens: int) -> float:
    """Seconds of lockstep steps one prompt's chunked prefill takes from position 0 on an idle node."""
    tokens = max(0, prompt_tokens)
    chunks = -(-tokens // CHUNK_TOKENS)
    return chunks * STEP_FLOOR_S + tokens * PREFILL_S_PER_TOKEN + PREFILL_ATTN_S_PER_TOKEN_POS * tokens**2 / 2


@dataclass(frozen=True, slots=True)
class LongPrefillGate:
    long_prompt_tokens: int = DEFAULT_LONG_PROMPT_TOKENS
    hold_stretch: float = DEFAULT_HOLD_STRETCH
    max_long_prefills: int | None = None

    def __post_init__(self) -> None:
        if self.long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens must be >= 1, got {self.long_prompt_tokens}")
        if self.hold_stretch < 0:
            raise ValueError(f"hold_stretch must be >= 0, got {self.hold_stretch}")
        if self.max_long_prefills is not None and self.max_long_prefills < 1:
            raise ValueError(f"max_long_prefills must be >= 1 or None, got {self.max_long_prefills}")

    def is_long(self, request: RequestShape) -> bool:
        return request.prompt_tokens >= self.long_prompt_tokens

    def max_hold_s(self, request: RequestShape) -> float:
        """The longest the gate holds ``request`` (0 for a short one): the queue adds it to the deadline."""
        return self.hold_stretch * prefill_s(request.prompt_tokens) if self.is_long(request) else 0.0

    def prefilling_long(self, rank: RankView) -> bool:
        return rank.prefill_tokens >= self.long_prompt_tokens

    def allowed(
        self, snapshot: Snapshot, request: RequestShape, candidates: Sequence[int], waited_s: float
    ) -> tuple[int, ...]:
        """The ``candidates`` (snapshot indices, best first) where ``request`` may go now.

        All of them for a short request or a long one held ``max_hold_s`` already. Otherwise those ranks
        not prefilling a long prompt in groups whose running slow phase outlasts this prompt's prefill
        (and, with a cap, where fewer than ``max_long_prefills`` ranks prefill long prompts); none while no
        such phase runs.
        """
        if not self.is_long(request) or waited_s >= self.max_hold_s(request):
            return tuple(candidates)
        running: dict[str, int] = {}
        phase_s: dict[str, float] = {}
        for rank in snapshot.ranks:
            if self.prefilling_long(rank):
                backend = rank.key.backend
                running[backend] = running.get(backend, 0) + 1
                phase_s[backend] = max(phase_s.get(backend, 0.0), prefill_s(rank.prefill_tokens))
        mine_s = prefill_s(request.prompt_tokens)
        cap = self.max_long_prefills
        out: list[int] = []
        for i in candidates:
            rank = snapshot.ranks[i]
            backend = rank.key.backend
            n = running.get(backend, 0)
            if (
                n
                and mine_s <= phase_s[backend]
                and (cap is None or n < cap)
                and not self.prefilling_long(rank)
            ):
                out.append(i)
        return tuple(out)
