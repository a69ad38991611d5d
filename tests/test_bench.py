"""The bench's own parts: wrk output parsing, the steady-rate window, nginx config, and a live SSE round trip
(lockstep upstream → raw client) on loopback."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
import pytest

from loadtest.bench.procs import Proc, free_port
from loadtest.bench.sse_client import run as run_client
from loadtest.bench.sse_client import steady_rate
from loadtest.bench.stats import Spread
from loadtest.bench.upstream import Payloads, nginx_conf
from loadtest.bench.wrk import WrkError, parse

WRK_OUTPUT = """Running 3s test @ http://127.0.0.1:8080/v1/chat/completions
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    10.53ms    3.11ms  41.00ms   80.00%
  Latency Distribution
     50%  950.00us
     75%   12.00ms
     90%   14.00ms
     99%    1.20s
  3000 requests in 3.00s, 1.50MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:   1000.50
Transfer/sec:    512.00KB
"""


def test_wrk_parse_converts_units_and_counts_errors() -> None:
    res = parse(WRK_OUTPUT)
    assert res.requests_per_s == pytest.approx(1000.5)
    assert res.p50_ms == pytest.approx(0.95)
    assert res.p99_ms == pytest.approx(1200.0)
    assert res.requests == 3000
    assert res.errors == 7


def test_wrk_parse_refuses_garbage() -> None:
    with pytest.raises(WrkError):
        parse("unable to connect to 127.0.0.1:1 Connection refused")


def test_steady_rate_leaves_setup_out() -> None:
    # 1 s of setup with nothing, then 1,000 events/s for 10 s
    samples = [(t / 10, 0) for t in range(10)] + [(1 + t / 10, 100 * t) for t in range(101)]
    assert steady_rate(samples) == pytest.approx(1000.0)
    assert steady_rate([(0.0, 0)]) != steady_rate([(0.0, 0)])  # nan: nothing to measure


def test_spread_formats_median_and_range() -> None:
    assert Spread.of([3.0, 1.0, 2.0]).fmt(1) == "2.0 (1.0-3.0)"
    assert Spread.of([]).fmt() == "n/a"


def test_nginx_conf_posts_by_return_and_gets_from_files(tmp_path: Path) -> None:
    bodies = {"/v1/chat/completions": b'{"it\'s":1}', "/server_info": b'{"dp_size":8}' * 500}
    conf = nginx_conf(Payloads(bodies, "m"), 8080, tmp_path)
    assert (
        "location = /v1/chat/completions { default_type application/json; return 200 '{\"it\\'s\":1}'; }"
        in conf
    )
    assert (tmp_path / "server_info.json").read_bytes() == bodies["/server_info"]  # > 4 KiB: a file
    with pytest.raises(ValueError, match="variable"):
        nginx_conf(Payloads({"/v1/completions": b'{"a":"$x"}'}, "m"), 8080, tmp_path)


def test_sse_upstream_and_client_round_trip(tmp_path: Path) -> None:
    static = tmp_path / "static.json"
    static.write_bytes(orjson.dumps({"/v1/models": '{"data":[]}'}))
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.bench.sse_upstream", "--port", str(port), "--step-ms", "1",
            "--static", str(static)]  # fmt: skip
    with Proc("sse-upstream-test", argv, ready_url=f"http://127.0.0.1:{port}/v1/models", log_dir=tmp_path):
        out = asyncio.run(run_client(f"http://127.0.0.1:{port}", 10, 20, "m", timeout_s=20))
    assert out["completed"] == 10 and out["failed"] == 0
    assert out["events"] == 10 * 21  # 20 tokens and the usage chunk


def test_placement_ratios_are_paired_per_seed_against_that_seeds_best_peer() -> None:
    from loadtest.bench.placement import PlacementConfig, PlacementResult
    from loadtest.bench.report import placement_md

    res = PlacementResult(PlacementConfig(seeds=(7, 8)))
    runs = {  # (seed, goodput): on seed 7 one peer policy is lucky, on seed 8 the other one leads
        "kvrouter (lockstep)": [(7, 0.20), (8, 0.08)],
        "sglang-router (cache_aware)": [(7, 0.25), (8, 0.01)],
        "sglang-router (round_robin)": [(7, 0.10), (8, 0.04)],
    }
    for label, points in runs.items():
        res.runs[label] = [{"seed": float(s), "request_goodput": g, "preemptions": 0.0} for s, g in points]
    ratios = res.goodput_ratios(
        "kvrouter (lockstep)", ["sglang-router (cache_aware)", "sglang-router (round_robin)"]
    )
    assert ratios == pytest.approx({7: 0.20 / 0.25, 8: 0.08 / 0.04})
    text = "\n".join(placement_md(res))
    assert "| 7 | 0.200 | 0.250 | 0.100 | 0.80x |" in text
    assert "**1.40 (0.80-2.00)x** (target >= 1.5: MISSED)" in text  # the median over seeds decides
