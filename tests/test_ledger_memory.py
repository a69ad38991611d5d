"""The in-process ledger against a model, under any order of operations (hypothesis state machine)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from router.ledger.memory import InMemoryLedger
from router.placement.snapshot import RankKey

T = TypeVar("T")
RANKS = (RankKey("sg", 0), RankKey("sg", 1), RankKey("vl", 0))
IDS = st.sampled_from([f"r{i}" for i in range(12)])
TTL_S = 10.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    """The in-process ledger never awaits, so one send runs a call to completion (no event loop needed)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("InMemoryLedger awaited: its check-and-reserve would no longer be atomic")


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0
        self.ledger = InMemoryLedger(lease_ttl_s=TTL_S, clock=lambda: self.now_s)
        self.capacity = {RANKS[0]: 100, RANKS[1]: 64, RANKS[2]: 1}
        run(self.ledger.register(self.capacity))
        self.model: dict[str, tuple[RankKey, int, float]] = {}  # id → (rank, tokens, lease expiry)

    def _expire_model(self) -> None:
        self.model = {rid: v for rid, v in self.model.items() if v[2] > self.now_s}

    def _reserved(self, key: RankKey) -> int:
        return sum(t for k, t, _ in self.model.values() if k == key)

    @rule(
        rid=IDS,
        cands=st.permutations(RANKS).flatmap(lambda p: st.integers(0, 3).map(lambda n: p[:n])),
        tokens=st.integers(1, 120),
    )
    def reserve(self, rid: str, cands: list[RankKey], tokens: int) -> None:
        self._expire_model()
        if rid in self.model:
            try:
                run(self.ledger.reserve(rid, cands, tokens))
            except ValueError:
                return
            raise AssertionError("a second reservation for one request id was accepted")
        expected = next((k for k in cands if self._reserved(k) + tokens <= self.capacity[k]), None)
        assert run(self.ledger.reserve(rid, cands, tokens)) == expected
        if expected is not None:
            self.model[rid] = (expected, tokens, self.now_s + TTL_S)

    @rule(rid=IDS)
    def release(self, rid: str) -> None:
        self._expire_model()
        assert run(self.ledger.release(rid)) is (self.model.pop(rid, None) is not None)
        assert run(self.ledger.release(rid)) is False

    @rule(rid=IDS, tokens=st.integers(0, 80))
    def grow(self, rid: str, tokens: int) -> None:
        self._expire_model()
        fits = (
            rid in self.model
            and self._reserved(self.model[rid][0]) + tokens <= self.capacity[self.model[rid][0]]
        )
        assert run(self.ledger.grow(rid, tokens)) is fits
        if fits:
            key, held, expiry = self.model[rid]
            self.model[rid] = (key, held + tokens, expiry)

    @rule(rid=IDS, tokens=st.integers(0, 80))
    def shrink(self, rid: str, tokens: int) -> None:
        self._expire_model()
        assert run(self.ledger.shrink(rid, tokens)) is (rid in self.model)
        if rid in self.model:
            key, held, expiry = self.model[rid]
            self.model[rid] = (key, held - min(held, tokens), expiry)

    @rule(rids=st.lists(IDS, max_size=4))
    def renew(self, rids: list[str]) -> None:
        self._expire_model()
        run(self.ledger.renew(rids))
        for rid in rids:
            if rid in self.model:
                key, held, _ = self.model[rid]
                self.model[rid] = (key, held, self.now_s + TTL_S)

    @rule(dt_s=st.sampled_from([0.5, 3.0, 9.9, 10.0, 25.0]))
    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s

    @rule()
    def expire(self) -> None:
        before = len(self.model)
        self._expire_model()
        assert run(self.ledger.expire()) == before - len(self.model)

    @invariant()
    def matches_model_within_capacity(self) -> None:
        self._expire_model()
        for key, u in run(self.ledger.usage()).items():
            assert 0 <= u.reserved_tokens <= u.capacity_tokens
            assert u.reserved_tokens == self._reserved(key)
            assert u.inflight == sum(1 for k, _, _ in self.model.values() if k == key)

    @rule()
    def release_everything_gives_zero(self) -> None:
        self._expire_model()
        for rid in list(self.model):
            assert run(self.ledger.release(rid))
        self.model.clear()
        assert all(u.reserved_tokens == 0 and u.inflight == 0 for u in run(self.ledger.usage()).values())

    def teardown(self) -> None:
        for rid in list(self.ledger.held()):
            run(self.ledger.release(rid))
        usage = run(self.ledger.usage())
        assert all(u.reserved_tokens == u.inflight == u.generated_tokens == 0 for u in usage.values())


LedgerMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLedgerMachine = LedgerMachine.TestCase
