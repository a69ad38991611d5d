"""Markdown for docs/bench.md: one table per section, every figure a median (min-max) over rounds."""

from __future__ import annotations

from .overhead import DIRECT, OverheadResult
from .placement import PlacementResult
from .relay import NODE_EVENTS_PER_S, OFFERED_EVENTS_PER_S, RelayResult
from .stats import Spread

TARGET_RPS_RATIO = 0.5
TARGET_ADDED_P50_MS = 2.0
TARGET_GOODPUT_RATIO = 1.5


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def overhead_md(res: OverheadResult, kvrouter_label: str, variants: list[str] | None = None) -> list[str]:
    """``variants``: other kvrouter targets (e.g. more workers), each compared with ``kvrouter_label``."""
    lines = ["## 1. Overhead (wrk, fixed 16-token chat answer from nginx)", ""]
    if not res.runs:
        return [*lines, "Skipped: " + "; ".join(res.skipped), ""]
    lines += [
        "| target | c | req/s | added p50 ms | added p99 ms | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for target in res.targets():
        for c in res.concurrencies:
            runs = res.runs.get((target, c), [])
            if not runs:
                continue
            added50 = res.added_ms(target, c, "p50_ms").fmt(2) if target != DIRECT else "-"
            added99 = res.added_ms(target, c, "p99_ms").fmt(2) if target != DIRECT else "-"
            p50 = Spread.of([r.p50_ms for r in runs]).fmt(2)
            p99 = Spread.of([r.p99_ms for r in runs]).fmt(2)
            lines.append(
                f"| {target} | {c} | {res.rps(target, c).fmt()} | {added50} | {added99} | {p50} | {p99} |"
            )
    lines.append("")
    sg = next((t for t in res.targets() if t.startswith("sglang-router")), None)
    for label in [kvrouter_label, *(variants or [])]:
        if sg is None:
            break
        ratio = res.ratio(label, sg, 64)
        added = res.added_ms(label, 8, "p50_ms")
        lines += [
            f"- {label} / {sg} req/s at c=64, paired per round: **{ratio.fmt(2)}** "
            f"(target >= {TARGET_RPS_RATIO}: {_verdict(ratio.median >= TARGET_RPS_RATIO)})",
            f"- {label} added p50 at c=8: **{added.fmt(2)} ms** "
            f"(target <= {TARGET_ADDED_P50_MS} ms: {_verdict(added.median <= TARGET_ADDED_P50_MS)})",
        ]
    for variant in variants or []:
        for c in res.concurrencies:
            paired = res.ratio(variant, kvrouter_label, c).fmt(2)
            base_ms = res.added_ms(kvrouter_label, c, "p50_ms").fmt(2)
            lines.append(
                f"- {variant} / {kvrouter_label} req/s at c={c}, paired per round: **{paired}**; "
                f"added p50 {res.added_ms(variant, c, 'p50_ms').fmt(2)} vs {base_ms} ms"
            )
    if res.skipped:
        lines.append("- skipped: " + "; ".join(res.skipped))
    return [*lines, ""]


def relay_md(res: RelayResult, kvrouter_labels: list[str]) -> list[str]:
    lines = [
        "## 2. Streaming relay (lockstep SSE upstream, one event per stream per step)", "",
        f"Offered {OFFERED_EVENTS_PER_S:,.0f} events/s; steady rate between 10 % and 90 % of all events.", "",
        "| streams | via | direct events/s | via events/s | relay / direct | nodes fronted (30k ev/s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for streams in sorted({s for _, s in res.runs}):
        direct = res.rate("direct", streams)
        for label in kvrouter_labels:
            if (label, streams) not in res.runs:
                continue
            via = res.rate(label, streams)
            pairs = zip(res.runs[(label, streams)], res.runs.get(("direct", streams), []), strict=False)
            ratio = Spread.of([v["steady_events_per_s"] / d["steady_events_per_s"] for v, d in pairs])
            nodes = via.median / NODE_EVENTS_PER_S
            lines.append(
                f"| {streams} | {label} | {direct.fmt()} | {via.fmt()} | {ratio.fmt(2)} | {nodes:.2f} |"
            )
    if res.skipped:
        lines.append("\nSkipped: " + "; ".join(res.skipped))
    return [*lines, ""]


def placement_md(res: PlacementResult) -> list[str]:
    cfg = res.config
    lines = [
        "## 3. Placement quality (live emulator, long-context-mix)", "",
        f"Emulated 8-rank DeepSeek-V3 node, KV pools x{cfg.capacity_scale:g} of the plan, engine at "
        f"{cfg.time_scale:g} x real time (scenario compressed to match; figures below in engine time), "
        f"{cfg.duration_s:g} s of arrivals, seeds {', '.join(map(str, cfg.seeds))} x {cfg.rounds} round(s); "
        "the first table pools every run.", "",
        "| router (policy) | goodput req/s | p99 TTFT s | p50 TTFT s | p50 TPOT ms | preempt | done | fail |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for label in res.runs:
        m = res.metric
        lines.append(
            f"| {label} | {m(label, 'request_goodput').fmt(3)} | {m(label, 'p99_ttft_s').fmt(1)} | "
            f"{m(label, 'median_ttft_s').fmt(1)} | {m(label, 'median_tpot_ms').fmt()} | "
            f"{m(label, 'preemptions').fmt()} | {m(label, 'completed').fmt()} | {m(label, 'failed').fmt()} |"
        )
    ours = [lb for lb in res.runs if lb.startswith("kvrouter")]
    peers = [lb for lb in res.runs if lb.startswith("sglang-router")]
    if ours and peers:
        best_ours = max(ours, key=lambda lb: res.metric(lb, "request_goodput").median)
        best_peer = max(peers, key=lambda lb: res.metric(lb, "request_goodput").median)
        pooled = res.metric(best_ours, "request_goodput").median / max(
            res.metric(best_peer, "request_goodput").median, 1e-9
        )
        per_seed = res.goodput_ratios(best_ours, peers)
        ratio = Spread.of(list(per_seed.values()))
        pre = res.metric(best_ours, "preemptions").high
        lines += ["", "Goodput req/s per workload seed (median over its rounds):", "",
                  "| seed | " + " | ".join(res.runs) + f" | {best_ours} / best peer that seed |",
                  "|---:|" + "---:|" * (len(res.runs) + 1)]  # fmt: skip
        for seed, r in per_seed.items():
            cells = " | ".join(res.metric(lb, "request_goodput", seed).fmt(3) for lb in res.runs)
            lines.append(f"| {seed} | {cells} | {r:.2f}x |")
        verdict = _verdict(ratio.median >= TARGET_GOODPUT_RATIO)
        lines += ["", f"- {best_ours} / best sglang-router policy on the same seed, median over seeds: "
                  f"**{ratio.fmt(2)}x** (target >= {TARGET_GOODPUT_RATIO}: {verdict}); pooled medians "
                  f"{best_ours} / {best_peer}: {pooled:.2f}x; most preemptions behind {best_ours} "
                  f"in any run: {pre:.0f}"]  # fmt: skip
    if res.skipped:
        lines.append("- skipped: " + "; ".join(res.skipped))
    return [*lines, ""]
