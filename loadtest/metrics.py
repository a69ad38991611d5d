"""Benchmark metrics with vLLM's definitions and key names (``vllm bench serve``), so numbers compare.

- TTFT: send to first streamed token. E2EL: send to last byte, at the client.
- TPOT = (E2EL - TTFT) / (output_len - 1), per request with output_len > 1 (vLLM counts TPOT 0 for
  one-token answers when judging goodput). This is what AIPerf and guidellm call "ITL".
- ITL: every gap between streamed chunks, pooled over all requests into one list.
- Percentiles: ``numpy.percentile`` (linear) over the raw samples; mean/median/std likewise (std is
  numpy's population std). Empty lists give 0, as vLLM.
- request_goodput: requests meeting every SLO given, divided by the benchmark duration.
- Concurrency, two ways (tooling note A.6): ``max_concurrent_requests`` (a sweep line, vLLM's "Peak
  concurrent requests") and ``littles_law_concurrency`` = sum(E2EL) / duration (SGLang's "Concurrency").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtest.workload import Slo

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass(slots=True)
class RequestOutcome:
    """What the client saw of one request. Times in seconds; ``start_s`` from the benchmark start."""

    index: int
    success: bool
    start_s: float
    e2el_s: float = 0.0
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error_kind: str = ""
    error: str = ""
    queue_s: float = 0.0  # waiting for a --max-concurrency slot before sending


def p_word(p: float) -> str:
    """vLLM's percentile label: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def stats_ms(name: str, samples_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/std/pN keys in milliseconds for one metric, exactly as vLLM computes them."""
    arr = np.asarray(samples_s, dtype=np.float64) * 1000.0 if len(samples_s) else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in percentiles:
        out[f"p{p_word(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def length_stats(values: Sequence[int]) -> dict[str, float]:
    """The realised length distribution (tooling note A.6.2: print what was actually sent)."""
    arr = np.asarray(values, dtype=np.float64) if len(values) else np.zeros(1)
    return {
        "mean": float(arr.mean()),
        "min": float(arr.min()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def tpot_s(o: RequestOutcome) -> float | None:
    return (o.e2el_s - o.ttft_s) / (o.output_tokens - 1) if o.output_tokens > 1 else None


def is_good(o: RequestOutcome, slo: Slo) -> bool:
    """vLLM's goodput rule: every SLO given is met (a one-token answer counts TPOT as 0)."""
    checks = (
        (slo.ttft_ms, o.ttft_s),
        (slo.tpot_ms, tpot_s(o) or 0.0),
        (slo.e2el_ms, o.e2el_s),
    )
    return o.success and all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def peak_output_tokens_per_s(outcomes: Sequence[RequestOutcome]) -> float:
    """Most tokens streamed in any one-second bucket (vLLM's "Peak output token throughput")."""
    stamps: list[float] = []
    for o in outcomes:
        if o.success and o.output_tokens:
            first = o.start_s + o.ttft_s
            stamps.append(first)
            stamps.extend((first + np.cumsum(o.itls_s)).tolist())
    if not stamps:
        return 0.0
    return float(np.bincount(np.floor(np.asarray(stamps)).astype(np.int64)).max())


def peak_concurrency(outcomes: Sequence[RequestOutcome]) -> int:
    """Most requests in flight at once (a sweep over start and end events)."""
    events = sorted(
        [(o.start_s, 1) for o in outcomes] + [(o.start_s + o.e2el_s, -1) for o in outcomes],
        key=lambda e: (e[0], e[1]),
    )
    best = cur = 0
    for _, step in events:
        cur += step
        best = max(best, cur)
    return best


def compute_metrics(
    outcomes: Sequence[RequestOutcome],
    duration_s: float,
    slo: Slo | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The results dict, keyed as vLLM's ``--save-result`` JSON plus our extras."""
    ok = [o for o in outcomes if o.success]
    slo = slo or Slo()
    duration_s = max(duration_s, 1e-9)
    total_in = sum(o.prompt_tokens for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [t for o in ok if (t := tpot_s(o)) is not None]
    itls = [gap for o in ok for gap in o.itls_s]
    has_slo = any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms))
    good = sum(1 for o in ok if is_good(o, slo)) if has_slo else None
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (good / duration_s) if good is not None else None,
        "good_requests": good,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_output_tokens_per_s(ok),
        "max_concurrent_requests": peak_concurrency(outcomes),
        "littles_law_concurrency": sum(o.e2el_s for o in outcomes) / duration_s,
    }
    result.update(stats_ms("ttft", [o.ttft_s for o in ok], percentiles))
    result.update(stats_ms("tpot", tpots, percentiles))
    result.update(stats_ms("itl", itls, percentiles))
    result.update(stats_ms("e2el", [o.e2el_s for o in ok], percentiles))
    if any(o.queue_s for o in outcomes):
        result.update(stats_ms("client_queue_time", [o.queue_s for o in outcomes], percentiles))
    result["input_len_stats"] = length_stats([o.prompt_tokens for o in ok])
    result["output_len_stats"] = length_stats([o.output_tokens for o in ok])
    result["errors_by_kind"] = dict(Counter(o.error_kind or "unknown" for o in outcomes if not o.success))
    result["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms}
    return result


def detailed(outcomes: Sequence[RequestOutcome]) -> dict[str, list[Any]]:
    """vLLM's ``--save-detailed`` per-request arrays (seconds, as vLLM stores them)."""
    return {
        "input_lens": [o.prompt_tokens for o in outcomes],
        "output_lens": [o.output_tokens if o.success else 0 for o in outcomes],
        "ttfts": [o.ttft_s if o.success else 0.0 for o in outcomes],
        "itls": [list(o.itls_s) for o in outcomes],
        "latencies": [o.e2el_s for o in outcomes],
        "start_times": [o.start_s for o in outcomes],
        "errors": [o.error for o in outcomes],
    }


def _line(label: str, value: object, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def format_summary(
    result: dict[str, Any],
    *,
    request_rate: float | None = None,
    max_concurrency: int | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> str:
    """The printed block, with vLLM's labels and column format (``{:<40} {:<10.2f}``)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(_line("Successful requests:", result["completed"]))
    lines.append(_line("Failed requests:", result["failed"]))
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate is not None and request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    lines.append(_line("Benchmark duration (s):", result["duration"], ".2f"))
    lines.append(_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_line("Request throughput (req/s):", result["request_throughput"], ".2f"))
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"], ".2f"))
    lines.append(_line("Output token throughput (tok/s):", result["output_throughput"], ".2f"))
    lines.append(_line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f"))
    lines.append(_line("Peak concurrent requests:", float(result["max_concurrent_requests"]), ".2f"))
    lines.append(_line("Total token throughput (tok/s):", result["total_token_throughput"], ".2f"))
    for key, label, header in SECTIONS:
        if f"mean_{key}_ms" not in result:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_line(f"Mean {label} (ms):", result[f"mean_{key}_ms"], ".2f"))
        lines.append(_line(f"Median {label} (ms):", result[f"median_{key}_ms"], ".2f"))
        for p in percentiles:
            value = result.get(f"p{p_word(p)}_{key}_ms")
            if value is not None:
                lines.append(_line(f"P{p_word(p)} {label} (ms):", value, ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_extras(result: dict[str, Any]) -> str:
    """Our additions below vLLM's block: concurrency by Little's law, realised lengths, errors."""
    lines = [_line("Concurrency (Little's law, sum E2EL/T):", result["littles_law_concurrency"], ".2f")]
    for key, label in (("input_len_stats", "Input"), ("output_len_stats", "Output")):
        s = result[key]
        lines.append(
            f"{label} tokens realised: mean {s['mean']:.0f}, p50 {s['p50']:.0f}, p90 {s['p90']:.0f}, "
            f"p99 {s['p99']:.0f}, min {s['min']:.0f}, max {s['max']:.0f}"
        )
    if result["errors_by_kind"]:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(result["errors_by_kind"].items()))
        lines.append(f"Errors by kind: {kinds}")
    return "\n".join(lines)
