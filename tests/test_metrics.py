"""vLLM-style metric maths: percentiles on raw samples, TPOT, pooled ITL, goodput, the printed block."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.metrics import RequestOutcome, compute_metrics, format_extras, format_summary, stats_ms
from loadtest.workload import Slo


def _outcome(i: int, ttft: float, e2el: float, n: int, start: float = 0.0) -> RequestOutcome:
    gaps = [(e2el - ttft) / (n - 1)] * (n - 1) if n > 1 else []
    return RequestOutcome(
        index=i, success=True, start_s=start, e2el_s=e2el, ttft_s=ttft, itls_s=gaps, prompt_tokens=100,
        output_tokens=n,
    )  # fmt: skip


def test_percentiles_equal_numpy_on_raw_samples() -> None:
    rng = np.random.default_rng(0)
    samples = rng.lognormal(0, 1, size=997).tolist()
    got = stats_ms("ttft", samples, (50, 90, 99, 99.9))
    ms = np.asarray(samples) * 1000
    assert got["mean_ttft_ms"] == np.mean(ms)
    assert got["median_ttft_ms"] == np.median(ms)
    assert got["std_ttft_ms"] == np.std(ms)
    for p, key in ((50, "p50"), (90, "p90"), (99, "p99"), (99.9, "p99.9")):
        assert got[f"{key}_ttft_ms"] == np.percentile(ms, p)
    assert stats_ms("itl", [], (99,))["p99_itl_ms"] == 0.0  # vLLM: empty lists count as 0


def test_tpot_itl_and_throughputs() -> None:
    outs = [
        _outcome(0, ttft=0.1, e2el=1.1, n=11),  # TPOT 100 ms, 10 gaps of 100 ms
        _outcome(1, ttft=0.3, e2el=0.7, n=5, start=0.5),  # TPOT 100 ms
        _outcome(2, ttft=0.2, e2el=0.2, n=1, start=1.0),  # one token: no TPOT sample
        RequestOutcome(index=3, success=False, start_s=1.5, e2el_s=0.01, error_kind="http_503", error="x"),
    ]
    r = compute_metrics(outs, duration_s=2.0)
    assert r["completed"] == 3 and r["failed"] == 1
    assert r["mean_tpot_ms"] == pytest.approx(100.0)
    assert r["p99_tpot_ms"] == pytest.approx(100.0)
    # ITL is pooled: 10 + 4 gaps, all 100 ms.
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["total_output_tokens"] == 17 and r["total_input_tokens"] == 300
    assert r["request_throughput"] == 1.5
    assert r["output_throughput"] == 8.5
    assert r["total_token_throughput"] == 158.5
    assert r["max_concurrent_requests"] == 3  # 0, 1 and 2 overlap at t = 1.0
    assert r["errors_by_kind"] == {"http_503": 1}
    assert r["request_goodput"] is None  # no SLO given: like vLLM without --goodput


def test_goodput_counts_requests_meeting_every_slo() -> None:
    outs = [
        _outcome(0, ttft=0.1, e2el=1.1, n=11),  # ttft 100, tpot 100, e2el 1100
        _outcome(1, ttft=0.6, e2el=1.6, n=11),  # ttft 600 (fails ttft 500)
        _outcome(2, ttft=0.1, e2el=2.1, n=11),  # tpot 200 (fails tpot 150)
        _outcome(3, ttft=0.4, e2el=0.4, n=1),  # one token: tpot 0, meets
    ]
    assert compute_metrics(outs, 4.0, Slo(ttft_ms=500, tpot_ms=150))["request_goodput"] == 0.5
    assert compute_metrics(outs, 4.0, Slo(ttft_ms=500))["good_requests"] == 3
    assert compute_metrics(outs, 4.0, Slo(e2el_ms=1000))["good_requests"] == 1
    assert compute_metrics(outs, 4.0, Slo(tpot_ms=100))["good_requests"] == 3  # <= is good


def test_printed_block_has_vllm_labels_and_format() -> None:
    r = compute_metrics([_outcome(0, 0.1, 1.1, 11)], 1.0, Slo(ttft_ms=500))
    text = format_summary(r, request_rate=4.0, max_concurrency=8)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert f"{'Successful requests:':<40} {1:<10}" in lines
    assert f"{'Request rate configured (RPS):':<40} {4.0:<10.2f}" in lines
    assert f"{'Mean TTFT (ms):':<40} {100.0:<10.2f}" in lines
    for label in (
        "Maximum request concurrency:",
        "Request goodput (req/s):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert "Little's law" in format_extras(r)
