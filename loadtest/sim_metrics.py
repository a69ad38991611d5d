"""What the simulator measures, summarised under vLLM ``benchmark_serving`` key names.

Per request: TTFT, TPOT (``(e2el - ttft) / (output - 1)``), E2EL and goodput against the scenario's SLO.
ITL is estimated without per-token events (the simulator's fast path): every time a rank decodes, each of
its sequences sees one gap, the time since that rank last decoded (a step, or longer when a prefill step
stalled its decoders), weighted by the number of tokens decoded. Over time: KV utilisation, the largest
rank's context (the lockstep cost) and imbalance (max / mean context over ranks), all weighted by step
duration, plus a small per-rank occupancy series for plots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loadtest.engine_types import RankLoad
from loadtest.workload import Slo

MAX_SAMPLES = 240  # occupancy points kept per policy: enough for a plot, small in the JSON


def _stats(name: str, values: list[float], weights: list[float] | None = None) -> dict[str, float]:
    if not values:
        return {
            f"mean_{name}_ms": 0.0,
            f"median_{name}_ms": 0.0,
            f"std_{name}_ms": 0.0,
            f"p99_{name}_ms": 0.0,
        }
    arr = np.asarray(values, dtype=np.float64)
    if weights is None:
        return {
            f"mean_{name}_ms": float(arr.mean()),
            f"median_{name}_ms": float(np.median(arr)),
            f"std_{name}_ms": float(arr.std()),
            f"p99_{name}_ms": float(np.percentile(arr, 99)),
        }
    w = np.asarray(weights, dtype=np.float64)
    order = np.argsort(arr)
    arr, w = arr[order], w[order]
    cdf = np.cumsum(w) / w.sum()
    mean = float(np.average(arr, weights=w))
    return {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": float(arr[min(len(arr) - 1, int(np.searchsorted(cdf, 0.5)))]),
        f"std_{name}_ms": float(np.sqrt(np.average((arr - mean) ** 2, weights=w))),
        f"p99_{name}_ms": float(arr[min(len(arr) - 1, int(np.searchsorted(cdf, 0.99)))]),
    }


class SimMetrics:
    def __init__(self, ranks: int, slo: Slo, sample_every_s: float) -> None:
        self.slo = slo
        self.ranks = ranks
        self.sample_every_s = max(sample_every_s, 1e-9)
        self.ttft_ms: list[float] = []
        self.tpot_ms: list[float] = []
        self.e2el_ms: list[float] = []
        self.good = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.itl_ms: list[float] = []
        self.itl_weight: list[float] = []
        self._last_decode_s = [0.0] * ranks
        self._prev_decoders = [0] * ranks
        self._prev_gen = [0] * ranks
        self.time_s = 0.0
        self.kv_util_s = 0.0
        self.kv_util_max = 0.0
        self.max_context_s = 0.0
        self.peak_context_tokens = 0
        self.imbalance_s = 0.0
        self.imbalance_time_s = 0.0
        self.steps = 0
        self.busy_s = 0.0
        self.samples: dict[str, list[Any]] = {"t_s": [], "used_tokens": [], "context_tokens": []}
        self._next_sample_s = 0.0

    def on_idle(self, dt_s: float) -> None:
        self.time_s += dt_s

    def on_step(self, end_s: float, dt_s: float, loads: list[RankLoad], firsts: list[int]) -> None:
        """After one engine step of ``dt_s`` ending at ``end_s``; ``firsts[r]`` first tokens on rank r."""
        self.steps += 1
        self.busy_s += dt_s
        self.time_s += dt_s
        used = cap = 0
        contexts = []
        for load in loads:
            r = load.rank
            decoded = load.generation_tokens_total - self._prev_gen[r] - firsts[r]
            self._prev_gen[r] = load.generation_tokens_total
            if decoded > 0:
                self.itl_ms.append((end_s - self._last_decode_s[r]) * 1e3)
                self.itl_weight.append(float(decoded))
                self._last_decode_s[r] = end_s
            elif self._prev_decoders[r] == 0 and load.decode_seqs:
                self._last_decode_s[r] = end_s  # new decoders got their first token now
            self._prev_decoders[r] = load.decode_seqs
            used += load.used_tokens
            cap += load.capacity_tokens
            self.kv_util_max = max(self.kv_util_max, load.token_usage)
            contexts.append(load.context_tokens)
        self.kv_util_s += (used / cap if cap else 0.0) * dt_s
        top = max(contexts, default=0)
        self.max_context_s += top * dt_s
        self.peak_context_tokens = max(self.peak_context_tokens, top)
        mean = sum(contexts) / len(contexts) if contexts else 0.0
        if mean > 0:
            self.imbalance_s += top / mean * dt_s
            self.imbalance_time_s += dt_s
        if end_s >= self._next_sample_s:
            self.samples["t_s"].append(round(end_s, 3))
            self.samples["used_tokens"].append([load.used_tokens for load in loads])
            self.samples["context_tokens"].append(contexts)
            self._next_sample_s = end_s + self.sample_every_s

    def on_finish(self, arrival_s: float, first_s: float, end_s: float, prompt: int, output: int) -> None:
        ttft_ms = (first_s - arrival_s) * 1e3
        e2el_ms = (end_s - arrival_s) * 1e3
        self.ttft_ms.append(ttft_ms)
        self.e2el_ms.append(e2el_ms)
        tpot_ms = (e2el_ms - ttft_ms) / (output - 1) if output > 1 else 0.0
        if output > 1:
            self.tpot_ms.append(tpot_ms)
        self.input_tokens += prompt
        self.output_tokens += output
        slo = self.slo
        if (
            (slo.ttft_ms is None or ttft_ms <= slo.ttft_ms)
            and (slo.tpot_ms is None or tpot_ms <= slo.tpot_ms)
            and (slo.e2el_ms is None or e2el_ms <= slo.e2el_ms)
        ):
            self.good += 1

    def summary(self, duration_s: float) -> dict[str, Any]:
        d = max(duration_s, 1e-9)
        busy = max(self.busy_s, 1e-9)
        out: dict[str, Any] = {
            "duration": duration_s,
            "completed": len(self.e2el_ms),
            "total_input_tokens": self.input_tokens,
            "total_output_tokens": self.output_tokens,
            "request_throughput": len(self.e2el_ms) / d,
            "request_goodput": self.good / d,
            "output_throughput": self.output_tokens / d,
            "total_token_throughput": (self.input_tokens + self.output_tokens) / d,
        }
        out |= _stats("ttft", self.ttft_ms)
        out |= _stats("tpot", self.tpot_ms)
        out |= _stats("itl", self.itl_ms, self.itl_weight)
        out |= _stats("e2el", self.e2el_ms)
        out |= {
            "mean_kv_utilisation": self.kv_util_s / max(self.time_s, 1e-9),
            "max_kv_utilisation": self.kv_util_max,
            "imbalance": self.imbalance_s / self.imbalance_time_s if self.imbalance_time_s else 1.0,
            "mean_max_rank_context_tokens": self.max_context_s / busy,
            "peak_rank_context_tokens": self.peak_context_tokens,
            "steps": self.steps,
            "mean_step_ms": self.busy_s / self.steps * 1e3 if self.steps else 0.0,
        }
        return out

    def timeseries(self) -> dict[str, list[Any]]:
        """The occupancy samples, thinned to at most ``MAX_SAMPLES`` points."""
        n = len(self.samples["t_s"])
        stride = max(1, -(-n // MAX_SAMPLES))
        return {k: v[::stride] for k, v in self.samples.items()}
