"""Section 2: SSE events/s relayed through kvrouter vs read directly from the same lockstep upstream.

The upstream offers ``OFFERED_EVENTS_PER_S`` (one event per open stream per step, so the step shrinks as
streams grow); the client counts events in its own process. The steady rate is taken between 10 % and
90 % of all events, which leaves stream setup out.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .procs import Proc, ProcError, free_port
from .routers import RouterSpec, router_proc
from .stats import Spread
from .tools import warn
from .upstream import Payloads

STREAM_COUNTS = (100, 1000)
OFFERED_EVENTS_PER_S = 60_000.0
NODE_EVENTS_PER_S = 30_000.0  # one 8xH200 node at the seed's 992 x 4k sequences (DESIGN §6)


@dataclass
class RelayResult:
    duration_s: float
    runs: dict[tuple[str, int], list[dict[str, float]]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def rate(self, target: str, streams: int) -> Spread:
        return Spread.of([r["steady_events_per_s"] for r in self.runs.get((target, streams), [])])

    def to_json(self) -> dict[str, Any]:
        return {
            "offered_events_per_s": OFFERED_EVENTS_PER_S,
            "points": [
                {"target": t, "streams": s, "steady_events_per_s": self.rate(t, s).to_json(), "runs": r}
                for (t, s), r in self.runs.items()
            ],
            "skipped": self.skipped,
        }


def _client(url: str, model: str, streams: int, tokens: int, timeout_s: float) -> dict[str, float]:
    argv = [sys.executable, "-m", "loadtest.bench.sse_client", "--url", url, "--streams", str(streams),
            "--tokens", str(tokens), "--model", model, "--timeout-s", str(timeout_s)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 30, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise ProcError(f"sse_client failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    out: dict[str, float] = orjson.loads(lines[-1])
    return out


def _show(streams: int, name: str, out: dict[str, float]) -> None:
    rate = out["steady_events_per_s"]
    done = f"{out['completed']:.0f} done, {out['failed']:.0f} failed"
    print(f"  relay {streams:>5} streams {name:<24} {rate:>9,.0f} ev/s  ({done})", flush=True)


def run_relay(payloads: Payloads, kvrouters: list[RouterSpec], *, rounds: int, duration_s: float,
              log_dir: Path) -> RelayResult:  # fmt: skip
    """Every kvrouter variant (e.g. 1 and 2 workers) runs at once; each round reads direct, then each."""
    result = RelayResult(duration_s)
    static = Path(tempfile.mkdtemp(prefix="kvbench-sse-")) / "static.json"
    static.write_bytes(orjson.dumps({k: v.decode() for k, v in payloads.bodies.items()}))
    for streams in STREAM_COUNTS:
        step_ms = 1000.0 * streams / OFFERED_EVENTS_PER_S
        tokens = max(50, int(OFFERED_EVENTS_PER_S * duration_s / streams))
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "loadtest.bench.sse_upstream", "--port", str(port),
                "--step-ms", f"{step_ms:.3f}", "--static", str(static)]  # fmt: skip
        try:
            with (
                Proc(f"sse-upstream-{streams}", argv, ready_url=upstream + "/v1/models", log_dir=log_dir),
                contextlib.ExitStack() as stack,
            ):
                targets = [("direct", upstream)]
                for spec in kvrouters:
                    proc, url = router_proc(spec, upstream, log_dir)
                    stack.enter_context(proc)
                    targets.append((spec.label, url))
                for i in range(rounds):
                    for name, target in targets:
                        out = _client(target, payloads.model, streams, tokens, duration_s * 6 + 30)
                        result.runs.setdefault((name, streams), []).append(out)
                        _show(streams, name, out)
                    print(f"bench: relay {streams} streams round {i + 1}/{rounds} done", flush=True)
        except (ProcError, subprocess.TimeoutExpired) as exc:
            result.skipped.append(f"{streams} streams: {exc}")
            warn(f"relay at {streams} streams failed: {exc}")
    return result
