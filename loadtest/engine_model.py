"""Step-time model of a DP-attention + EP MoE node (DeepSeek-V3 on 8×H200 by default).

Two layers (DESIGN.md §5, reference/calibration.md §2.2/§2.3):

* the seed's **bandwidth floor**: KV bytes and attention-weight bytes over raw HBM bandwidth, exact
  (9.53 / 1.19 ms of KV, 2.38 / 0.30 ms of attention weights at the seed's reference batch);
* the **calibrated total** that the engine's step clock uses::

    t_step = t_fixed + max_r[t_dense(B_r) + t_attn(K_r) + t_prefill_local_r] + t_moe(T)
             + t_prefill_shared + t_comm(max_r B_r)

  B_r decode sequences, K_r cached tokens they read, P_r prefill tokens on rank r; T all tokens of the
  step over all ranks (an idle rank's dummy batch counts ``idle_dummy_tokens``). The per-rank term never
  goes below the bandwidth floor (with the default constants it is always above it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from router.capacity import Plan, PlanInputs, get_gpu, plan
from router.model import load_model


@dataclass(frozen=True, slots=True)
class RankWork:
    """What one rank does in one step: ``decode_seqs`` (B_r), ``context_tokens`` they attend over (K_r),
    ``prefill_tokens`` (P_r) and the sum of those prefill tokens' positions (causal attention cost)."""

    decode_seqs: int = 0
    context_tokens: int = 0
    prefill_tokens: int = 0
    prefill_pos_sum_tokens: int = 0
    slow_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class StepModel:
    """Calibrated constants (units in the names). Defaults: DeepSeek-V3, 8×H200, DP8 + EP8, BF16 KV."""

    fixed_s: float = 0.018
    hbm_bytes_per_s: float = 4.8e12
    hbm_eff_weights: float = 0.70
    attn_s_per_cached_token: float = 28.3e-9
    dense_weight_bytes: float = 15e9
    dense_s_per_token: float = 71.5e-6
    experts_per_rank: int = 32
    experts_total: int = 256
    experts_per_token: int = 8
    moe_layers: int = 58
    expert_bytes: float = 44.04e6
    comm_base_s_per_layer: float = 10e-6
    comm_s_per_token_per_layer: float = 1.5e-6
    comm_overlap_phi: float = 1.0
    prefill_local_s_per_token: float = 50e-6
    prefill_attn_s_per_token_pos: float = 11.1e-9
    prefill_shared_s_per_token: float = 48e-6
    idle_dummy_tokens: int = 1
    # Bandwidth floor inputs (router.capacity): one token's whole latent, all attention weights of one GPU.
    kv_bytes_per_token: int = 70_272
    attn_weights_bytes: float = 11_413_547_008.0

    # ---- the seed's bandwidth floor ------------------------------------------------------------------
    def kv_read_floor_s(self, cached_tokens: float) -> float:
        """KV bytes of ``cached_tokens`` over raw HBM bandwidth."""
        return cached_tokens * self.kv_bytes_per_token / self.hbm_bytes_per_s

    def attn_weight_read_floor_s(self, attention_tp: int = 1) -> float:
        """Attention weights one GPU streams per step (all of them under DP attention, 1/TP under TP)."""
        return self.attn_weights_bytes / attention_tp / self.hbm_bytes_per_s

    # ---- calibrated terms ----------------------------------------------------------------------------
    @property
    def weights_bytes_per_s(self) -> float:
        return self.hbm_eff_weights * self.hbm_bytes_per_s

    def dense_s(self, decode_seqs: int) -> float:
        return max(self.dense_weight_bytes / self.weights_bytes_per_s, decode_seqs * self.dense_s_per_token)

    def attn_s(self, context_tokens: int) -> float:
        return context_tokens * self.attn_s_per_cached_token

    def experts_active(self, step_tokens: int) -> float:
        """Distinct local experts a rank reads per layer when ``step_tokens`` tokens route uniformly."""
        miss = 1.0 - self.experts_per_token / self.experts_total
        return self.experts_per_rank * (1.0 - miss**step_tokens)

    def moe_s(self, step_tokens: int) -> float:
        read_bytes = self.moe_layers * self.experts_active(step_tokens) * self.expert_bytes
        return read_bytes / self.weights_bytes_per_s

    def comm_s(self, max_decode_seqs: int) -> float:
        per_layer_s = self.comm_base_s_per_layer + self.comm_s_per_token_per_layer * max_decode_seqs
        return self.moe_layers * per_layer_s * self.comm_overlap_phi

    def prefill_local_s(self, prefill_tokens: int, prefill_pos_sum_tokens: int) -> float:
        return (
            prefill_tokens * self.prefill_local_s_per_token
            + prefill_pos_sum_tokens * self.prefill_attn_s_per_token_pos
        )

    def rank_s(self, w: RankWork) -> float:
        """The per-rank term inside max_r: dense + attention (never below the floor) + local prefill."""
        decode = self.dense_s(w.decode_seqs) + self.attn_s(w.context_tokens)
        floor = self.attn_weight_read_floor_s() + self.kv_read_floor_s(w.context_tokens)
        return (max(decode, floor) + self.prefill_local_s(w.prefill_tokens, w.prefill_pos_sum_tokens)) * (
            w.slow_factor
        )

    def step_s(self, ranks: Sequence[RankWork]) -> float:
        """Duration of one lockstep step of all ``ranks`` (idle ranks included: they pay the step)."""
        worst_s = 0.0
        tokens = 0
        max_b = 0
        prefill = 0
        for w in ranks:
            worst_s = max(worst_s, self.rank_s(w))
            busy = w.decode_seqs + w.prefill_tokens
            tokens += busy if busy else self.idle_dummy_tokens
            max_b = max(max_b, w.decode_seqs)
            prefill += w.prefill_tokens
        return (
            self.fixed_s
            + worst_s
            + self.moe_s(tokens)
            + prefill * self.prefill_shared_s_per_token
            + self.comm_s(max_b)
        )


def capacity_plan(model: str = "deepseek-v3", gpu: str = "h200", gpus: int = 8, page_size: int = 1) -> Plan:
    """The `kvrouter plan` arithmetic the engine's defaults come from."""
    return plan(load_model(model), PlanInputs(gpu=get_gpu(gpu), gpus=gpus, page_size=page_size))


def step_model_from_plan(p: Plan, **overrides: Any) -> StepModel:
    """Calibrated constants with the floor inputs (HBM, KV bytes, attention weights) from ``p``."""
    base = StepModel(
        hbm_bytes_per_s=p.hbm_bytes_per_s,
        kv_bytes_per_token=p.kv_bytes_per_token,
        attn_weights_bytes=p.attn_weights_bytes_total,
    )
    return replace(base, **overrides) if overrides else base
