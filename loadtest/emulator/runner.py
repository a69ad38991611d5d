"""Drives :class:`Engine` in real time and fans its token events out to per-request handles.

One asyncio task steps the engine, sleeps ``duration × time_scale`` (0 = only yield to the loop) and then
delivers the step's tokens, so a token appears when its step ends. Handles are cheap: a pending-token
counter and one future that the HTTP side awaits; no per-token queue items.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from loadtest.emulator.faults import Faults
from loadtest.emulator.outlen import OutputLenDist
from loadtest.engine import Engine, EngineRequest, TokenEvent

# vLLM's TIME_TO_FIRST_TOKEN_BUCKETS (vllm/v1/metrics/buckets.py), used by both faces.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
FINISHED_LOG_LEN = 2000


class RequestHandle:
    """One request as the HTTP side sees it. ``pending`` tokens arrived since the last :meth:`wait`."""

    __slots__ = (
        "_waiter",
        "client_gone",
        "created_s",
        "done",
        "error",
        "finish_reason",
        "first_token_s",
        "generated",
        "pending",
        "pinned_rank",
        "preemptions",
        "prompt_tokens",
        "rank",
        "rid",
    )

    def __init__(self, rid: str, rank: int, pinned_rank: int | None, prompt_tokens: int) -> None:
        self.rid = rid
        self.rank = rank
        self.pinned_rank = pinned_rank
        self.prompt_tokens = prompt_tokens
        self.created_s = time.monotonic()
        self.first_token_s: float | None = None
        self.generated = 0
        self.pending = 0
        self.done = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.preemptions = 0
        self.client_gone = False
        self._waiter: asyncio.Future[None] | None = None

    async def wait(self) -> int:
        """New tokens since the last call (waits for at least one, or for the end)."""
        if not self.pending and not self.done:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiter = fut
            try:
                await fut
            finally:
                self._waiter = None
        n, self.pending = self.pending, 0
        return n

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class RankCounters:
    __slots__ = ("requests_total", "ttft_buckets", "ttft_count", "ttft_sum_s")

    def __init__(self) -> None:
        self.requests_total = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS_S)
        self.ttft_count = 0
        self.ttft_sum_s = 0.0

    def observe_ttft(self, ttft_s: float) -> None:
        self.ttft_count += 1
        self.ttft_sum_s += ttft_s
        for i, bound in enumerate(TTFT_BUCKETS_S):
            if ttft_s <= bound:
                self.ttft_buckets[i] += 1
                break


class EngineRunner:
    def __init__(
        self,
        engine: Engine,
        *,
        time_scale: float = 1.0,
        output_len: OutputLenDist | None = None,
        seed: int = 0,
        faults: Faults | None = None,
    ) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.engine = engine
        self.time_scale = time_scale
        self.output_len = output_len or OutputLenDist("max")
        self._rng = random.Random(seed)
        self.faults = Faults()
        self._handles: dict[str, RequestHandle] = {}
        self.finished: deque[dict[str, Any]] = deque(maxlen=FINISHED_LOG_LEN)
        self.counters = [RankCounters() for _ in range(engine.config.dp_size)]
        self.client_disconnects = 0
        self.orphans: set[str] = set()
        self._throughput: deque[tuple[float, list[int]]] = deque(maxlen=8)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self.set_faults(faults or Faults())

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for h in list(self._handles.values()):
            self._finish(h, "abort", "server shutting down")

    # ---- requests ------------------------------------------------------------------------------------
    def new_rid(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}{self._seq:x}{self._rng.getrandbits(32):08x}"

    def output_tokens(self, hint: int | None) -> int | None:
        """The answer's own length: the client's hint if any, else a draw from the distribution."""
        return hint if hint is not None else self.output_len.sample(self._rng)

    def submit(self, request: EngineRequest, rank: int | None) -> RequestHandle:
        """Queue a request (raises :class:`loadtest.engine.EngineError` on refusal)."""
        pinned = rank
        if self.faults.ignore_pin:
            rank = None
        chosen = self.engine.submit(request, rank)
        h = RequestHandle(request.rid, chosen, pinned, request.prompt_tokens)
        self._handles[request.rid] = h
        self.counters[chosen].requests_total += 1
        self._wake.set()
        return h

    def client_gone(self, h: RequestHandle) -> None:
        """The client disconnected: abort in the engine (unless the keep-orphans fault is on)."""
        if h.done:
            return
        self.client_disconnects += 1
        h.client_gone = True
        if self.faults.keep_orphans:
            self.orphans.add(h.rid)
            return
        self.engine.abort(h.rid)
        self._finish(h, "abort", "client disconnected")

    def abort(self, rid: str) -> bool:
        h = self._handles.get(rid)
        if h is None:
            return False
        self.engine.abort(rid)
        self._finish(h, "abort", "aborted by /abort_request")
        return True

    def inflight(self) -> list[RequestHandle]:
        return list(self._handles.values())

    # ---- faults --------------------------------------------------------------------------------------
    def set_faults(self, faults: Faults) -> None:
        eng = self.engine
        for r in range(eng.config.dp_size):
            eng.set_slow(r, faults.slow_ranks.get(r, 1.0))
            down = r in faults.down_ranks
            if down != (r in self.faults.down_ranks):
                self._dispatch(eng.set_down(r, down), f"DP rank {r} is not active.")
        self.faults = faults

    # ---- the loop ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if self.engine.idle:
                self._wake.clear()
                await self._wake.wait()
                due = loop.time()
                continue
            res = self.engine.step()
            # Bind events to today's handles before sleeping: a request aborted during the sleep may be
            # replaced by a new one reusing its rid, which must not receive the old one's tokens.
            owners = {ev.rid: self._handles.get(ev.rid) for ev in res.events}
            for rid in res.preempted_rids:
                if (h := self._handles.get(rid)) is not None:
                    h.preemptions += 1
            delay_s = res.duration_s * self.time_scale
            now = loop.time()
            if delay_s > 0:
                due = max(due, now - 1.0) + delay_s  # behind by > 1 s: do not burst to catch up
                if due > now:
                    await asyncio.sleep(due - now)
            else:
                await asyncio.sleep(0)
            self._dispatch(res.events, owners=owners)
            self._sample_throughput(loop.time())

    def _dispatch(
        self,
        events: Iterable[TokenEvent],
        abort_error: str | None = None,
        owners: dict[str, RequestHandle | None] | None = None,
    ) -> None:
        now = time.monotonic()
        cut = self.faults.abort_after_tokens
        for ev in events:
            h = self._handles.get(ev.rid)
            if h is None or (owners is not None and owners.get(ev.rid) is not h):
                continue
            h.pending += ev.new_tokens
            h.generated = ev.generated_tokens
            if ev.first_token:
                h.first_token_s = now
                self.counters[h.rank].observe_ttft(now - h.created_s)
            if ev.finished:
                self._finish(
                    h, ev.finish_reason or "stop", abort_error if ev.finish_reason == "abort" else None
                )
            elif cut is not None and h.generated >= cut:
                self.engine.abort(h.rid)
                self._finish(h, "abort", f"emulator fault: aborted after {h.generated} tokens")
            else:
                h.wake()

    def _finish(self, h: RequestHandle, reason: str, error: str | None = None) -> None:
        h.done = True
        h.finish_reason = reason
        h.error = error
        self._handles.pop(h.rid, None)
        self.orphans.discard(h.rid)
        self.finished.append(
            {"rid": h.rid, "rank": h.rank, "pinned_rank": h.pinned_rank, "prompt_tokens": h.prompt_tokens,
             "completion_tokens": h.generated, "finish_reason": reason, "preemptions": h.preemptions}
        )  # fmt: skip
        h.wake()

    def _sample_throughput(self, now: float) -> None:
        if self._throughput and now - self._throughput[-1][0] < 1.0:
            return
        self._throughput.append((now, [ld.generation_tokens_total for ld in self.engine.rank_loads()]))

    def gen_throughput(self) -> list[float]:
        """Generated tokens per second per rank over the last few seconds."""
        n = self.engine.config.dp_size
        if len(self._throughput) < 2:
            return [0.0] * n
        (t0, a), (t1, b) = self._throughput[0], self._throughput[-1]
        return [(b[i] - a[i]) / (t1 - t0) for i in range(n)]

    def stats(self) -> dict[str, Any]:
        loads = self.engine.rank_loads()
        return {
            "dp_size": self.engine.config.dp_size,
            "steps": self.engine.steps,
            "engine_clock_s": self.engine.clock_s,
            "preemptions_total": self.engine.preemptions_total,
            "preemptions_per_rank": [ld.preemptions_total for ld in loads],
            "inflight": len(self._handles),
            "orphaned_requests": len(self.orphans),
            "client_disconnects": self.client_disconnects,
            "requests_per_rank": [c.requests_total for c in self.counters],
            "faults": self.faults.to_json(),
        }
