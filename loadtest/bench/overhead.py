"""Section 1: router overhead against a zero-cost upstream (nginx), with wrk, rounds interleaved.

Every router runs at once in front of the same nginx; each round measures every target at every
concurrency back to back, so a round's ratios (router vs direct, kvrouter vs sglang-router) share the
same machine noise. Figures are medians over rounds with the min-max spread.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .procs import ProcError
from .routers import RouterSpec, router_proc
from .stats import Spread
from .tools import Tools, warn
from .upstream import Payloads, nginx_proc
from .wrk import WrkError, WrkResult, run_wrk

DIRECT = "direct (nginx)"
CONCURRENCIES = (8, 64)


@dataclass
class OverheadResult:
    concurrencies: tuple[int, ...]
    runs: dict[tuple[str, int], list[WrkResult]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def rps(self, target: str, c: int) -> Spread:
        return Spread.of([r.requests_per_s for r in self.runs.get((target, c), [])])

    def added_ms(self, target: str, c: int, pct: str) -> Spread:
        """Router pXX minus direct pXX, paired round by round."""
        pairs = zip(self.runs.get((target, c), []), self.runs.get((DIRECT, c), []), strict=False)
        return Spread.of([getattr(r, pct) - getattr(d, pct) for r, d in pairs])

    def ratio(self, a: str, b: str, c: int) -> Spread:
        pairs = zip(self.runs.get((a, c), []), self.runs.get((b, c), []), strict=False)
        return Spread.of([x.requests_per_s / y.requests_per_s for x, y in pairs if y.requests_per_s > 0])

    def targets(self) -> list[str]:
        return list(dict.fromkeys(t for t, _ in self.runs))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"skipped": self.skipped, "points": []}
        for (target, c), runs in self.runs.items():
            out["points"].append({
                "target": target, "concurrency": c, "requests_per_s": self.rps(target, c).to_json(),
                "added_p50_ms": self.added_ms(target, c, "p50_ms").to_json(),
                "added_p99_ms": self.added_ms(target, c, "p99_ms").to_json(),
                "errors": sum(r.errors for r in runs),
            })  # fmt: skip
        return out


def default_specs(tools: Tools, kvrouter_specs: list[RouterSpec]) -> list[tuple[RouterSpec, str | None]]:
    specs: list[tuple[RouterSpec, str | None]] = [(s, None) for s in kvrouter_specs]
    specs.append((RouterSpec("sglang-router", "round_robin"), tools.sglang_router))
    specs.append((RouterSpec("vllm-router", "round_robin"), tools.vllm_router))
    return specs


def run_overhead(
    tools: Tools,
    payloads: Payloads,
    kvrouter_specs: list[RouterSpec],
    *,
    rounds: int,
    duration_s: float,
    log_dir: Path,
) -> OverheadResult:
    result = OverheadResult(CONCURRENCIES)
    if tools.nginx is None or tools.wrk is None:
        result.skipped.append("whole section: nginx or wrk missing")
        warn("overhead section skipped: needs nginx and wrk")
        return result
    nginx, upstream = nginx_proc(tools.nginx, payloads, log_dir)
    with nginx, contextlib.ExitStack() as stack:
        targets: dict[str, str] = {DIRECT: upstream}
        for spec, peer_bin in default_specs(tools, kvrouter_specs):
            if spec.kind != "kvrouter" and peer_bin is None:
                result.skipped.append(f"{spec.label}: not installed")
                continue
            try:
                proc, url = router_proc(spec, upstream, log_dir, peer_bin)
                stack.enter_context(proc)
            except (ProcError, ValueError) as exc:
                result.skipped.append(f"{spec.label}: {exc}")
                warn(f"{spec.label} skipped: {exc}")
                continue
            targets[spec.label] = url
        body = payloads.chat_request()
        for i in range(rounds):
            for c in CONCURRENCIES:
                for name, url in targets.items():
                    _measure(result, tools.wrk, name, url, body, c, duration_s)
            print(f"bench: overhead round {i + 1}/{rounds} done", flush=True)
    return result


def _measure(
    result: OverheadResult, wrk: str, name: str, url: str, body: bytes, c: int, duration_s: float
) -> None:
    try:
        res = run_wrk(wrk, url + "/v1/chat/completions", body, c, duration_s)
    except WrkError as exc:
        warn(f"{name} c={c}: {exc}")
        return
    if res.errors:
        warn(f"{name} c={c}: {res.errors} errors in {res.requests} requests")
    result.runs.setdefault((name, c), []).append(res)
    print(f"  {name:<34} c={c:<3} {res.requests_per_s:>9,.0f} req/s  p50 {res.p50_ms:7.2f} ms  "
          f"p99 {res.p99_ms:7.2f} ms", flush=True)  # fmt: skip
