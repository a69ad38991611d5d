"""router/telemetry_text.py writes the same samples as prometheus_client's generate_latest, minus
``*_created``, and the result parses (library parser, promtool)."""

from __future__ import annotations

import math
import subprocess

from observability_support import parse, promtool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from router.telemetry_text import format_value, render_text


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    c = Counter("t_requests", "Requests\nwith a newline and a \\ backslash", ["route", "code"], registry=r)
    c.labels("/v1/x", "200").inc(3)
    c.labels('we"ird\\path\nline', "500").inc()
    Gauge("t_depth", "Depth", registry=r).set(float("nan"))
    g = Gauge("t_used_tokens", "Used", ["rank"], registry=r)
    g.labels("0").set(1e20)
    g.labels("1").set(float("-inf"))
    h = Histogram("t_latency_seconds", "Latency", ["route"], buckets=(0.001, 0.5, 60.0), registry=r)
    for v in (0.0005, 0.2, 0.2, 100.0):
        h.labels("/a").observe(v)
    Info("t_build", "Build", registry=r).info({"version": "1.2.3"})
    return r


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_same_samples_as_generate_latest_without_created() -> None:
    r = _registry()
    ours = parse(render_text(r).decode())
    theirs = {k: v for k, v in parse(generate_latest(r).decode()).items() if not k[0].endswith("_created")}
    assert ours.keys() == theirs.keys()
    assert all(_same(ours[k], theirs[k]) for k in ours)
    assert not any(name.endswith("_created") for name, _ in ours)


def test_type_lines_and_values() -> None:
    text = render_text(_registry()).decode()
    assert "# TYPE t_requests_total counter\n" in text
    assert "# TYPE t_build_info gauge\n" in text
    assert "# HELP t_requests_total Requests\\nwith a newline and a \\\\ backslash\n" in text
    assert 't_latency_seconds_bucket{route="/a",le="+Inf"} 4.0\n' in text
    assert [format_value(v) for v in (1.0, float("inf"), float("-inf"), 0.25)] == [
        "1.0",
        "+Inf",
        "-Inf",
        "0.25",
    ]
    assert format_value(float("nan")) == "NaN"


def test_promtool_accepts_it() -> None:
    proc = subprocess.run(
        [promtool(), "check", "metrics"], input=render_text(_registry()), capture_output=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
