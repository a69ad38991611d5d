"""Micro-benchmark: microseconds per placement through the gateway's own code, no HTTP.

One placement is what a request costs the router between sizing and forwarding, and at its end:
``Placer.place`` (snapshot, policy, admission, ledger reserve, metrics) and ``Gateway.finish`` (book,
local load, ledger release, queue wake-up, metrics), on a real :class:`~router.gateway.runtime.Gateway`
with the in-process ledger, 8 ranks of one SGLang backend, and a window of ``--inflight`` requests held
at once (so every placement sees ranks with load, and one release and one reservation since the last).

``--against DIR`` times another checkout too (e.g. a ``git worktree`` of an older commit), alternating
with this one round by round in fresh processes, so both share the same machine noise. Figures are the
median over rounds with the min-max spread.

    python -m loadtest.bench.placement_micro --against /tmp/ab-base

This file imports only ``router`` and the standard library, so it runs unchanged against an older tree
(the child process puts that tree's directory first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DP_SIZE = 8
KV_TOKENS_PER_RANK = 10_000_000  # as the overhead bench's static upstream: nothing ever queues
PROMPT_TOKENS = 24
OUTPUT_TOKENS = 16
ROUTE = "/v1/chat/completions"
POLICIES = ("lockstep", "kv_fit")
CHUNK = 1_000  # placements per timed chunk


async def _time_policy(policy: str, placements: int, inflight: int) -> float:
    """Seconds per placement (place + finish), ``inflight`` held at once: the median of chunks of
    ``CHUNK`` placements (a busy shared box stalls some of them)."""
    from router.backends.base import BackendInfo
    from router.config import Settings
    from router.gateway.flight import Flight
    from router.gateway.output_plan import plan_request
    from router.gateway.runtime import Gateway
    from router.placement.snapshot import RankKey, RequestShape
    from router.sizing import Sized
    from router.telemetry import Metrics

    settings = Settings(backends=["sglang=http://127.0.0.1:9"], policy=policy)
    gw = Gateway(settings, Metrics(policy=policy))
    name = next(iter(gw.backends))
    caps = (KV_TOKENS_PER_RANK,) * DP_SIZE
    info = BackendInfo(name, "sglang", "http://127.0.0.1:9", ("m",), DP_SIZE, 1, 32_768, caps)
    gw.store.set_info(info)
    keys = tuple(RankKey(name, r) for r in range(DP_SIZE))
    await gw.ledger.register(dict.fromkeys(keys, KV_TOKENS_PER_RANK))
    sized = Sized(PROMPT_TOKENS, OUTPUT_TOKENS, 1, OUTPUT_TOKENS, True, False)

    def flight(i: int) -> Flight:
        plan = plan_request(gw.book, ROUTE, "m", sized, "", False)
        shape = RequestShape(PROMPT_TOKENS, OUTPUT_TOKENS, entropy=gw.placer.entropy())
        return Flight(f"req-{i}", ROUTE, sized, shape, False, model="m", plan=plan)

    flights = [flight(i) for i in range(CHUNK + placements)]  # the first chunk warms up
    held: list[Flight] = []
    chunks_s: list[float] = []
    start_s = time.perf_counter()
    for i, f in enumerate(flights):
        if i and i % CHUNK == 0:
            now_s = time.perf_counter()
            chunks_s.append(now_s - start_s)
            start_s = now_s
        gw.begin(f)
        await gw.placer.place(f, keys)
        f.on_first_byte(gw.load)
        f.on_tokens(gw.load, OUTPUT_TOKENS)
        held.append(f)
        if len(held) >= inflight:
            await gw.finish(held.pop(0), 200)
    for f in held:
        await gw.finish(f, 200)
    await gw.control.aclose()
    return statistics.median(chunks_s[1:]) / CHUNK


def _worker(placements: int, inflight: int) -> None:
    """One round in this process: print {policy: µs per placement} as JSON."""
    out = {p: asyncio.run(_time_policy(p, placements, inflight)) * 1e6 for p in POLICIES}
    print(json.dumps(out))


def _round(tree: Path | None, placements: int, inflight: int) -> dict[str, float]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--placements", str(placements),
            "--inflight", str(inflight)]  # fmt: skip
    cwd = tree if tree is not None else Path(__file__).resolve().parents[2]
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=True, timeout=300)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} µs ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--against", type=Path, help="another checkout to time alternately (before)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--placements", type=int, default=20_000, help="timed placements per round")
    parser.add_argument("--inflight", type=int, default=64, help="requests held at once (the c of wrk)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.placements, args.inflight)
        return
    trees: dict[str, Path | None] = {"this tree": None}
    if args.against is not None:
        trees = {f"against {args.against}": args.against.resolve(), **trees}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            runs[label].append(_round(tree, args.placements, args.inflight))
    print(f"µs per placement (place + finish), {DP_SIZE} ranks, {args.inflight} in flight, "
          f"median (min-max) of {args.rounds} rounds x {args.placements} placements")  # fmt: skip
    for policy in POLICIES:
        for label in trees:
            print(f"  {policy:<10} {label:<40} {_spread([r[policy] for r in runs[label]])}")
        if args.against is not None:
            base, mine = (runs[label] for label in trees)
            ratios = [b[policy] / m[policy] for b, m in zip(base, mine, strict=True)]
            print(f"  {policy:<10} {'speed-up (paired)':<40} {statistics.median(ratios):7.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
