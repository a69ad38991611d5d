"""Policy comparison reports: one Markdown table and matplotlib PNGs (Agg backend, small files).

Input is a results document ``{"scenario": ..., "results": {POLICY: {...vLLM keys...}}}`` as written by
``kvrouter-loadtest sim`` or ``compare``. Optional parts, drawn when present:

- per policy ``timeseries``: ``{"t_s": [...], "used_tokens": [[per rank], ...]}`` -> occupancy.png
- per policy TTFT samples (``ttft_samples_ms``, or vLLM's detailed ``ttfts`` in seconds) -> ttft_cdf.png;
  without samples the CDF is drawn through the reported percentiles (marked as such)
- ``sweep``: ``{"rates_rps": [...], "results": {POLICY: [{"request_goodput", ...}, ...]}}`` ->
  goodput_vs_rate.png
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DPI = 80
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("completed", "done", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("preemptions", "preempt", "{:.0f}"),
    ("request_throughput", "req/s", "{:.2f}"),
    ("request_goodput", "goodput req/s", "{:.2f}"),
    ("output_throughput", "out tok/s", "{:.0f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.1f}"),
    ("p99_tpot_ms", "p99 TPOT ms", "{:.1f}"),
    ("p99_itl_ms", "p99 ITL ms", "{:.1f}"),
    ("mean_kv_utilisation", "mean KV use", "{:.0%}"),
    ("imbalance", "max/mean ctx", "{:.2f}"),
)


def _fmt(value: Any, pattern: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int | float):
        return pattern.format(value)
    return str(value)


def markdown_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per policy; columns missing from every policy are left out."""
    cols = [c for c in COLUMNS if any(c[0] in r for r in results.values())]
    head = "| policy | " + " | ".join(c[1] for c in cols) + " |"
    sep = "|---|" + "---:|" * len(cols)
    rows = [
        f"| {name} | " + " | ".join(_fmt(r.get(key), pat) for key, _, pat in cols) + " |"
        for name, r in results.items()
    ]
    return "\n".join([head, sep, *rows])


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_occupancy(
    results: Mapping[str, Mapping[str, Any]], path: Path, capacity_tokens: float | None = None
) -> bool:
    """Per-rank KV tokens in use over time, one panel per policy; dashed: the per-rank pool."""
    series = {k: r["timeseries"] for k, r in results.items() if r.get("timeseries", {}).get("t_s")}
    if not series:
        return False
    plt = _pyplot()
    cols = min(3, len(series))
    rows = -(-len(series) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 2.8 * rows), sharex=True, sharey=True, squeeze=False
    )
    for ax, (name, ts) in zip(axes.flat, series.items(), strict=False):
        t = np.asarray(ts["t_s"], dtype=float)
        used = np.asarray(ts["used_tokens"], dtype=float)
        if used.ndim == 2:
            for rank in range(used.shape[1]):
                ax.plot(t, used[:, rank] / 1e3, lw=0.8)
        cap = ts.get("capacity_tokens") or capacity_tokens
        if cap:
            ax.axhline(float(np.max(cap)) / 1e3, color="k", ls="--", lw=0.8)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(series) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("time (s)")
    for ax in axes[:, 0]:
        ax.set_ylabel("KV in use (k tokens)")
    fig.suptitle("Per-rank KV occupancy (one line per rank)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def ttft_samples_ms(result: Mapping[str, Any]) -> tuple[np.ndarray[Any, Any] | None, bool]:
    """(samples or percentile points in ms, exact?) for a TTFT CDF."""
    if result.get("ttft_samples_ms"):
        return np.sort(np.asarray(result["ttft_samples_ms"], dtype=float)), True
    if result.get("ttfts"):
        return np.sort(np.asarray(result["ttfts"], dtype=float) * 1e3), True
    return None, False


def plot_ttft_cdf(results: Mapping[str, Mapping[str, Any]], path: Path) -> bool:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    drawn = False
    approx = False
    for name, r in results.items():
        samples, exact = ttft_samples_ms(r)
        if exact and samples is not None and len(samples):
            ax.plot(samples, np.arange(1, len(samples) + 1) / len(samples), label=name, lw=1.2)
            drawn = True
            continue
        points = [
            (r[f"{k}_ttft_ms"], q)
            for k, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99))
            if f"{k}_ttft_ms" in r
        ]
        if points:
            xs, qs = zip(*points, strict=True)
            ax.plot(xs, qs, marker="o", ls="--", label=f"{name} (percentiles)", lw=1.0)
            drawn = approx = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF" + (" (dashed: through reported percentiles)" if approx else ""), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_goodput_sweep(sweep: Mapping[str, Any], path: Path) -> bool:
    rates: Sequence[float] = sweep.get("rates_rps") or []
    per_policy: Mapping[str, Sequence[Mapping[str, Any]]] = sweep.get("results") or {}
    if not rates or not per_policy:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, runs in per_policy.items():
        ys = [float(run.get("request_goodput") or 0.0) for run in runs]
        ax.plot(rates[: len(ys)], ys, marker="o", label=name, lw=1.2)
    ax.plot(rates, rates, color="k", ls=":", lw=0.8, label="offered")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting every SLO)")
    ax.set_title("Goodput against offered rate", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def write_report(doc: Mapping[str, Any], out_dir: Path, notes: str = "") -> Path:
    """Render ``doc`` into ``out_dir/report.md`` plus PNGs; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: Mapping[str, Mapping[str, Any]] = doc.get("results") or {}
    scenario = doc.get("scenario", "?")
    name = scenario if isinstance(scenario, str) else scenario.get("name", "?")
    lines = [f"# Policy comparison: {name}", ""]
    cfg = doc.get("config")
    capacity = cfg.get("kv_tokens_per_rank") if isinstance(cfg, dict) else None
    if cfg:
        lines += ["Setup: " + ", ".join(f"{k}={v}" for k, v in cfg.items()), ""]
    if notes:
        lines += [notes.strip(), ""]
    lines += [markdown_table(results), ""]
    lines += [
        "TTFT = time to first token; TPOT = (E2EL - TTFT)/(output - 1) per request; ITL = pooled gaps "
        "between tokens (vLLM definitions); goodput = requests meeting every SLO per second; max/mean ctx = "
        "the largest rank's context over the mean (the lockstep cost of imbalance), time-weighted.",
        "",
    ]
    figures = (
        (
            "occupancy.png",
            "Per-rank KV occupancy over time",
            plot_occupancy(results, out_dir / "occupancy.png", capacity),
        ),
        ("ttft_cdf.png", "TTFT CDF", plot_ttft_cdf(results, out_dir / "ttft_cdf.png")),
        (
            "goodput_vs_rate.png",
            "Goodput against offered rate",
            plot_goodput_sweep(doc.get("sweep") or {}, out_dir / "goodput_vs_rate.png"),
        ),
    )
    for file, title, ok in figures:
        if ok:
            lines += [f"## {title}", "", f"![{title}]({file})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
