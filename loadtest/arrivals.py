"""Open-loop arrival times, with vLLM's convention (``vllm bench serve``).

Gaps are ``gamma(shape=burstiness, scale=1/(rate*burstiness))``: mean ``1/rate`` whatever the
burstiness, coefficient of variation ``1/sqrt(burstiness)``. Burstiness 1 is Poisson; below 1 is
burstier; ``constant`` sends evenly spaced requests. With a request count (and no duration) the gaps are
rescaled so the last request arrives at ``(N-1)/rate`` exactly (vLLM rescales the same way, so the
realised rate equals the asked one); with a duration the process
runs until the duration (and the count, if both are given) is reached, without rescaling.
The first request is sent at t = 0. ``rate_rps: .inf`` sends every request at t = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loadtest.scenario_yaml import Fields

PROCESSES = ("poisson", "gamma", "constant")
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Arrival:
    process: str = "poisson"
    rate_rps: float = 1.0
    burstiness: float = 1.0

    def gaps_s(self, rng: np.random.Generator, n: int) -> FloatArray:
        if math.isinf(self.rate_rps):
            return np.zeros(n)
        if self.process == "constant":
            return np.full(n, 1.0 / self.rate_rps)
        shape = 1.0 if self.process == "poisson" else self.burstiness
        return rng.gamma(shape, 1.0 / (self.rate_rps * shape), size=n)


def arrival_times_s(
    arrival: Arrival, rng: np.random.Generator, duration_s: float | None, requests: int | None
) -> FloatArray:
    """Arrival offsets in seconds (first at 0), bounded by ``duration_s`` and/or ``requests``."""
    if requests is not None and duration_s is None:
        gaps = arrival.gaps_s(rng, requests)
        times = np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if requests else np.zeros(0)
        total = float(times[-1]) if requests > 1 else 0.0
        if total > 0 and not math.isinf(arrival.rate_rps):
            # vLLM: scale the schedule so the realised rate equals the asked one exactly.
            times *= ((requests - 1) / arrival.rate_rps) / total
        return times
    assert duration_s is not None
    if math.isinf(arrival.rate_rps):
        return np.zeros(requests if requests is not None else 0)
    expected = arrival.rate_rps * duration_s
    chunk = int(expected + 6.0 * math.sqrt(expected / max(arrival.burstiness, 1e-3)) + 16)
    parts: list[FloatArray] = []
    t0 = 0.0
    while True:
        gaps = arrival.gaps_s(rng, chunk)
        times = t0 + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        parts.append(times[times < duration_s])
        if times[-1] >= duration_s:
            break
        t0 = float(times[-1] + gaps[-1])
    out = np.concatenate(parts)
    return out[:requests] if requests is not None else out


def parse_arrival(f: Fields) -> Arrival:
    n = f.mapping("arrival", required=True)
    assert n is not None
    n.check_keys({"process", "rate_rps", "burstiness"})
    process = n.text("process", default="poisson", choices=PROCESSES) or "poisson"
    rate = n.number("rate_rps", required=True, positive=True, allow_inf=True)
    burst = n.number("burstiness", default=1.0, positive=True)
    if n.has("burstiness") and process != "gamma":
        raise n.error("burstiness", f"only applies to process: gamma (got process: {process})")
    return Arrival(process=process, rate_rps=float(rate or 1.0), burstiness=float(burst or 1.0))
