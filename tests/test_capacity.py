"""The seed note's capacity and bandwidth arithmetic for DeepSeek-V3 on 8xH200, to 0.1 %."""

from __future__ import annotations

import pytest

from router.capacity import CapacityError, GpuSpec, Plan, PlanInputs, get_gpu, plan
from router.model import load_preset
from router.units import GB, GiB, round_up

TOL = 1e-3  # 0.1 % on token counts


@pytest.fixture(scope="module")
def dsv3_plan() -> Plan:
    return plan(load_preset("deepseek-v3"), PlanInputs(gpu=get_gpu("h200")))


def test_usable_memory_is_decimal_gb(dsv3_plan: Plan) -> None:
    assert dsv3_plan.usable_bytes_per_gpu == pytest.approx(129.72 * GB)


def test_tp_layout_holds_652k_tokens(dsv3_plan: Plan) -> None:
    tp = dsv3_plan.layouts["tp"]
    assert tp.kv_bytes_per_token_per_rank == 70_272
    assert tp.weights_bytes_per_gpu / GB == pytest.approx(83.9, abs=0.05)
    assert tp.kv_bytes_per_gpu / GB == pytest.approx(45.8, abs=0.05)
    assert tp.kv_tokens_total == pytest.approx(652_393, rel=TOL)
    assert tp.seqs_at_context == 159


def test_dp_ep_layout_holds_4_08m_tokens(dsv3_plan: Plan) -> None:
    dp = dsv3_plan.layouts["dp_ep"]
    assert dp.ranks == 8
    assert dp.weights_bytes_per_gpu / GB == pytest.approx(93.9, abs=0.05)
    assert dp.kv_tokens_per_rank == pytest.approx(510_276, rel=TOL)
    assert dp.kv_tokens_total == pytest.approx(4_082_211, rel=TOL)
    assert dsv3_plan.capacity_ratio == pytest.approx(6.26, abs=0.01)


def test_sequences_cannot_straddle_ranks(dsv3_plan: Plan) -> None:
    dp = dsv3_plan.layouts["dp_ep"]
    assert dp.seqs_at_context == 8 * (dp.kv_tokens_per_rank // 4096) == 992
    assert dp.seqs_at_context_pooled == 996


def test_per_step_read_times(dsv3_plan: Plan) -> None:
    tp, dp = dsv3_plan.layouts["tp"], dsv3_plan.layouts["dp_ep"]
    assert tp.kv_read_ms_per_step == pytest.approx(9.53, abs=0.005)
    assert dp.kv_read_ms_per_step == pytest.approx(1.19, abs=0.005)
    assert tp.attn_weight_read_ms_per_step == pytest.approx(0.30, abs=0.005)
    assert dp.attn_weight_read_ms_per_step == pytest.approx(2.38, abs=0.005)


def test_fp8_kv_halves_bytes_and_raises_capacity() -> None:
    p = plan(load_preset("deepseek-v3"), PlanInputs(gpu=get_gpu("h200"), kv_dtype="fp8"))
    assert p.kv_bytes_per_token == 35_136
    bf16 = plan(load_preset("deepseek-v3"), PlanInputs(gpu=get_gpu("h200")))
    assert p.layouts["dp_ep"].kv_tokens_per_rank == pytest.approx(
        2 * bf16.layouts["dp_ep"].kv_tokens_per_rank, abs=2
    )


def test_llama_gqa_plan() -> None:
    p = plan(load_preset("llama-3.3-70b"), PlanInputs(gpu=get_gpu("h200")))
    assert p.kv_bytes_per_token == 327_680
    assert p.layouts["tp"].kv_bytes_per_token_per_rank == 40_960
    assert p.layouts["dp_ep"].kv_bytes_per_token_per_rank == 327_680
    # GQA gets no capacity win from DP attention: TP already divides its cache.
    assert p.capacity_ratio < 1.5


def test_gib_instead_of_gb_is_a_7_percent_error() -> None:
    # Reading an H200's "141 GB" as GiB inflates KV memory and so token capacity by several percent.
    wrong = GpuSpec("h200-gib", 141 * GiB, 4.8e12)
    right = plan(load_preset("deepseek-v3"), PlanInputs(gpu=get_gpu("h200")))
    bad = plan(load_preset("deepseek-v3"), PlanInputs(gpu=wrong))
    assert GiB / GB == pytest.approx(1.0737, abs=1e-4)
    assert bad.usable_bytes_per_gpu / right.usable_bytes_per_gpu == pytest.approx(GiB / GB)
    assert bad.layouts["tp"].kv_tokens_total > right.layouts["tp"].kv_tokens_total * 1.2


def test_page_size_rounds_capacity_down() -> None:
    p = plan(load_preset("deepseek-v3"), PlanInputs(gpu=get_gpu("h200"), page_size=64))
    per_rank = p.layouts["dp_ep"].kv_tokens_per_rank
    assert per_rank % 64 == 0
    assert 510_229 - 64 < per_rank <= 510_229
    assert round_up(per_rank + 1, 64) == per_rank + 64


def test_weights_that_do_not_fit_say_by_how_much() -> None:
    with pytest.raises(CapacityError, match=r"short by 10\.3 GB"):
        plan(load_preset("deepseek-v3"), PlanInputs(gpu=get_gpu("h100")))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpus", 0),
        ("gpus", -8),
        ("context_tokens", 0),
        ("page_size", 0),
        ("mem_fraction", 0.0),
        ("mem_fraction", 1.5),
    ],
)
def test_non_positive_sizes_are_refused(field: str, value: float) -> None:
    inputs = PlanInputs(gpu=get_gpu("h200"), **{field: value})  # type: ignore[arg-type]
    with pytest.raises(CapacityError):
        plan(load_preset("deepseek-v3"), inputs)


def test_unknown_gpu() -> None:
    with pytest.raises(CapacityError, match="known: a100, b200, h100, h200, h800"):
        get_gpu("tpu")
