"""GPU + layout → per-rank KV token capacity and per-step read times (the seed note's arithmetic).

Two layouts of one node of ``gpus`` GPUs:

* ``tp``: tensor parallelism everywhere. One engine, one KV pool; every GPU holds every token's KV
  (MLA: the whole latent; GQA: its share of KV heads). Weights are divided by ``gpus``.
* ``dp_ep``: data-parallel attention + expert-parallel MoE. ``gpus`` ranks, each with its own requests
  and pool; attention weights are replicated on every GPU, everything else is sharded.

All memory in bytes; GB means 1e9 bytes (an H200's "141 GB" is decimal).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from router.model import ModelArch
from router.units import GB, TB, dtype_bytes, round_down


class CapacityError(ValueError):
    """Inputs that cannot produce a usable layout (bad sizes, weights larger than memory)."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float


GPUS: dict[str, GpuSpec] = {
    "h200": GpuSpec("h200", 141 * GB, 4.8 * TB),
    "h100": GpuSpec("h100", 80 * GB, 3.35 * TB),
    "h800": GpuSpec("h800", 80 * GB, 3.35 * TB),
    "a100": GpuSpec("a100", 80 * GB, 2.039 * TB),
    "b200": GpuSpec("b200", 180 * GB, 8.0 * TB),
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise CapacityError(f"unknown GPU {name!r} (known: {', '.join(sorted(GPUS))})") from None


@dataclass(frozen=True, slots=True)
class PlanInputs:
    gpu: GpuSpec
    gpus: int = 8
    context_tokens: int = 4096
    kv_dtype: str = "bf16"
    weight_dtype: str = "fp8"
    mem_fraction: float = 0.92
    page_size: int = 1

    def validate(self) -> None:
        if self.gpus <= 0:
            raise CapacityError(f"--gpus must be positive, got {self.gpus}")
        if self.context_tokens <= 0:
            raise CapacityError(f"--context must be positive, got {self.context_tokens}")
        if self.page_size <= 0:
            raise CapacityError(f"--page-size must be positive, got {self.page_size}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise CapacityError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        dtype_bytes(self.kv_dtype)
        dtype_bytes(self.weight_dtype)


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    name: str
    ranks: int
    attention_tp: int
    kv_bytes_per_token_per_rank: int
    weights_bytes_per_gpu: float
    kv_bytes_per_gpu: float
    kv_tokens_per_rank: int
    kv_tokens_total: int
    seqs_at_context: int
    seqs_at_context_pooled: int
    kv_read_ms_per_step: float
    attn_weight_read_ms_per_step: float


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    attention: str
    gpu: str
    gpus: int
    context_tokens: int
    kv_dtype: str
    weight_dtype: str
    mem_fraction: float
    page_size: int
    usable_bytes_per_gpu: float
    hbm_bytes_per_s: float
    kv_bytes_per_token: int
    params_total: int
    attn_params_per_layer: int
    attn_weights_bytes_total: float
    capacity_ratio: float
    layouts: dict[str, LayoutPlan] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _layout(
    name: str,
    model: ModelArch,
    inp: PlanInputs,
    *,
    ranks: int,
    attention_tp: int,
    weights_per_gpu: float,
    ref_batch: int,
) -> LayoutPlan:
    usable = inp.gpu.memory_bytes * inp.mem_fraction
    kv_bytes_gpu = usable - weights_per_gpu
    if kv_bytes_gpu <= 0:
        short_gb = -kv_bytes_gpu / GB
        raise CapacityError(
            f"layout {name}: weights need {weights_per_gpu / GB:.1f} GB per GPU but only "
            f"{usable / GB:.1f} GB is usable ({inp.gpu.name} x {inp.mem_fraction:.2f}); "
            f"short by {short_gb:.1f} GB"
        )
    per_token = model.kv_bytes_per_token_per_rank(attention_tp, inp.kv_dtype)
    per_rank = round_down(int(kv_bytes_gpu // per_token), inp.page_size)
    total = per_rank * ranks
    # KV bytes one GPU reads per decode step for the reference batch (the batch that fills the TP pool):
    # under TP every GPU reads every sequence's cache; under DP each GPU reads only its 1/ranks share.
    seqs_per_gpu = ref_batch / ranks
    kv_read_bytes = seqs_per_gpu * inp.context_tokens * per_token
    attn_bytes_gpu = model.attn_params_total() * dtype_bytes(inp.weight_dtype) / attention_tp
    return LayoutPlan(
        name=name,
        ranks=ranks,
        attention_tp=attention_tp,
        kv_bytes_per_token_per_rank=per_token,
        weights_bytes_per_gpu=weights_per_gpu,
        kv_bytes_per_gpu=kv_bytes_gpu,
        kv_tokens_per_rank=per_rank,
        kv_tokens_total=total,
        seqs_at_context=ranks * (per_rank // inp.context_tokens),
        seqs_at_context_pooled=total // inp.context_tokens,
        kv_read_ms_per_step=kv_read_bytes / inp.gpu.hbm_bytes_per_s * 1e3,
        attn_weight_read_ms_per_step=attn_bytes_gpu / inp.gpu.hbm_bytes_per_s * 1e3,
    )


def plan(model: ModelArch, inp: PlanInputs) -> Plan:
    """Capacity of the TP layout and of the DP-attention + EP layout for one node."""
    inp.validate()
    wbytes = dtype_bytes(inp.weight_dtype)
    params = model.params_total()
    attn_total = model.attn_params_total()
    tp_weights = params * wbytes / inp.gpus
    dp_weights = (params - attn_total) * wbytes / inp.gpus + attn_total * wbytes
    # The reference batch is what the TP layout can hold at this context; both layouts are read at it.
    tp_tokens = _layout(
        "tp", model, inp, ranks=1, attention_tp=inp.gpus, weights_per_gpu=tp_weights, ref_batch=1
    )
    ref_batch = max(1, tp_tokens.kv_tokens_total // inp.context_tokens)
    tp = _layout(
        "tp", model, inp, ranks=1, attention_tp=inp.gpus, weights_per_gpu=tp_weights, ref_batch=ref_batch
    )
    dp = _layout(
        "dp_ep", model, inp, ranks=inp.gpus, attention_tp=1, weights_per_gpu=dp_weights, ref_batch=ref_batch
    )
    return Plan(
        model=model.name,
        attention=model.attention.value,
        gpu=inp.gpu.name,
        gpus=inp.gpus,
        context_tokens=inp.context_tokens,
        kv_dtype=inp.kv_dtype,
        weight_dtype=inp.weight_dtype,
        mem_fraction=inp.mem_fraction,
        page_size=inp.page_size,
        usable_bytes_per_gpu=inp.gpu.memory_bytes * inp.mem_fraction,
        hbm_bytes_per_s=inp.gpu.hbm_bytes_per_s,
        kv_bytes_per_token=model.kv_bytes_per_token(inp.kv_dtype),
        params_total=params,
        attn_params_per_layer=model.attn_params_per_layer(),
        attn_weights_bytes_total=attn_total * wbytes,
        capacity_ratio=dp.kv_tokens_total / tp.kv_tokens_total if tp.kv_tokens_total else math.inf,
        layouts={"tp": tp, "dp_ep": dp},
    )
