"""The shared-memory ledger across real processes (its single-process semantics are the contract suite's).

Processes are started with multiprocessing's spawn (fresh interpreters, as uvicorn's workers are), each
opens the same file; every wait is bounded and stops by itself.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from router.ledger import shm_file
from router.ledger.base import RankUsage
from router.ledger.factory import build_ledger
from router.ledger.memory import InMemoryLedger
from router.ledger.shm import SharedMemoryLedger
from router.ledger.shm_file import create_ledger_file, remove_ledger_file
from router.placement.snapshot import RankKey

KEYS = [RankKey("sg", 0), RankKey("sg", 1)]
CAPACITY_TOKENS = 1000
HAMMER_PROCESSES = 4
HAMMER_S = 1.5
WAIT_S = 20.0  # bound on every wait for another process

pytestmark = pytest.mark.anyio
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ledger_path(tmp_path: Path) -> Iterator[str]:
    path = create_ledger_file(str(tmp_path / "ledger"))
    yield path
    remove_ledger_file(path)


def hammer(path: str, seed: int, out: Connection) -> None:
    """Reserve and release at random for HAMMER_S; report (placed, refused, worst usage seen, violations)."""
    import random

    async def run() -> tuple[int, int, int, int]:
        ledger = SharedMemoryLedger(path)
        rng = random.Random(seed)
        live: list[str] = []
        placed = refused = worst = violations = 0
        deadline_s = time.monotonic() + HAMMER_S
        n = 0
        while time.monotonic() < deadline_s:
            n += 1
            if rng.random() < 0.55 or not live:
                rid = f"p{seed}-{n}"
                if await ledger.reserve(rid, rng.sample(KEYS, 2), rng.randint(1, 120)) is None:
                    refused += 1
                else:
                    placed += 1
                    live.append(rid)
            elif rng.random() < 0.2:
                await ledger.grow(rng.choice(live), rng.randint(0, 50))
            elif not await ledger.release(live.pop(rng.randrange(len(live)))):
                violations += 1  # a reservation of ours vanished
            for u in (await ledger.usage()).values():
                worst = max(worst, u.reserved_tokens)
                if not 0 <= u.reserved_tokens <= u.capacity_tokens or u.inflight < 0:
                    violations += 1
        for rid in live:
            await ledger.release(rid)
        await ledger.close()
        return placed, refused, worst, violations

    out.send(asyncio.run(run()))
    out.close()


def hold_then_wait(path: str, lease_ttl_s: float, out: Connection, go: Connection) -> None:
    """Reserve 300 tokens, say so, wait for 'go' (or be killed meanwhile), then report what is left."""

    async def run() -> None:
        ledger = SharedMemoryLedger(path, lease_ttl_s=lease_ttl_s)
        out.send(await ledger.reserve("held", [KEYS[0]], 300))
        go.recv()
        released = await ledger.release("held")  # False: the slot was reclaimed while we were stopped
        again = await ledger.reserve("again", [KEYS[0]], 100)
        out.send((released, again, (await ledger.usage())[KEYS[0]].reserved_tokens))
        await ledger.release("again")
        await ledger.close()

    asyncio.run(run())


async def registered(
    path: str, lease_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic
) -> SharedMemoryLedger:
    ledger = SharedMemoryLedger(path, lease_ttl_s=lease_ttl_s, clock=clock)
    await ledger.register(dict.fromkeys(KEYS, CAPACITY_TOKENS))
    return ledger


async def wait_reserved(ledger: SharedMemoryLedger, key: RankKey, tokens: int) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while (await ledger.usage())[key].reserved_tokens != tokens:
        assert time.monotonic() < deadline_s, await ledger.usage()
        await ledger.expire()
        await asyncio.sleep(0.05)


async def test_four_processes_never_exceed_capacity_and_end_at_zero(ledger_path: str) -> None:
    ledger = await registered(ledger_path)
    pipes = [SPAWN.Pipe(duplex=False) for _ in range(HAMMER_PROCESSES)]
    procs = [SPAWN.Process(target=hammer, args=(ledger_path, i, w)) for i, (_, w) in enumerate(pipes)]
    for p in procs:
        p.start()
    results = []
    for (r, _), p in zip(pipes, procs, strict=True):
        assert r.poll(WAIT_S + HAMMER_S), "a hammering process never reported"
        results.append(r.recv())
        p.join(WAIT_S)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert sum(v for *_, v in results) == 0, results
    assert all(placed > 0 for placed, *_ in results), results  # every process really took part
    assert sum(refused for _, refused, *_ in results) > 0, results  # capacity was the limit, not the load
    assert max(worst for *_, worst, _ in results) <= CAPACITY_TOKENS
    assert await ledger.usage() == dict.fromkeys(KEYS, RankUsage(CAPACITY_TOKENS))
    await ledger.close()


async def test_killed_process_slot_is_reclaimed(ledger_path: str) -> None:
    ledger = await registered(ledger_path, lease_ttl_s=1.0)
    (r, w), (go_r, _) = SPAWN.Pipe(duplex=False), SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=hold_then_wait, args=(ledger_path, 1.0, w, go_r))
    proc.start()
    try:
        assert r.poll(WAIT_S) and r.recv() == KEYS[0]
        assert (await ledger.usage())[KEYS[0]] == RankUsage(CAPACITY_TOKENS, 300, 1)
        os.kill(proc.pid or 0, signal.SIGKILL)  # not joined yet: a zombie, which counts as dead
        await wait_reserved(ledger, KEYS[0], 0)
        assert (await ledger.usage())[KEYS[0]] == RankUsage(CAPACITY_TOKENS)
    finally:
        proc.kill()
        proc.join(WAIT_S)
    assert await ledger.reserve("all", [KEYS[0]], CAPACITY_TOKENS) == KEYS[0]
    await ledger.close()


async def test_stalled_process_loses_its_slot_after_the_ttl_and_recovers(ledger_path: str) -> None:
    ledger = await registered(ledger_path, lease_ttl_s=0.5)
    (r, w), (go_r, go_w) = SPAWN.Pipe(duplex=False), SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=hold_then_wait, args=(ledger_path, 0.5, w, go_r))
    proc.start()
    try:
        assert r.poll(WAIT_S) and r.recv() == KEYS[0]
        os.kill(proc.pid or 0, signal.SIGSTOP)  # alive but silent: only its stale heartbeat tells
        await wait_reserved(ledger, KEYS[0], 0)
        assert await ledger.reserve("mine", [KEYS[0]], 50) == KEYS[0]
        os.kill(proc.pid or 0, signal.SIGCONT)
        go_w.send(True)
        assert r.poll(WAIT_S)
        released, again, seen_tokens = r.recv()
        assert (released, again, seen_tokens) == (False, KEYS[0], 150)  # ours 50 + its new 100, no ghost
        proc.join(WAIT_S)
        assert proc.exitcode == 0
    finally:
        proc.kill()
        proc.join(WAIT_S)
    assert (await ledger.usage())[KEYS[0]].reserved_tokens == 50
    await ledger.release("mine")
    await ledger.close()


async def test_silent_ledger_is_reaped_by_heartbeat_in_one_process(ledger_path: str) -> None:
    now_s = [100.0]
    live = await registered(ledger_path, lease_ttl_s=2.0, clock=lambda: now_s[0])
    silent = SharedMemoryLedger(ledger_path, lease_ttl_s=2.0, clock=lambda: now_s[0])
    assert await silent.reserve("s", [KEYS[1]], 400) == KEYS[1]
    now_s[0] += 1.5
    assert await live.expire() == 0 and (await live.usage())[KEYS[1]].reserved_tokens == 400
    now_s[0] += 1.0  # 2.5 s without a call from `silent`: over the TTL
    await live.expire()
    assert (await live.usage())[KEYS[1]] == RankUsage(CAPACITY_TOKENS)
    assert await silent.get("s") is None  # its lease lapsed too: both views agree
    assert await silent.reserve("t", [KEYS[1]], 10) == KEYS[1]  # and it carries on in a new slot
    assert (await live.usage())[KEYS[1]].reserved_tokens == 10
    await silent.close()
    assert (await live.usage())[KEYS[1]].reserved_tokens == 0  # close gives back what it held
    await live.close()


async def test_keys_and_capacity_are_shared_between_processes_ledgers(ledger_path: str) -> None:
    a = await registered(ledger_path)
    b = SharedMemoryLedger(ledger_path)
    assert set(await b.usage()) == set(KEYS)  # registered by a, known to b
    assert await b.reserve("b1", [KEYS[0]], 700) == KEYS[0]
    assert await a.reserve("a1", [KEYS[0], KEYS[1]], 400) == KEYS[1]  # b's 700 count against a
    await b.register({KEYS[1]: 300})
    assert await a.reserve("a2", [KEYS[1]], 1) is None
    assert await a.release("b1") is False  # each process releases only what it reserved
    assert await b.release("b1") and await a.release("a1")
    assert {u.reserved_tokens for u in (await a.usage()).values()} == {0}
    await a.close()
    await b.close()


async def test_slots_are_bounded_and_freed_by_close(tmp_path: Path) -> None:
    path = create_ledger_file(str(tmp_path / "small"), max_slots=2)
    first, second = SharedMemoryLedger(path), SharedMemoryLedger(path)
    with pytest.raises(RuntimeError, match="worker slots"):
        SharedMemoryLedger(path)
    await first.close()
    await first.close()  # idempotent
    third = SharedMemoryLedger(path)
    await second.close()
    await third.close()


async def test_bad_files_and_names_are_refused(tmp_path: Path, ledger_path: str) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        SharedMemoryLedger(str(tmp_path / "absent"))
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 4096)
    with pytest.raises(ValueError, match="not a kvrouter ledger"):
        SharedMemoryLedger(str(junk))
    ledger = SharedMemoryLedger(ledger_path)
    with pytest.raises(ValueError, match="bytes"):
        await ledger.register({RankKey("n" * 200, 0): 10})
    await ledger.close()


def test_a_new_serve_removes_files_of_killed_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_file, "default_dir", lambda: tmp_path)
    dead = SPAWN.Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join(WAIT_S)
    orphan = tmp_path / f"{shm_file.FILE_PREFIX}{dead.pid}-0000"
    alive = tmp_path / f"{shm_file.FILE_PREFIX}{os.getpid()}-0000"
    other = tmp_path / "unrelated"
    for p in (orphan, alive, other):
        p.write_bytes(b"")
    path = create_ledger_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(path).name, alive.name, other.name])


async def test_factory_picks_the_store(ledger_path: str) -> None:
    assert isinstance(build_ledger(None), InMemoryLedger)
    explicit = build_ledger(None, shm_path=ledger_path, lease_ttl_s=5.0)
    assert isinstance(explicit, SharedMemoryLedger) and explicit.lease_ttl_s == 5.0
    await explicit.close()
