"""Per-request and per-rank mutable state of :class:`loadtest.engine.Engine` (private to the engine)."""

from __future__ import annotations

from collections import deque

from loadtest.engine_types import EngineRequest

WAITING, PREFILL, DECODE = 0, 1, 2


class ReqState:
    __slots__ = (
        "clock_base",
        "epoch",
        "gen_base",
        "max_output_tokens",
        "pages",
        "phase",
        "prefill_target",
        "prefilled",
        "prompt_tokens",
        "rank",
        "rid",
        "state",
        "stop_reason",
        "target_tokens",
    )

    def __init__(self, req: EngineRequest, rank: int, target_tokens: int, stop_reason: str) -> None:
        self.rid = req.rid
        self.prompt_tokens = req.prompt_tokens
        self.max_output_tokens = req.max_output_tokens
        self.target_tokens = target_tokens
        self.stop_reason = stop_reason
        self.rank = rank
        self.state = WAITING
        self.prefill_target = req.prompt_tokens  # prompt + tokens generated before a preemption
        self.prefilled = 0
        self.pages = 0  # pages held while prefilling (decoders derive theirs from their length)
        self.gen_base = 0  # generated tokens when the rank's decode clock read clock_base
        self.clock_base = 0
        self.phase = 0
        self.epoch = 0  # bumped on leaving decode, invalidating stale finish-heap entries


class RankState:
    __slots__ = (
        "capacity_pages",
        "clock",
        "context_tokens",
        "decoding",
        "down",
        "finish_heap",
        "generation_tokens_total",
        "index",
        "phase_counts",
        "preemptions",
        "prefill_remaining_tokens",
        "prefilling",
        "prompt_tokens_total",
        "running",
        "slow_factor",
        "used_pages",
        "waiting",
        "waiting_tokens",
    )

    def __init__(self, index: int, capacity_pages: int, page_size: int) -> None:
        self.index = index
        self.capacity_pages = capacity_pages
        self.used_pages = 0
        self.waiting: deque[ReqState] = deque()
        self.running: dict[str, ReqState] = {}  # admission order: the last one is the newest
        self.prefilling: list[ReqState] = []
        self.decoding: dict[str, ReqState] = {}
        self.clock = 0  # decode steps this rank has run
        self.phase_counts = [0] * page_size  # decoders needing a new page when clock % page_size == i
        self.finish_heap: list[tuple[int, int, int, ReqState]] = []
        self.context_tokens = 0  # sum of decoders' lengths (K_r)
        self.waiting_tokens = 0
        self.prefill_remaining_tokens = 0
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.slow_factor = 1.0
        self.down = False
