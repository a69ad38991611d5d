"""The reconcile loop and the telemetry store, against real loopback engine stand-ins."""

from __future__ import annotations

import asyncio

import pytest
from backends_fakes import FakeSGLang, FakeVLLM, serve

from router.backends.base import BackendInfo, BackendSpec, RankTelemetry
from router.backends.factory import make_backend
from router.ledger.memory import InMemoryLedger
from router.placement.snapshot import RankKey
from router.reconcile import Reconciler, ReconcileSettings, ledger_estimate
from router.telemetry_store import TelemetryStore

pytestmark = pytest.mark.anyio
FAST = ReconcileSettings(
    interval_s=0.02, poll_timeout_s=0.5, discover_timeout_s=0.5, rediscover_interval_s=0.0
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def store_with_one_rank(unhealthy_after: int = 3, healthy_after: int = 2) -> tuple[TelemetryStore, RankKey]:
    store = TelemetryStore(unhealthy_after=unhealthy_after, healthy_after=healthy_after)
    store.set_info(BackendInfo("b", "sglang", "http://x", ("m",), 1, 1, 1000, (100,)))
    return store, RankKey("b", 0)


def test_health_hysteresis() -> None:
    store, key = store_with_one_rank(unhealthy_after=3, healthy_after=2)
    assert store.healthy(key) and not store.healthy(RankKey("b", 1))
    for _ in range(2):
        store.record_failure(key, "boom")
    store.record(key, RankTelemetry(rank=0, used_tokens=5))  # a success resets the failure streak
    for _ in range(2):
        store.record_failure(key, "boom")
    assert store.healthy(key)
    store.record_failure(key, "boom")
    assert not store.healthy(key) and store.rank(key).last_error == "boom"  # type: ignore[union-attr]
    store.record(key, RankTelemetry(rank=0, used_tokens=5))
    assert not store.healthy(key)
    store.record(key, RankTelemetry(rank=0, healthy=False))  # the engine itself says no: a failure
    store.record(key, RankTelemetry(rank=0, used_tokens=5))
    assert not store.healthy(key)
    store.record(key, RankTelemetry(rank=0, used_tokens=5))
    assert store.healthy(key)


def test_data_plane_breaker_is_independent_of_polls() -> None:
    store = TelemetryStore(trip_after=2)
    store.set_info(BackendInfo("b", "sglang", "http://x", ("m",), 1, 1, 1000, (100,)))
    key = RankKey("b", 0)
    store.report_upstream(key, False, "503 not active")
    store.report_upstream(key, True)  # a success in between resets the streak
    store.report_upstream(key, False, "503 not active")
    assert store.healthy(key) and store.tripped() == []
    store.report_upstream(key, False, "503 not active")
    assert not store.healthy(key) and store.tripped() == [key]
    store.record(key, RankTelemetry(rank=0, used_tokens=0))  # polls still answer: the breaker stays open
    assert not store.healthy(key)
    store.report_upstream(key, True)
    assert store.healthy(key) and store.tripped() == []
    for _ in range(3):
        store.record_failure(key, "poll timed out")
    store.report_upstream(key, True)  # a closed breaker does not override the polls' verdict
    assert not store.healthy(key)


def test_drift_and_shrinking_backend() -> None:
    store, key = store_with_one_rank()
    store.record(key, RankTelemetry(rank=0, used_tokens=300), estimate_tokens=1000)
    assert store.drift_tokens(key) == -700
    store.record(key, RankTelemetry(rank=0, used_tokens=300))
    assert store.drift_tokens(key) is None  # no estimate this round: unknown, not zero
    assert store.set_info(BackendInfo("b", "sglang", "http://x", ("m",), 2, 1, 1000, (100, 100)))
    assert not store.set_info(BackendInfo("b", "sglang", "http://x", ("m",), 2, 1, 1000, (100, 100)))
    assert set(store.ranks()) == {key, RankKey("b", 1)}
    store.set_info(BackendInfo("b", "sglang", "http://x", ("m",), 1, 1, 1000, (50,)))
    assert set(store.ranks()) == {key} and store.rank(key).capacity_tokens == 50  # type: ignore[union-attr]


async def test_reconcile_records_truth_and_drift_from_the_ledger() -> None:
    fake = FakeSGLang(dp=4)
    async with serve(fake.app()) as url:
        backend = make_backend(BackendSpec.parse(f"sglang={url}"))
        ledger = InMemoryLedger()
        discovered: list[BackendInfo] = []

        async def on_discovered(info: BackendInfo) -> None:
            discovered.append(info)
            await ledger.register({RankKey(info.name, r): c for r, c in enumerate(info.capacities_tokens)})

        store = TelemetryStore()
        rec = Reconciler(
            [backend], store, settings=FAST, estimate=ledger_estimate(ledger), on_discovered=on_discovered
        )
        await rec.start()
        try:
            assert [i.dp_size for i in discovered] == [4]
            key = RankKey(backend.name, 2)
            assert await ledger.reserve("r1", [key], 1000) == key
            fake.used[2], fake.running[2] = 640, 1  # the pinned request runs on rank 2
            await rec.tick()
            truth = store.ranks()
            assert truth[key].engine_used_tokens == 640 and truth[key].running == 1
            assert store.drift_tokens(key) == 640 - 1000
            assert store.drift_tokens(RankKey(backend.name, 0)) == 0
            assert truth[RankKey(backend.name, 0)].engine_used_tokens == 0
        finally:
            await rec.stop()


async def test_rank_that_stops_answering_goes_unhealthy_and_recovers() -> None:
    fake = FakeSGLang(dp=4)
    settings = ReconcileSettings(interval_s=0.02, poll_timeout_s=0.5)
    async with serve(fake.app()) as url:
        backend = make_backend(BackendSpec.parse(f"sglang={url}"))
        store = TelemetryStore(unhealthy_after=2, healthy_after=2)
        rec = Reconciler([backend], store, settings=settings)
        await rec.start()
        try:
            key = RankKey(backend.name, 1)
            fake.silent_ranks = {1}
            await wait_for(lambda: not store.healthy(key))
            assert all(store.healthy(RankKey(backend.name, r)) for r in (0, 2, 3))
            fake.silent_ranks = set()
            await wait_for(lambda: store.healthy(key))
            fake.down = True  # the whole server answers 503: every rank goes, the error is kept for /ready
            await wait_for(lambda: not any(t.healthy for t in store.ranks().values()))
            assert "503" in (store.backend_error(backend.name) or "")
            fake.capacity = 200_000  # it restarts with a smaller pool: re-discovered, not assumed
            fake.down = False
            await wait_for(lambda: all(t.healthy for t in store.ranks().values()))
            assert store.backend_error(backend.name) is None
            await wait_for(lambda: store.info(backend.name).capacities_tokens[0] == 200_000)  # type: ignore[union-attr]
        finally:
            await rec.stop()
    assert not rec.running


async def test_backend_down_at_startup_is_discovered_later() -> None:
    fake = FakeSGLang(dp=2, down=True)
    async with serve(fake.app()) as url:
        backend = make_backend(BackendSpec.parse(f"sglang={url}"))
        store = TelemetryStore()
        rec = Reconciler([backend], store, settings=FAST)
        await rec.start()
        try:
            assert store.info(backend.name) is None and store.ranks() == {}
            assert "discovery" in (store.backend_error(backend.name) or "")
            fake.down = False
            await wait_for(lambda: store.info(backend.name) is not None)
            assert store.info(backend.name).dp_size == 2  # type: ignore[union-attr]
            assert store.healthy(RankKey(backend.name, 0))
        finally:
            await rec.stop()


async def test_hanging_backend_is_bounded_and_does_not_stall_the_others() -> None:
    slow, ok = FakeVLLM(engines=[0, 1]), FakeVLLM(engines=[0, 1, 2])
    async with serve(slow.app(), slow.release) as slow_url, serve(ok.app()) as ok_url:
        # adapter timeouts longer than the round's: the round's own bound must cut the hang
        specs = [BackendSpec("vllm", (u,), f"v{i}") for i, u in enumerate((slow_url, ok_url))]
        backends = [make_backend(spec, timeout_s=5.0) for spec in specs]
        store = TelemetryStore(unhealthy_after=1)
        settings = ReconcileSettings(interval_s=10.0, poll_timeout_s=0.3)
        rec = Reconciler(backends, store, settings=settings)
        await rec.start()  # the loop's 10 s interval never fires here: rounds run by hand
        try:
            slow.hang = True
            ok.usage = {2: 0.5}
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await rec.tick()
            assert loop.time() - t0 < 1.5
            assert not store.healthy(RankKey("v0", 0)) and "timed out" in (store.backend_error("v0") or "")
            assert store.rank(RankKey("v1", 2)).engine_used_tokens == 200_000  # type: ignore[union-attr]
        finally:
            await rec.stop()


async def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    """Let the real loop run until ``predicate()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_external_lb_rank_down_at_startup_does_not_block_the_others() -> None:
    fakes = [FakeVLLM(engines=[r], blocks_per_engine=1000 * (r + 1), summed=False) for r in range(3)]
    fakes[0].down = True  # rank 0 (also the first /v1/models candidate) is restarting
    async with serve(fakes[0].app()) as u0, serve(fakes[1].app()) as u1, serve(fakes[2].app()) as u2:
        backend = make_backend(BackendSpec.parse(f"vllm-external={u0},{u1},{u2}"))
        store = TelemetryStore(unhealthy_after=2, healthy_after=2)
        rec = Reconciler([backend], store, settings=FAST)
        await rec.start()
        try:
            info = store.info(backend.name)
            assert info is not None and info.extra["unverified_ranks"] == (0,)
            assert info.capacities_tokens == (32_000, 32_000, 48_000)  # rank 0 assumed like the smallest
            assert [store.healthy(RankKey(backend.name, r)) for r in range(3)] == [False, True, True]
            fakes[0].down = False
            await wait_for(lambda: store.healthy(RankKey(backend.name, 0)))
            await wait_for(lambda: store.info(backend.name).capacities_tokens[0] == 16_000)  # type: ignore[union-attr]
            assert store.info(backend.name).extra["unverified_ranks"] == ()  # type: ignore[union-attr]
        finally:
            await rec.stop()


async def test_tripped_rank_is_probed_pinned_and_comes_back() -> None:
    fake = FakeSGLang(dp=4, inactive_ranks={3})
    settings = ReconcileSettings(interval_s=0.02, poll_timeout_s=0.5, probe_interval_s=0.05)
    async with serve(fake.app()) as url:
        backend = make_backend(BackendSpec.parse(f"sglang={url}"))
        store = TelemetryStore(trip_after=1)
        rec = Reconciler([backend], store, settings=settings)
        await rec.start()
        try:
            key = RankKey(backend.name, 3)
            store.report_upstream(key, False, "HTTP 503: DP rank 3 is not active.")
            assert not store.healthy(key)
            await wait_for(lambda: len(fake.pins) >= 2)  # probed, and probed again after probe_interval_s
            assert not store.healthy(key) and set(fake.pins) == {(3, "3")}
            fake.inactive_ranks = set()
            await wait_for(lambda: store.healthy(key))
        finally:
            await rec.stop()
