"""Closed-loop HTTP load with wrk (C, epoll): a Lua script POSTs a fixed JSON body; output parsed."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}
_PCT = re.compile(r"^\s*(50|75|90|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s|m)\s*$", re.M)
_RPS = re.compile(r"^Requests/sec:\s+([\d.]+)", re.M)
_TOTAL = re.compile(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m)", re.M)
_NON2XX = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")
_SOCKET = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


class WrkError(RuntimeError):
    pass


@dataclass(frozen=True)
class WrkResult:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int  # non-2xx answers + socket errors


def lua_script(body: bytes) -> str:
    text = body.decode()
    if "]==]" in text:
        raise ValueError("body cannot contain ']==]'")
    return (
        f'wrk.method = "POST"\nwrk.body = [==[{text}]==]\nwrk.headers["Content-Type"] = "application/json"\n'
    )


def parse(output: str) -> WrkResult:
    pct = {int(p): float(v) * _UNIT_MS[u] for p, v, u in _PCT.findall(output)}
    rps = _RPS.search(output)
    total = _TOTAL.search(output)
    if rps is None or total is None or 50 not in pct or 99 not in pct:
        raise WrkError(f"unparsable wrk output: {output[-400:]!r}")
    errors = 0
    if (m := _NON2XX.search(output)) is not None:
        errors += int(m.group(1))
    if (m := _SOCKET.search(output)) is not None:
        errors += sum(int(g) for g in m.groups())
    return WrkResult(float(rps.group(1)), pct[50], pct[99], int(total.group(1)), errors)


def run_wrk(wrk: str, url: str, body: bytes, connections: int, duration_s: float) -> WrkResult:
    """One bounded wrk run (2 threads at most: this is a 2-core box)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua_script(body))
        script = Path(f.name)
    threads = min(2, connections)
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--latency", "--timeout", "10s",
            "-s", str(script), url]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 30, check=False)
    except subprocess.TimeoutExpired:
        raise WrkError(f"wrk did not stop after {duration_s + 30:g} s") from None
    finally:
        script.unlink(missing_ok=True)
    if done.returncode != 0:
        raise WrkError(f"wrk exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return parse(done.stdout)
