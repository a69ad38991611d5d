"""Model architecture → KV cache bytes per token and parameter counts.

MLA (DeepSeek-V2/V3) caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per layer, shared
by every head, so tensor parallelism cannot divide it. GQA/MHA cache K and V per KV head, which TP divides.
Everything is derived from the fields of a Hugging Face ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any

from router.units import dtype_bytes


class AttentionKind(StrEnum):
    MLA = "mla"
    GQA = "gqa"
    MHA = "mha"


class ModelConfigError(ValueError):
    """A config.json that cannot describe a model (missing or invalid field)."""


PRESETS: dict[str, str] = {
    "deepseek-v3": "deepseek-v3.json",
    "llama-3.3-70b": "llama-3.3-70b.json",
}


@dataclass(frozen=True, slots=True)
class ModelArch:
    """The architecture fields that decide KV size and weight size."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_context_tokens: int
    tie_word_embeddings: bool = False
    # MLA
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0

    @property
    def attention(self) -> AttentionKind:
        if self.kv_lora_rank > 0:
            return AttentionKind.MLA
        if self.num_kv_heads < self.num_attention_heads:
            return AttentionKind.GQA
        return AttentionKind.MHA

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    # ---- KV cache -------------------------------------------------------------------------------
    def kv_elements_per_token_per_layer(self) -> int:
        """Cached elements per token per layer, over the whole model (all heads)."""
        if self.attention is AttentionKind.MLA:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """One token's whole cache, all layers, in bytes."""
        return int(self.kv_elements_per_token_per_layer() * self.num_layers * dtype_bytes(kv_dtype))

    def kv_bytes_per_token_per_rank(self, tp: int, kv_dtype: str = "bf16") -> int:
        """Bytes one GPU holds per token when attention runs with tensor parallelism ``tp``.

        MLA: the latent is shared by every head, so each TP rank keeps all of it. GQA/MHA: KV heads are
        split across ranks; with fewer KV heads than ranks each head is replicated (ceil).
        """
        if tp <= 0:
            raise ValueError(f"tp must be positive, got {tp}")
        if self.attention is AttentionKind.MLA:
            return self.kv_bytes_per_token(kv_dtype)
        heads_per_rank = -(-self.num_kv_heads // tp)
        return int(2 * heads_per_rank * self.head_dim * self.num_layers * dtype_bytes(kv_dtype))

    # ---- parameters -----------------------------------------------------------------------------
    def attn_params_per_layer(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        if self.attention is AttentionKind.MLA:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank > 0:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk_head
            else:
                q = h * n * qk_head
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            o = n * self.v_head_dim * h
            return q + kv_a + kv_b + o
        q = h * n * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = n * self.head_dim * h
        return q + kv + o

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """One routed (or shared) expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def moe_layer_params(self) -> int:
        router_gate = self.n_routed_experts * self.hidden_size + self.n_routed_experts
        return (self.n_routed_experts + self.n_shared_experts) * self.expert_params() + router_gate

    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace if self.is_moe else self.num_layers

    def params_total(self) -> int:
        """All parameters of the main model (DeepSeek-V3's MTP module excluded, as in its 671B)."""
        dense_layers = self.num_dense_layers()
        moe_layers = self.num_layers - dense_layers
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return (
            self.num_layers * self.attn_params_per_layer()
            + dense_layers * self.dense_mlp_params()
            + moe_layers * self.moe_layer_params()
            + norms
            + embed
            + head
        )

    def attn_params_total(self) -> int:
        return self.num_layers * self.attn_params_per_layer()


def _req(cfg: dict[str, Any], key: str, source: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(f"{source}: missing field {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _opt(cfg: dict[str, Any], key: str, default: int, source: str) -> int:
    if cfg.get(key) is None:
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"{source}: field {key!r} must be a non-negative integer, got {value!r}")
    return value


def from_hf_config(cfg: dict[str, Any], name: str = "custom", source: str = "config.json") -> ModelArch:
    """Build a :class:`ModelArch` from the dict of a Hugging Face ``config.json``."""
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{source}: expected a JSON object")
    layers = _req(cfg, "num_hidden_layers", source)
    hidden = _req(cfg, "hidden_size", source)
    heads = _req(cfg, "num_attention_heads", source)
    mla = cfg.get("kv_lora_rank") is not None
    kv_heads = _opt(cfg, "num_key_value_heads", heads, source) or heads
    head_dim = _opt(cfg, "head_dim", hidden // heads, source) or hidden // heads
    n_routed = _opt(cfg, "n_routed_experts", 0, source) or _opt(cfg, "num_local_experts", 0, source)
    arch = ModelArch(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=_req(cfg, "vocab_size", source),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_req(cfg, "intermediate_size", source),
        max_context_tokens=_req(cfg, "max_position_embeddings", source),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        kv_lora_rank=_req(cfg, "kv_lora_rank", source) if mla else 0,
        q_lora_rank=_opt(cfg, "q_lora_rank", 0, source) if mla else 0,
        qk_nope_head_dim=_req(cfg, "qk_nope_head_dim", source) if mla else 0,
        qk_rope_head_dim=_req(cfg, "qk_rope_head_dim", source) if mla else 0,
        v_head_dim=_req(cfg, "v_head_dim", source) if mla else 0,
        n_routed_experts=n_routed,
        n_shared_experts=_opt(cfg, "n_shared_experts", 0, source),
        moe_intermediate_size=_req(cfg, "moe_intermediate_size", source) if n_routed else 0,
        num_experts_per_tok=_opt(cfg, "num_experts_per_tok", 0, source),
        first_k_dense_replace=_opt(cfg, "first_k_dense_replace", 0, source),
    )
    if arch.first_k_dense_replace > layers:
        raise ModelConfigError(f"{source}: field 'first_k_dense_replace' exceeds num_hidden_layers")
    return arch


def load_preset(name: str) -> ModelArch:
    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise ModelConfigError(f"unknown model preset {name!r} (known presets: {known})")
    text = resources.files("router").joinpath("presets").joinpath(PRESETS[name]).read_text(encoding="utf-8")
    return from_hf_config(json.loads(text), name=name, source=f"preset {name}")


def load_model(spec: str) -> ModelArch:
    """A preset name, or a path to a ``config.json`` (or a directory holding one)."""
    if spec in PRESETS:
        return load_preset(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        if spec.endswith(".json") or "/" in spec:
            raise ModelConfigError(f"model config file not found: {spec}")
        known = ", ".join(sorted(PRESETS))
        raise ModelConfigError(
            f"unknown model preset {spec!r} (known presets: {known}, or a config.json path)"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return from_hf_config(cfg, name=path.parent.name or path.stem, source=str(path))
