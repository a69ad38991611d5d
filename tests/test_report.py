"""Report rendering: Markdown table and PNG plots from a results document; `compare --from`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from typer.testing import CliRunner

from loadtest.cli import app as cli_app
from loadtest.report import markdown_table, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _policy(seed: int, ttft_scale: float, with_samples: bool) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ttfts = np.sort(rng.lognormal(np.log(ttft_scale), 0.5, 200))
    t = np.arange(0, 60, 1.0)
    used = [[int(1e5 * (1 + np.sin(x / 10 + r))) for r in range(8)] for x in t]
    r: dict[str, Any] = {
        "completed": 190, "failed": 10, "preemptions": seed, "request_throughput": 3.2,
        "request_goodput": 2.5, "output_throughput": 900.0, "mean_ttft_ms": float(ttfts.mean()),
        "p99_ttft_ms": float(np.percentile(ttfts, 99)),
        "median_ttft_ms": float(np.median(ttfts)), "p90_ttft_ms": float(np.percentile(ttfts, 90)),
        "mean_tpot_ms": 40.0, "p99_tpot_ms": 80.0, "p99_itl_ms": 90.0, "mean_kv_utilisation": 0.42,
        "imbalance": 1.3, "timeseries": {"t_s": t.tolist(), "used_tokens": used},
    }  # fmt: skip
    if with_samples:
        r["ttft_samples_ms"] = ttfts.tolist()
    return r


def _doc() -> dict[str, Any]:
    return {
        "scenario": "long-context-mix",
        "config": {"engine": "sglang", "dp_size": 8},
        "results": {"lockstep": _policy(1, 300, True), "round_robin": _policy(2, 900, False)},
        "sweep": {
            "rates_rps": [0.5, 1.0, 1.5],
            "results": {
                "lockstep": [{"request_goodput": 0.5}, {"request_goodput": 0.9}, {"request_goodput": 1.0}],
                "round_robin": [{"request_goodput": 0.5}, {"request_goodput": 0.7}, {"request_goodput": 0.4}],
            },
        },
    }


def test_markdown_table_rows_and_formats() -> None:
    table = markdown_table(_doc()["results"])
    lines = table.splitlines()
    assert lines[0].startswith("| policy | done | failed | preempt | req/s | goodput req/s |")
    assert len(lines) == 4
    assert lines[2].startswith("| lockstep | 190 | 10 | 1 | 3.20 | 2.50 | 900 |")
    assert "42%" in lines[2]


def test_write_report_makes_pngs_and_markdown(tmp_path: Path) -> None:
    md = write_report(_doc(), tmp_path, notes="What it shows.")
    text = md.read_text()
    assert "| lockstep |" in text and "| round_robin |" in text and "What it shows." in text
    for name in ("occupancy.png", "ttft_cdf.png", "goodput_vs_rate.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and 2_000 < len(data) < 400_000, name
        assert f"]({name})" in text


def test_report_without_optional_parts(tmp_path: Path) -> None:
    doc = {"scenario": "x", "results": {"a": {"completed": 1, "mean_ttft_ms": 5.0}}}
    text = write_report(doc, tmp_path).read_text()
    assert "| a | 1 |" in text
    assert not (tmp_path / "occupancy.png").exists() and not (tmp_path / "goodput_vs_rate.png").exists()


def test_compare_from_results_file(tmp_path: Path) -> None:
    src = tmp_path / "sim.json"
    src.write_text(json.dumps(_doc()))
    res = CliRunner().invoke(cli_app, ["compare", "--from", str(src), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "report.md").exists() and (tmp_path / "rep" / "occupancy.png").exists()
    src.write_text("[1, 2]")
    res = CliRunner().invoke(cli_app, ["compare", "--from", str(src), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2 and "expected" in res.output
    res = CliRunner().invoke(cli_app, ["compare", "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2
