"""The placer's cached rank views and candidate lists never go stale: every input a view shows (ledger
reservations, engine truth, local load, drain, discovery) is reflected in the next snapshot."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from router.backends.base import BackendInfo, RankTelemetry
from router.gateway.errors import ApiError
from router.gateway.flight import LocalLoad
from router.gateway.placement import CandidateCache, Placer
from router.gateway.waitqueue import WaitQueue
from router.ledger.memory import InMemoryLedger
from router.placement import get_policy
from router.placement.snapshot import RankKey
from router.telemetry import Metrics
from router.telemetry_store import TelemetryStore

INFO = BackendInfo("a", "sglang", "http://127.0.0.1:1", ("m",), 4, 1, 1000, (5000,) * 4)


def make() -> tuple[Placer, InMemoryLedger, TelemetryStore, tuple[RankKey, ...]]:
    store = TelemetryStore()
    store.set_info(INFO)
    ledger = InMemoryLedger()
    keys = tuple(RankKey("a", r) for r in range(INFO.dp_size))
    ledger.register_now(dict.fromkeys(keys, 5000))
    placer = Placer(ledger, store, get_policy("lockstep"), LocalLoad(), WaitQueue(8, 1.0), Metrics())
    return placer, ledger, store, keys


def test_every_input_reaches_the_next_snapshot() -> None:
    async def run() -> None:
        placer, ledger, store, keys = make()
        first = await placer.snapshot(keys)
        again = await placer.snapshot(keys)
        assert again.ranks is first.ranks and again.tick == first.tick + 1  # nothing changed: reused

        await ledger.reserve("r1", [keys[1]], 300)
        snap = await placer.snapshot(keys)
        assert (snap.ranks[1].reserved_tokens, snap.ranks[1].inflight) == (300, 1)
        assert snap.ranks[0] is first.ranks[0]  # untouched ranks keep their view

        placer.load.get(keys[2]).prefill_tokens += 40
        placer.load.get(keys[2]).context_tokens += 40
        snap = await placer.snapshot(keys)
        assert (snap.ranks[2].prefill_tokens, snap.ranks[2].context_tokens) == (40, 40)

        store.record(keys[3], RankTelemetry(3, used_tokens=900))
        snap = await placer.snapshot(keys)
        assert snap.ranks[3].engine_used_tokens == 900

        placer.drained.add(keys[0])
        assert (await placer.snapshot(keys)).ranks[0].draining
        placer.drained.discard(keys[0])
        assert not (await placer.snapshot(keys)).ranks[0].draining

        await ledger.release("r1")
        assert (await placer.snapshot(keys)).ranks[1].reserved_tokens == 0

        store.set_info(replace(INFO, page_size=64))  # rediscovery: page size changed
        assert (await placer.snapshot(keys)).ranks[0].page_size == 64

    asyncio.run(run())


def test_candidates_follow_discovery() -> None:
    store = TelemetryStore()
    cache = CandidateCache(store)
    with pytest.raises(ApiError) as info:
        cache.get("/v1/chat/completions", "m")
    assert info.value.status == 503  # nothing discovered yet: not cached as an answer
    store.set_info(INFO)
    found = cache.get("/v1/chat/completions", "m")
    assert len(found.keys) == 4 and found.context_tokens == 1000
    assert cache.get("/v1/chat/completions", "m") is found
    with pytest.raises(ApiError):
        cache.get("/v1/chat/completions", "other")
    store.set_info(replace(INFO, models=("m", "other"), dp_size=2, capacities_tokens=(5000,) * 2))
    assert len(cache.get("/v1/chat/completions", "other").keys) == 2
    assert len(cache.get("/v1/chat/completions", "m").keys) == 2
