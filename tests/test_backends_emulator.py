"""Adapters and the reconcile loop end to end against the emulated engines (loadtest/emulator) on loopback."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from emulator_fixtures import StartEmulator

from loadtest.emulator.host import EmulatorThread
from router.backends.base import Backend, BackendSpec
from router.backends.factory import make_backend
from router.placement.snapshot import RankKey
from router.reconcile import Reconciler, ReconcileSettings
from router.telemetry_store import TelemetryStore

pytestmark = pytest.mark.anyio
MODEL = "deepseek-ai/DeepSeek-V3"
KINDS = ("sglang", "vllm", "vllm-external")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def start(start_emulator: StartEmulator, kind: str, **settings: object) -> tuple[EmulatorThread, Backend]:
    engine = "sglang" if kind == "sglang" else "vllm"
    emu = start_emulator(engine, external_lb=kind == "vllm-external", **settings)
    return emu, make_backend(BackendSpec.parse(f"{kind}={','.join(emu.urls)}"))


@pytest.mark.parametrize("kind", KINDS)
async def test_discovery_against_the_emulator(start_emulator: StartEmulator, kind: str) -> None:
    page = 64 if kind == "sglang" else 16
    _, backend = start(
        start_emulator, kind, dp_size=8, kv_tokens_per_rank=8192, page_size=page, max_model_len=6000
    )
    async with httpx.AsyncClient() as http:
        info = await backend.discover(http)
    assert (info.dp_size, info.page_size, info.max_model_len) == (8, page, 6000)
    assert info.capacities_tokens == (8192,) * 8
    assert info.models == (MODEL,)


@pytest.mark.parametrize("kind", KINDS)
async def test_usage_moves_on_the_pinned_rank_only(start_emulator: StartEmulator, kind: str) -> None:
    _, backend = start(
        start_emulator, kind, dp_size=8, kv_tokens_per_rank=8192, time_scale=0.5, output_len_dist="max"
    )
    async with httpx.AsyncClient() as http:
        await backend.discover(http)
        up = backend.upstream(5, "/v1/completions")
        body = {"model": MODEL, "prompt": "p" * 4000, "max_tokens": 2000, "stream": True, **up.body_fields}
        async with http.stream("POST", up.url, json=body, headers=dict(up.headers)) as resp:
            assert resp.status_code == 200
            for _ in range(200):  # admitted at the engine's next step, which the poll may precede
                polled = await backend.poll(http)
                if polled[5].used_tokens:
                    break
                await asyncio.sleep(0.01)
        used = [t.used_tokens or 0 for t in polled]
        assert used[5] >= 1000 and sum(used) == used[5], used  # a 1000-token prompt, on rank 5 alone
        assert [t.running for t in polled] == [0, 0, 0, 0, 0, 1, 0, 0]
        for _ in range(200):  # closing the stream aborts it upstream: the rank drains
            if not any(t.used_tokens for t in await backend.poll(http)):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("rank 5 did not drain after the client closed its stream")


async def test_engine_that_stops_answering_goes_unhealthy_and_recovers(start_emulator: StartEmulator) -> None:
    with socket.socket() as s:  # a fixed port, so the restarted engine is the same URL
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    emu, backend = start(start_emulator, "sglang", dp_size=8, port=port)
    store = TelemetryStore(unhealthy_after=2, healthy_after=2)
    settings = ReconcileSettings(interval_s=0.05, poll_timeout_s=0.5, rediscover_interval_s=0.1)
    rec = Reconciler([backend], store, settings=settings)
    await rec.start()
    try:
        keys = [RankKey(backend.name, r) for r in range(8)]
        await wait_until(lambda: all(store.healthy(k) for k in keys))
        await asyncio.to_thread(emu.stop)
        await wait_until(lambda: not any(store.healthy(k) for k in keys))
        assert store.backend_error(backend.name)
        await asyncio.to_thread(
            start, start_emulator, "sglang", dp_size=8, port=port, kv_tokens_per_rank=2048
        )
        await wait_until(lambda: all(store.healthy(k) for k in keys))
        # re-discovered after the restart: the new engine's smaller pool replaces the old one
        await wait_until(lambda: store.info(backend.name).capacities_tokens == (2048,) * 8)  # type: ignore[union-attr]
    finally:
        await rec.stop()


async def test_rank_refusing_work_is_tripped_and_probed_back(start_emulator: StartEmulator) -> None:
    emu, backend = start(start_emulator, "vllm", dp_size=4)
    store = TelemetryStore(trip_after=1)
    settings = ReconcileSettings(interval_s=0.05, poll_timeout_s=1.0, probe_interval_s=0.05)
    rec = Reconciler([backend], store, settings=settings)
    await rec.start()
    try:
        async with httpx.AsyncClient() as http:
            await http.post(emu.url + "/_emulator/faults", json={"down_ranks": [2]})
            up = backend.upstream(2, "/v1/chat/completions")
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            resp = await http.post(up.url, json=chat, headers=dict(up.headers))
            assert resp.status_code == 503 and "not active" in resp.text
            key = RankKey(backend.name, 2)
            store.report_upstream(key, False, f"HTTP {resp.status_code}")  # what the gateway does
            await asyncio.sleep(0.3)  # several polls and probes while the rank still refuses
            assert not store.healthy(key) and store.healthy(RankKey(backend.name, 1))
            await http.post(emu.url + "/_emulator/faults", json={"down_ranks": []})
            await wait_until(lambda: store.healthy(key))
    finally:
        await rec.stop()


async def wait_until(predicate: object, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
