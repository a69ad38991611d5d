"""``python -m loadtest.bench`` (``make bench``): overhead, relay and placement benchmarks, one run.

Installs what it can (nginx and wrk from the OS packages, sglang-router and vllm-router into .bench-venv)
and skips, loudly, what it cannot. Writes the Markdown report (``--out``, default docs/bench.md) and the
raw figures as JSON beside it. Everything listens on 127.0.0.1 and stops by itself.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import orjson

from . import report
from .overhead import run_overhead
from .placement import PlacementConfig, run_placement
from .relay import run_relay
from .routers import RouterSpec
from .stats import load_average
from .tools import find_tools
from .upstream import capture_payloads

SECTIONS = ("overhead", "relay", "placement")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__)
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS)
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of the overhead and relay sections")
    p.add_argument("--duration-s", type=float, default=10.0, help="seconds per overhead point")
    p.add_argument("--relay-duration-s", type=float, default=6.0, help="target seconds per relay run")
    p.add_argument("--placement-rounds", type=int, default=1, help="runs of every row per seed")
    p.add_argument(
        "--placement-seeds", default="7,8,9", help="comma-separated workload seeds (one draw each)"
    )
    p.add_argument("--placement-time-scale", type=float, default=0.05)
    p.add_argument("--placement-capacity-scale", type=float, default=0.3)
    p.add_argument("--placement-duration-s", type=float, default=300.0, help="engine seconds of arrivals")
    p.add_argument(
        "--placement-rows",
        default=None,
        help="only these rows, e.g. kvrouter:lockstep,sglang-router:cache_aware",
    )
    p.add_argument(
        "--kvrouter-workers",
        type=int,
        action="append",
        help="kvrouter worker processes; repeat (e.g. 1 and 2) to measure variants side by side in one run "
        "(default: 1 and 2). Without --redis-url, several workers share a shared-memory ledger",
    )
    p.add_argument("--redis-url", default=None, help="ledger of every kvrouter variant (default: none)")
    p.add_argument("--quick", action="store_true", help="1 round, 3 s points (a smoke run)")
    p.add_argument("--no-install", action="store_true", help="use only what is already installed")
    p.add_argument("--venv", type=Path, default=Path(".bench-venv"), help="venv for the peer routers")
    p.add_argument("--out", type=Path, default=Path("docs/bench.md"))
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvbench-logs"))
    args = p.parse_args(argv)
    args.kvrouter_workers = list(dict.fromkeys(args.kvrouter_workers or [1, 2]))
    if min(args.kvrouter_workers) < 1:
        p.error("--kvrouter-workers must be >= 1")
    if args.quick:
        args.rounds, args.duration_s, args.relay_duration_s = 1, 3.0, 3.0
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sections = args.sections.split(",")
    started = time.time()
    load_before = load_average()
    tools = find_tools(args.venv, install=not args.no_install)
    payloads = capture_payloads()
    kvs = [
        RouterSpec("kvrouter", "lockstep", workers=w, redis_url=args.redis_url) for w in args.kvrouter_workers
    ]
    kv = kvs[0]  # the relay section and the targets' verdicts use the first variant
    md = [
        "# kvrouter benchmarks", "",
        f"Produced by `{' '.join(['python -m loadtest.bench', *map(shlex.quote, sys.argv[1:])])}` "
        f"(`make bench`) on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{_cores()} cores shared with other work: load average before {_fmt_load(load_before)}.", "",
        "Every figure is a median over rounds with the min-max spread in brackets; ratios are paired "
        "within a round (same machine noise).", "",
    ]  # fmt: skip
    raw: dict[str, object] = {"argv": sys.argv[1:], "tools": vars(tools)}
    if "overhead" in sections:
        over = run_overhead(
            tools, payloads, kvs, rounds=args.rounds, duration_s=args.duration_s, log_dir=args.log_dir
        )
        md += report.overhead_md(over, kv.label, [k.label for k in kvs[1:]])
        raw["overhead"] = over.to_json()
    if "relay" in sections:
        relay = run_relay(
            payloads, kvs, rounds=args.rounds, duration_s=args.relay_duration_s, log_dir=args.log_dir
        )
        md += report.relay_md(relay, [k.label for k in kvs])
        raw["relay"] = relay.to_json()
    if "placement" in sections:
        rows = tuple(args.placement_rows.split(",")) if args.placement_rows else None
        seeds = tuple(int(s) for s in args.placement_seeds.split(","))
        cfg = PlacementConfig(args.placement_capacity_scale, args.placement_time_scale,
                              args.placement_duration_s, args.placement_rounds, seeds, rows)  # fmt: skip
        place = run_placement(tools, cfg, args.log_dir)
        md += report.placement_md(place)
        raw["placement"] = place.to_json()
    md += [f"Load average after: {_fmt_load(load_average())}; wall time {time.time() - started:.0f} s.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(md))
    args.out.with_suffix(".json").write_bytes(orjson.dumps(raw, option=orjson.OPT_INDENT_2))
    print("\n".join(md))
    print(f"bench: report written to {args.out}", flush=True)
    return 0


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def _fmt_load(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{v:.2f}" for v in load)


if __name__ == "__main__":
    raise SystemExit(main())
