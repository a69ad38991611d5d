"""Soak: N requests through a real ``kvrouter serve`` to emulated SGLang engines, ~10 % of them faulty.

Request faults (each ~2 % of requests): malformed or invalid input, a client that leaves mid-stream, a
client that gives up before the answer, an upstream that dies mid-answer (cut connection on one engine,
in-band engine error on another), requests sized to fill a whole rank (queueing, 429). Infrastructure
faults run beside them: one rank of engine A flaps down and up ("DP rank R is not active."), engine C is
stopped and restarted on the same port (connections refused, then rediscovered). Engines run at
``time_scale 0``. At the end every fault is cleared and the router's ledger must be exactly zero: no
reserved token, no request in flight, nothing left running in any engine.

    python -m loadtest.bench.soak --requests 10000 [--concurrency 64] [--seed 7] [--json out.json]

Exit status 0 only when the ledger and the engines are back to zero and the router never answered 500.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtest.bench.procs import Proc, free_port
from loadtest.emulator.app import EmulatorSettings
from loadtest.emulator.host import EmulatorThread

MODEL = "deepseek-ai/DeepSeek-V3"
FAULT_KINDS = ("bad_input", "client_disconnect", "client_cancel", "upstream_death", "overload")
ABORT_AFTER_TOKENS = 64  # the engines cut every answer longer than this (upstream_death asks for more)
KV_TOKENS_PER_RANK = 4096
OVERLOAD_MAX_TOKENS = 1500  # two fill a rank: a burst of them queues (strict FIFO) and overflows the queue
QUEUE_MAX = 48
BAD_BODIES: tuple[bytes, ...] = (
    b"{not json",
    b"\xff\xfe\x00garbage",
    b"[1, 2]",
    orjson.dumps({"model": MODEL, "messages": []}),
    orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}),
    orjson.dumps({"model": MODEL, "prompt": "x", "n": 100000}),
    orjson.dumps({"model": "no-such-model", "prompt": "x"}),
    orjson.dumps({"model": MODEL, "prompt": list(range(20000))}),
    orjson.dumps({"model": MODEL, "prompt": "x", "stream": True, "stream_options": "yes"}),
    orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2, "routed_dp_rank": 99}),  # pin: stripped
)


@dataclass
class Soak:
    url: str
    rng: random.Random
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    infra: Counter[str] = field(default_factory=Counter)


def normal_body(rng: random.Random, output_tokens: int, stream: bool) -> tuple[str, dict[str, Any]]:
    prompt = "p" * rng.randint(1, 400)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max(output_tokens, rng.randint(16, 256)),
                            "emulator_output_tokens": output_tokens, "stream": stream}  # fmt: skip
    route = rng.choice(("/v1/chat/completions", "/v1/completions", "/generate"))
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    elif route == "/v1/completions":
        body["prompt"] = prompt
    else:
        body = {"text": prompt, "stream": stream, "emulator_output_tokens": output_tokens,
                "sampling_params": {"max_new_tokens": body["max_tokens"]}}  # fmt: skip
    return route, body


def classify(status: int, data: bytes, stream: bool) -> str:
    """What the client saw."""
    if status != 200:
        try:
            code = orjson.loads(data)["error"]["code"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            code = "?"
        return f"http_{status}:{code}"
    if stream:
        if not data.rstrip().endswith(b"data: [DONE]"):
            return "stream_truncated"
        return "error_event" if b'"error"' in data else "ok"
    return "ok"


async def one(soak: Soak, session: aiohttp.ClientSession, kind: str) -> str:
    rng = soak.rng
    if kind == "bad_input":
        async with session.post(soak.url + "/v1/completions", data=rng.choice(BAD_BODIES)) as resp:
            return classify(resp.status, await resp.read(), False)
    stream = kind == "client_disconnect" or rng.random() < 0.5
    tokens = {"upstream_death": ABORT_AFTER_TOKENS + 36, "client_disconnect": 48}.get(
        kind, rng.randint(1, 32)
    )
    route, body = normal_body(rng, tokens, stream)
    if kind == "overload":  # a whole rank's worth: waits for room, or is refused when the queue is full
        limits = body["sampling_params"] if route == "/generate" else body
        limits["max_new_tokens" if route == "/generate" else "max_tokens"] = OVERLOAD_MAX_TOKENS
    call = session.post(soak.url + route, data=orjson.dumps(body))
    if kind == "client_cancel":
        try:
            async with asyncio.timeout(rng.uniform(0.0005, 0.005)):
                async with call as resp:
                    return classify(resp.status, await resp.read(), stream)
        except TimeoutError:
            return "client_gone"
    async with call as resp:
        if kind == "client_disconnect" and resp.status == 200:
            await resp.content.readany()
            resp.close()  # the client leaves mid-stream
            return "client_gone"
        return classify(resp.status, await resp.read(), stream)


async def drive(soak: Soak, total: int, concurrency: int) -> None:
    kinds = ["normal" if soak.rng.random() >= 0.10 else soak.rng.choice(FAULT_KINDS) for _ in range(total)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while not queue.empty():
                kind = queue.get_nowait()
                try:
                    outcome = await one(soak, session, kind)
                except aiohttp.ClientError as exc:
                    outcome = f"transport:{type(exc).__name__}"
                soak.outcomes[(kind, outcome)] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def flap_rank(soak: Soak, emu_url: str, stop: asyncio.Event) -> None:
    """Engine A: one rank at a time goes "not active" for a while, then comes back."""
    async with aiohttp.ClientSession() as session:
        rank = 0
        while not stop.is_set():
            await session.post(emu_url + "/_emulator/faults", json={"down_ranks": [rank]})
            soak.infra["rank_down"] += 1
            await asyncio.sleep(0.4)
            await session.post(emu_url + "/_emulator/faults", json={"down_ranks": []})
            rank = 1 - rank
            await asyncio.sleep(0.8)


@dataclass
class Restarter:
    """Engine C: stopped (connections refused) and started again on the same port, until told to stop."""

    settings: EmulatorSettings
    emu: EmulatorThread
    up: bool = True

    async def run(self, soak: Soak, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(2.5)
            self.up = False
            await asyncio.to_thread(self.emu.stop)
            soak.infra["backend_stopped"] += 1
            await asyncio.sleep(1.0)
            await self.start()

    async def start(self) -> None:
        if not self.up:
            self.emu = await asyncio.to_thread(EmulatorThread(self.settings).start)
            self.up = True


async def settle(url: str, emulators: Sequence[EmulatorThread], timeout_s: float = 15.0) -> dict[str, Any]:
    """Faults off, then the ledger and every engine as they are once nothing is left to finish."""
    async with aiohttp.ClientSession() as session:
        for emu in emulators:
            clear: dict[str, Any] = {"down_ranks": [], "abort_after_tokens": None}
            await session.post(emu.url + "/_emulator/faults", json=clear)
        deadline_s = time.monotonic() + timeout_s
        while True:
            async with session.get(url + "/ranks") as resp:
                ranks = [r for b in (await resp.json())["backends"] for r in b["ranks"]]
            engines = []
            for emu in emulators:
                async with session.get(emu.url + "/_emulator/stats") as resp:
                    engines.append(await resp.json())
            reserved = sum(r["reserved_tokens"] for r in ranks)
            inflight = sum(r["inflight"] for r in ranks)
            engine_inflight = sum(e["inflight"] for e in engines)
            if reserved == inflight == engine_inflight == 0 or time.monotonic() > deadline_s:
                break
            await asyncio.sleep(0.1)
        async with session.get(url + "/metrics") as resp:
            metrics = await resp.text()
    return {
        "reserved_tokens": reserved,
        "inflight": inflight,
        "engine_inflight": engine_inflight,
        "engine_orphans": sum(e.get("orphaned_requests", 0) for e in engines),
        "ranks": len(ranks),
        "rejections": _rejections(metrics),
    }


def _rejections(metrics: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("kvrouter_rejections_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def emulator_settings(port: int, abort_mode: str) -> EmulatorSettings:
    from loadtest.emulator.faults import Faults

    faults = Faults(abort_after_tokens=ABORT_AFTER_TOKENS, abort_mode=abort_mode)
    return EmulatorSettings(engine="sglang", dp_size=2, port=port, kv_tokens_per_rank=KV_TOKENS_PER_RANK,
                            time_scale=0.0, max_model_len=16384, output_len_dist="fixed:16",
                            faults=faults)  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = [emulator_settings(free_port(), mode) for mode in ("error", "drop", "error")]
    emulators = [EmulatorThread(s).start() for s in settings]
    restarter = Restarter(settings[2], emulators[2])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--queue-max", str(QUEUE_MAX),
            "--queue-timeout", "2", "--reconcile-interval", "0.2", "--shutdown-grace", "5"]  # fmt: skip
    for s in settings:
        argv += ["--backend", f"sglang=http://127.0.0.1:{s.port}"]
    soak = Soak(url, random.Random(args.seed))
    try:
        with Proc("soak-router", argv, ready_url=url + "/ready", env={"KVROUTER_PROBE_INTERVAL_S": "0.5"}):
            stop = asyncio.Event()
            infra = [
                asyncio.create_task(flap_rank(soak, emulators[0].url, stop)),
                asyncio.create_task(restarter.run(soak, stop)),
            ]
            started = time.monotonic()
            await drive(soak, args.requests, args.concurrency)
            elapsed_s = time.monotonic() - started
            stop.set()
            await asyncio.gather(*infra)
            await restarter.start()
            final = await settle(url, [emulators[0], emulators[1], restarter.emu])
    finally:
        for emu in (emulators[0], emulators[1], restarter.emu):
            emu.stop()
    return report(soak, args, elapsed_s, final)


def report(soak: Soak, args: argparse.Namespace, elapsed_s: float, final: dict[str, Any]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), n in sorted(soak.outcomes.items()):
        by_kind.setdefault(kind, {})[outcome] = n
    served = sum(n for (_, outcome), n in soak.outcomes.items() if outcome == "ok")
    internal = sum(n for (_, o), n in soak.outcomes.items() if o.startswith("http_500"))
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "elapsed_s": round(elapsed_s, 1),
        "requests_per_s": round(args.requests / elapsed_s, 1),
        "served_ok": served,
        "faulty_requests": sum(n for (kind, _), n in soak.outcomes.items() if kind != "normal"),
        "outcomes_by_kind": by_kind,
        "infrastructure_faults": dict(soak.infra),
        "router_500s": internal,
        "final": final,
        "zero": final["reserved_tokens"] == final["inflight"] == final["engine_inflight"] == 0
        and final["engine_orphans"] == 0
        and internal == 0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1")
    # The engines' injected drops and restarts are logged as ASGI exceptions: expected here, not news.
    # (A filter, not a level: every restarted engine reconfigures uvicorn's loggers, but keeps filters.)
    logging.getLogger("uvicorn.error").addFilter(lambda record: record.exc_info is None)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if result["zero"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
