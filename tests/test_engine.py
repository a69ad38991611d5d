"""The DP-attention engine model: seed bandwidth terms, page accounting, lockstep, preemption, calibration."""

from __future__ import annotations

import pytest

from loadtest.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    PromptTooLong,
    RankOutOfRange,
    RankUnavailable,
    RankWork,
    StepModel,
    TokenEvent,
)
from loadtest.engine_model import capacity_plan

MS = 1e-3


def _cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"dp_size": 2, "kv_tokens_per_rank": 1000, "prefill_chunk_tokens": 1024}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _run(engine: Engine, max_steps: int = 100_000) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    for _ in range(max_steps):
        if engine.idle:
            return events
        events.extend(engine.step().events)
    raise AssertionError("engine did not drain")


# ---- the seed's bandwidth floor ------------------------------------------------------------------------
def test_seed_bandwidth_terms_exact() -> None:
    p = capacity_plan()
    cfg = EngineConfig.for_engine("sglang")
    m = cfg.step
    assert p.kv_bytes_per_token == m.kv_bytes_per_token == 70_272
    assert cfg.kv_tokens_per_rank == p.layouts["dp_ep"].kv_tokens_per_rank == 510_229
    tp_batch = p.layouts["tp"].kv_tokens_total // 4096  # the TP-full batch at 4K contexts: 159
    assert tp_batch == 159
    assert round(m.kv_read_floor_s(tp_batch * 4096) / MS, 2) == 9.53  # TP: every GPU reads every sequence
    assert round(m.kv_read_floor_s(tp_batch * 4096 / 8) / MS, 2) == 1.19  # DP: 1/8 of them
    assert round(m.attn_weight_read_floor_s() / MS, 2) == 2.38  # DP: replicated attention weights
    assert round(m.attn_weight_read_floor_s(8) / MS, 2) == 0.30  # TP8
    assert m.kv_read_floor_s(tp_batch * 4096) / MS == pytest.approx(p.layouts["tp"].kv_read_ms_per_step)
    assert m.attn_weight_read_floor_s() / MS == pytest.approx(p.layouts["dp_ep"].attn_weight_read_ms_per_step)


def test_capacity_scale_and_pages() -> None:
    cfg = EngineConfig.for_engine("vllm", capacity_scale=0.01, page_size=64)
    assert cfg.kv_tokens_per_rank % 64 == 0
    assert 5000 <= cfg.kv_tokens_per_rank <= 5103
    assert cfg.mixed_chunk and cfg.preempt_mode == "vllm"
    assert EngineConfig.for_engine("sglang", dp_size=4).prefill_chunk_tokens == 2048


# ---- calibration (calibration.md §2.5) -----------------------------------------------------------------
def test_pure_decode_128_seqs_at_2k() -> None:
    t = StepModel().step_s([RankWork(128, 128 * 2048)] * 8)
    assert t == pytest.approx(0.065, rel=0.20)


def test_one_sequence_seven_idle_ranks() -> None:
    t = StepModel().step_s([RankWork(1, 2048), *[RankWork()] * 7])
    assert t == pytest.approx(0.031, rel=0.25)


def test_two_seqs_per_rank_at_65k() -> None:
    t = StepModel().step_s([RankWork(2, 2 * 65_536)] * 8)
    assert t == pytest.approx(0.036, rel=0.25)


def test_prefill_only_2k_prompts_node_throughput() -> None:
    cfg = EngineConfig.for_engine("sglang", token_events=False)
    eng = Engine(cfg)
    for i in range(8 * 4):
        eng.submit(EngineRequest(f"r{i}", 2048, 1), rank=i % 8)
    _run(eng)
    tok_per_s = 8 * 4 * 2048 / eng.clock_s
    assert tok_per_s == pytest.approx(18_000, rel=0.20)


def test_step_monotonic_in_max_context_not_mean() -> None:
    m = StepModel()
    balanced = m.step_s([RankWork(16, 16 * 8000)] * 8)
    skewed = m.step_s([RankWork(16, 16 * 8000 * 8), *[RankWork(16, 0)] * 7])  # same total K
    assert skewed > balanced
    prev = 0.0
    for k in (0, 10_000, 100_000, 400_000):
        t = m.step_s([RankWork(16, k), *[RankWork(16, 1000)] * 7])
        assert t > prev
        prev = t


def test_prefill_on_one_rank_slows_every_rank() -> None:
    m = StepModel()
    decode = [RankWork(32, 32 * 2048)] * 8
    with_prefill = [RankWork(32, 32 * 2048, 1024, 1024 * 1023 // 2), *decode[1:]]
    assert m.step_s(with_prefill) > m.step_s(decode) + 0.05  # ~100 ms: 1,024 × (50 + 48) µs


# ---- engine behaviour ----------------------------------------------------------------------------------
def test_page_accounting_and_release() -> None:
    eng = Engine(_cfg(page_size=16, kv_tokens_per_rank=1600))
    eng.submit(EngineRequest("a", 100, 50, output_tokens=20), rank=1)
    eng.step()  # whole prompt in one chunk: prompt + first token = 101 tokens → 7 pages
    load = eng.rank_loads()[1]
    assert load.used_tokens == 112 and load.running == 1 and load.context_tokens == 101
    for _ in range(11):  # 101 + 11 = 112 tokens: still 7 pages
        eng.step()
    assert eng.rank_loads()[1].used_tokens == 112
    eng.step()  # the 113th token opens page 8
    assert eng.rank_loads()[1].used_tokens == 128
    events = _run(eng)
    assert events[-1].finished and events[-1].finish_reason == "stop" and events[-1].generated_tokens == 20
    assert all(ld.used_tokens == 0 and ld.context_tokens == 0 for ld in eng.rank_loads())


def test_output_length_independent_of_max_tokens() -> None:
    eng = Engine(_cfg())
    eng.submit(EngineRequest("own", 10, 500, output_tokens=7), rank=0)
    eng.submit(EngineRequest("cap", 10, 5, output_tokens=7), rank=0)
    eng.submit(EngineRequest("eos", 10, 9, output_tokens=3, ignore_eos=True), rank=1)
    done = {e.rid: e for e in _run(eng) if e.finished}
    assert (done["own"].generated_tokens, done["own"].finish_reason) == (7, "stop")
    assert (done["cap"].generated_tokens, done["cap"].finish_reason) == (5, "length")
    assert (done["eos"].generated_tokens, done["eos"].finish_reason) == (9, "length")


def test_every_token_reported_once() -> None:
    eng = Engine(_cfg(prefill_chunk_tokens=64))
    for i in range(6):
        eng.submit(EngineRequest(f"r{i}", 100 + 30 * i, 40, output_tokens=10 + i))
    per: dict[str, int] = {}
    firsts = 0
    for e in _run(eng):
        per[e.rid] = per.get(e.rid, 0) + e.new_tokens
        firsts += e.first_token
    assert per == {f"r{i}": 10 + i for i in range(6)} and firsts == 6


def test_lockstep_long_context_rank_slows_everyone_and_idle_ranks_pay() -> None:
    cfg = EngineConfig.for_engine("sglang", dp_size=8)
    eng = Engine(cfg)
    eng.submit(EngineRequest("short", 100, 1000), rank=0)
    eng.step()
    short_step = eng.step().duration_s  # one decoder, seven idle ranks: still a full step
    assert short_step > 0.020
    eng.submit(EngineRequest("long", 100_000, 1000), rank=5)
    while eng.rank_loads()[5].decode_seqs == 0:
        eng.step()
    r = eng.step()
    assert {e.rank for e in r.events} == {0, 5}
    assert r.duration_s > short_step + 100_000 * 20e-9  # rank 0's token waited for rank 5's long read


def test_nobody_steps_when_idle() -> None:
    eng = Engine(_cfg())
    assert eng.idle and eng.step().duration_s == 0.0 and eng.steps == 0


def test_no_preemption_when_it_fits() -> None:
    eng = Engine(_cfg(kv_tokens_per_rank=1000))
    for i in range(4):
        eng.submit(EngineRequest(f"r{i}", 100, 100, output_tokens=100), rank=0)  # 4 × 200 ≤ 1000
    _run(eng)
    assert eng.preemptions_total == 0


@pytest.mark.parametrize("mode", ["sglang", "vllm"])
def test_preemption_when_overcommitted(mode: str) -> None:
    eng = Engine(_cfg(kv_tokens_per_rank=1000, preempt_mode=mode, mixed_chunk=mode == "vllm"))
    for i in range(4):
        eng.submit(EngineRequest(f"r{i}", 200, 300, output_tokens=300), rank=0)  # 4 × 500 > 1000
    events = _run(eng)
    assert eng.preemptions_total > 0
    assert eng.rank_loads()[0].preemptions_total == eng.preemptions_total
    done = {e.rid: e.generated_tokens for e in events if e.finished}
    assert done == {f"r{i}": 300 for i in range(4)}  # preempted work is redone, never lost
    assert eng.rank_loads()[0].used_tokens == 0


def test_admission_waits_for_pages_fifo() -> None:
    eng = Engine(_cfg(kv_tokens_per_rank=500))
    eng.submit(EngineRequest("big", 400, 10), rank=0)
    eng.submit(EngineRequest("next", 200, 10), rank=0)
    eng.submit(EngineRequest("small", 10, 10), rank=0)  # would fit, but FIFO keeps it behind "next"
    eng.step()
    assert eng.running_rids(0) == ["big"] and eng.waiting_rids(0) == ["next", "small"]
    loads = eng.rank_loads()[0]
    assert loads.waiting_tokens == 210 and loads.prefill_tokens_pending == 210


def test_errors_and_abort() -> None:
    eng = Engine(_cfg())
    with pytest.raises(RankOutOfRange, match=r"routed_dp_rank=2 out of range \[0, 2\)"):
        eng.submit(EngineRequest("x", 10, 10), rank=2)
    with pytest.raises(PromptTooLong):
        eng.submit(EngineRequest("y", 1000, 10))
    eng.submit(EngineRequest("a", 10, 100), rank=1)
    eng.step()
    assert eng.rank_loads()[1].used_tokens == 11
    assert eng.abort("a") and not eng.abort("a")
    assert eng.idle and eng.rank_loads()[1].used_tokens == 0


def test_rank_choice_round_robin_and_vllm_score() -> None:
    sg = Engine(_cfg(dp_size=3))
    assert [sg.submit(EngineRequest(f"r{i}", 10, 10)) for i in range(4)] == [0, 1, 2, 0]
    vl = Engine(_cfg(dp_size=3, preempt_mode="vllm"))
    vl.submit(EngineRequest("p0", 10, 10), rank=0)
    vl.submit(EngineRequest("p1", 10, 10), rank=0)
    vl.submit(EngineRequest("p2", 10, 10), rank=1)
    assert vl.submit(EngineRequest("free", 10, 10)) == 2  # the least loaded rank


def test_faults_down_and_slow_rank() -> None:
    eng = Engine(_cfg(dp_size=2))
    eng.submit(EngineRequest("a", 10, 100), rank=1)
    gone = eng.set_down(1)
    assert [(e.rid, e.finish_reason) for e in gone] == [("a", "abort")] and eng.idle
    with pytest.raises(RankUnavailable):
        eng.submit(EngineRequest("b", 10, 10), rank=1)
    assert eng.submit(EngineRequest("c", 10, 10)) == 0
    eng.set_down(1, False)
    eng.step()
    base = eng.step().duration_s
    eng.set_slow(1, 3.0)  # an idle straggler still drags the lockstep step
    assert eng.step().duration_s > base
