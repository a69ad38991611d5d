"""The DP-attention engine model shared by the HTTP emulator (real time) and the simulator (virtual time).

Pure and synchronous: :meth:`Engine.step` advances every rank by one lockstep step and returns how long it
took (from :class:`StepModel`) and what happened; callers decide whether to sleep. Per rank: a KV pool of
pages, a FIFO waiting queue, a running batch. A request holds ``ceil((prompt + generated) / page)`` pages
(reserved for prompt + first token when its prefill starts). Decoding is lazy: a sequence's length is a
function of its rank's decode clock, page crossings are counted per clock phase and finishes come off a
heap, so a step costs O(ranks + events), not O(tokens).
"""

from __future__ import annotations

import heapq

from loadtest.engine_model import RankWork, StepModel
from loadtest.engine_state import DECODE, PREFILL, WAITING, RankState, ReqState
from loadtest.engine_types import (
    DuplicateRequest,
    EngineConfig,
    EngineError,
    EngineRequest,
    PromptTooLong,
    RankLoad,
    RankOutOfRange,
    RankUnavailable,
    StepResult,
    TokenEvent,
)

__all__ = [
    "DuplicateRequest",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineRequest",
    "PromptTooLong",
    "RankLoad",
    "RankOutOfRange",
    "RankUnavailable",
    "RankWork",
    "StepModel",
    "StepResult",
    "TokenEvent",
]


class Engine:
    """N lockstep DP ranks. Not thread-safe: drive it from one thread or event loop."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.step_model: StepModel = config.step
        self._ps = config.page_size
        pages = config.capacity_pages_per_rank
        self._ranks = [RankState(i, pages, config.page_size) for i in range(config.dp_size)]
        self._reqs: dict[str, ReqState] = {}
        self._rr = 0
        self._lb_start = 0
        self._seq = 0
        self.clock_s = 0.0
        self.steps = 0
        self.preemptions_total = 0

    # ---- submission ----------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self._reqs

    def submit(self, request: EngineRequest, rank: int | None = None) -> int:
        """Queue ``request`` on ``rank`` (or the engine's own choice); returns the rank."""
        cfg = self.config
        if request.rid in self._reqs:
            raise DuplicateRequest(f"request id {request.rid!r} is already in flight")
        if request.prompt_tokens < 1 or request.max_output_tokens < 1:
            raise EngineError("prompt_tokens and max_output_tokens must be at least 1")
        limit = min(cfg.max_model_len, cfg.kv_tokens_per_rank)
        if request.prompt_tokens >= limit:
            raise PromptTooLong(
                f"The input ({request.prompt_tokens} tokens) is longer than the model's context length "
                f"({limit} tokens)."
            )
        if rank is None:
            rank = self._choose_rank()
        elif not 0 <= rank < cfg.dp_size:
            raise RankOutOfRange(f"routed_dp_rank={rank} out of range [0, {cfg.dp_size})")
        r = self._ranks[rank]
        if r.down:
            raise RankUnavailable(f"DP rank {rank} is not active.")
        own = request.output_tokens
        target = request.max_output_tokens
        if own is not None and not request.ignore_eos:
            target = min(own, target)
        target = max(1, min(target, limit - request.prompt_tokens))
        reason = "stop" if own is not None and not request.ignore_eos and target == own else "length"
        req = ReqState(request, rank, target, reason)
        self._reqs[request.rid] = req
        r.waiting.append(req)
        r.waiting_tokens += req.prefill_target
        r.prefill_remaining_tokens += req.prefill_target
        return rank

    def _choose_rank(self) -> int:
        n = self.config.dp_size
        if all(r.down for r in self._ranks):
            raise RankUnavailable("no DP rank is active.")
        if self.config.preempt_mode == "sglang":  # SGLang --load-balance-method round_robin
            while True:
                r = self._rr % n
                self._rr += 1
                if not self._ranks[r].down:
                    return r
        best, best_score = -1, 0.0
        for i in range(n):  # vLLM internal LB (core_client.py): KV-weighted queue score, rotating ties
            idx = (self._lb_start + i) % n
            rk = self._ranks[idx]
            if rk.down:
                continue
            waiting, running = len(rk.waiting), len(rk.running)
            score = float(waiting + running)
            if waiting:
                score += waiting * 6.0 * max(0.0, rk.used_pages / rk.capacity_pages - 0.5)
            if best < 0 or score < best_score:
                best, best_score = idx, score
        self._lb_start = (self._lb_start + 1) % n
        return best

    def abort(self, rid: str) -> bool:
        """Drop ``rid`` wherever it is and free its pages; False if it is not in the engine."""
        req = self._reqs.pop(rid, None)
        if req is None:
            return False
        r = self._ranks[req.rank]
        if req.state == WAITING:
            r.waiting.remove(req)
            r.waiting_tokens -= req.prefill_target
            r.prefill_remaining_tokens -= req.prefill_target
        else:
            self._leave_running(r, req)
        return True

    # ---- faults --------------------------------------------------------------------------------------
    def set_slow(self, rank: int, factor: float) -> None:
        """Multiply ``rank``'s per-step work (a straggler GPU): lockstep makes every rank pay it."""
        if factor <= 0:
            raise EngineError(f"slow factor must be positive, got {factor}")
        self._ranks[rank].slow_factor = factor

    def set_down(self, rank: int, down: bool = True) -> list[TokenEvent]:
        """Take ``rank`` out (its requests are aborted and reported) or bring it back."""
        r = self._ranks[rank]
        r.down = down
        if not down:
            return []
        gone = [*r.waiting, *r.running.values()]
        events = [TokenEvent(q.rid, rank, 0, self._generated(r, q), False, True, "abort") for q in gone]
        for q in gone:
            self.abort(q.rid)
        return events

    # ---- introspection -------------------------------------------------------------------------------
    def rank_of(self, rid: str) -> int | None:
        req = self._reqs.get(rid)
        return None if req is None else req.rank

    def generated_tokens(self, rid: str) -> int | None:
        """Tokens ``rid`` has generated so far (kept across a preemption); None if it is not in the engine."""
        req = self._reqs.get(rid)
        return None if req is None else self._generated(self._ranks[req.rank], req)

    def running_rids(self, rank: int) -> list[str]:
        return list(self._ranks[rank].running)

    def waiting_rids(self, rank: int) -> list[str]:
        return [q.rid for q in self._ranks[rank].waiting]

    def rank_loads(self) -> list[RankLoad]:
        ps = self._ps
        return [
            RankLoad(
                rank=r.index,
                running=len(r.running),
                waiting=len(r.waiting),
                used_tokens=r.used_pages * ps,
                capacity_tokens=r.capacity_pages * ps,
                waiting_tokens=r.waiting_tokens,
                preemptions_total=r.preemptions,
                prefill_tokens_pending=r.prefill_remaining_tokens,
                context_tokens=r.context_tokens,
                decode_seqs=len(r.decoding),
                prompt_tokens_total=r.prompt_tokens_total,
                generation_tokens_total=r.generation_tokens_total,
                healthy=not r.down,
            )
            for r in self._ranks
        ]

    def _generated(self, r: RankState, req: ReqState) -> int:
        if req.state == DECODE:
            return req.gen_base + r.clock - req.clock_base
        return req.gen_base

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Advance all ranks by one lockstep step. Nobody steps when every rank is idle (duration 0)."""
        if not self._reqs:
            return StepResult(0.0, [])
        events: list[TokenEvent] = []
        preempted: list[str] = []
        works: list[RankWork] = []
        for r in self._ranks:
            works.append(self._step_rank(r, events, preempted))
        duration_s = self.step_model.step_s(works)
        self.clock_s += duration_s
        self.steps += 1
        return StepResult(duration_s, events, tuple(preempted))

    def _step_rank(self, r: RankState, events: list[TokenEvent], preempted: list[str]) -> RankWork:
        cfg = self.config
        if r.down or (not r.running and not r.waiting):
            return RankWork(slow_factor=r.slow_factor)
        decode = bool(r.decoding)
        crossing = 0
        if cfg.mixed_chunk or not self._has_prefill_work(r):
            crossing = self._make_room(r, preempted) if decode else 0
            decode = bool(r.decoding)
        else:
            decode = False  # SGLang without mixed chunks: a prefill step stalls this rank's decoders
        b, k = (len(r.decoding), r.context_tokens) if decode else (0, 0)
        budget = cfg.prefill_chunk_tokens - (b if cfg.mixed_chunk else 0)
        chunks = self._schedule_prefill(r, budget, crossing)
        p_tokens = pos_sum = 0
        for req, chunk in chunks:
            p_tokens += chunk
            pos_sum += chunk * req.prefilled + chunk * (chunk - 1) // 2
        if decode:
            self._advance_decode(r, crossing, events)
        for req, chunk in chunks:
            req.prefilled += chunk
            r.prefill_remaining_tokens -= chunk
            if req.prefilled >= req.prefill_target:
                self._finish_prefill(r, req, events)
        return RankWork(b, k, p_tokens, pos_sum, r.slow_factor)

    def _has_prefill_work(self, r: RankState) -> bool:
        if r.prefilling:
            return True
        if not r.waiting or len(r.running) >= self.config.max_running_per_rank:
            return False
        return r.used_pages + self._pages(r.waiting[0].prefill_target + 1) <= r.capacity_pages

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self._ps)

    def _make_room(self, r: RankState, preempted: list[str]) -> int:
        """Preempt the newest running requests until this step's decode page growth fits."""
        ps = self._ps
        crossing = r.phase_counts[r.clock % ps]
        while r.used_pages + crossing > r.capacity_pages and r.running:
            victim = r.running[next(reversed(r.running))]
            self._preempt(r, victim)
            preempted.append(victim.rid)
            crossing = r.phase_counts[r.clock % ps]
        return crossing

    def _preempt(self, r: RankState, req: ReqState) -> None:
        """SGLang retract / vLLM recompute: free the KV; the request prefills prompt + output again."""
        gen = self._generated(r, req)
        self._leave_running(r, req)
        req.state = WAITING
        req.gen_base = gen
        req.prefill_target = req.prompt_tokens + gen
        req.prefilled = 0
        r.waiting.appendleft(req)
        r.waiting_tokens += req.prefill_target
        r.prefill_remaining_tokens += req.prefill_target
        r.preemptions += 1
        self.preemptions_total += 1

    def _leave_running(self, r: RankState, req: ReqState) -> None:
        if req.state == DECODE:
            length = req.prompt_tokens + self._generated(r, req)
            r.used_pages -= self._pages(length)
            r.context_tokens -= length
            r.phase_counts[req.phase] -= 1
            del r.decoding[req.rid]
            req.epoch += 1
        else:
            r.used_pages -= req.pages
            req.pages = 0
            r.prefilling.remove(req)
            r.prefill_remaining_tokens -= req.prefill_target - req.prefilled
        del r.running[req.rid]

    def _schedule_prefill(self, r: RankState, budget: int, reserved_pages: int) -> list[tuple[ReqState, int]]:
        """Chunks for this step: continue partial prefills, then admit the FIFO head while its pages fit."""
        chunks: list[tuple[ReqState, int]] = []
        for req in r.prefilling:
            if budget <= 0:
                return chunks
            chunk = min(budget, req.prefill_target - req.prefilled)
            chunks.append((req, chunk))
            budget -= chunk
        max_running = self.config.max_running_per_rank
        while budget > 0 and r.waiting and len(r.running) < max_running:
            req = r.waiting[0]
            pages = self._pages(req.prefill_target + 1)
            if r.used_pages + reserved_pages + pages > r.capacity_pages:
                break
            r.waiting.popleft()
            r.waiting_tokens -= req.prefill_target
            r.used_pages += pages
            req.pages = pages
            req.state = PREFILL
            r.prefilling.append(req)
            r.running[req.rid] = req
            chunk = min(budget, req.prefill_target)
            chunks.append((req, chunk))
            budget -= chunk
        return chunks

    def _advance_decode(self, r: RankState, crossing: int, events: list[TokenEvent]) -> None:
        b = len(r.decoding)
        r.used_pages += crossing
        r.context_tokens += b
        r.generation_tokens_total += b
        r.clock += 1
        clock = r.clock
        heap = r.finish_heap
        done: list[ReqState] = []
        while heap and heap[0][0] <= clock:
            _, _, epoch, req = heapq.heappop(heap)
            if req.epoch == epoch and req.state == DECODE:
                done.append(req)
        finals = [TokenEvent(q.rid, r.index, 1, q.target_tokens, False, True, q.stop_reason) for q in done]
        for q in done:
            self._leave_running(r, q)
            del self._reqs[q.rid]
        if self.config.token_events:
            idx = r.index
            events.extend(
                TokenEvent(q.rid, idx, 1, q.gen_base + clock - q.clock_base) for q in r.decoding.values()
            )
        events.extend(finals)

    def _finish_prefill(self, r: RankState, req: ReqState, events: list[TokenEvent]) -> None:
        """The last chunk's forward pass yields the next token; the request then decodes from next step."""
        first = req.gen_base == 0
        gen = req.gen_base + 1
        r.prefilling.remove(req)
        r.generation_tokens_total += 1
        if first:
            r.prompt_tokens_total += req.prompt_tokens
        if gen >= req.target_tokens:
            r.used_pages -= req.pages
            req.pages = 0
            del r.running[req.rid]
            del self._reqs[req.rid]
            events.append(TokenEvent(req.rid, r.index, 1, gen, first, True, req.stop_reason))
            return
        length = req.prompt_tokens + gen  # == prefill_target + 1: exactly the pages reserved at admission
        req.pages = 0
        req.state = DECODE
        req.gen_base = gen
        req.clock_base = r.clock
        req.phase = (r.clock - length) % self._ps
        r.phase_counts[req.phase] += 1
        r.decoding[req.rid] = req
        r.context_tokens += length
        self._seq += 1
        heapq.heappush(r.finish_heap, (r.clock + req.target_tokens - gen, self._seq, req.epoch, req))
        if first or self.config.token_events:
            events.append(TokenEvent(req.rid, r.index, 1, gen, first))
