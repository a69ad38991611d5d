"""KV bytes per token and parameter counts, pinned to the seed note's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.model import AttentionKind, ModelConfigError, from_hf_config, load_model, load_preset


def test_deepseek_v3_mla_latent_is_576_wide_times_61_layers() -> None:
    m = load_preset("deepseek-v3")
    assert m.attention is AttentionKind.MLA
    assert m.kv_elements_per_token_per_layer() == 512 + 64
    assert m.kv_bytes_per_token("bf16") == 70_272
    assert m.kv_bytes_per_token("fp8") == 35_136


def test_mla_cache_is_not_divided_by_tensor_parallelism() -> None:
    m = load_preset("deepseek-v3")
    assert [m.kv_bytes_per_token_per_rank(tp) for tp in (1, 2, 8)] == [70_272] * 3


def test_forgetting_the_rope_key_is_an_11_percent_error() -> None:
    # The seed's "common mistake": counting the latent at 512 wide.
    m = load_preset("deepseek-v3")
    assert m.kv_bytes_per_token() / (512 * 61 * 2) == pytest.approx(1.125)


def test_gqa_llama_divides_by_tp() -> None:
    m = load_preset("llama-3.3-70b")
    assert m.attention is AttentionKind.GQA
    assert m.kv_bytes_per_token("bf16") == 327_680
    assert m.kv_bytes_per_token_per_rank(8) == 40_960
    # More ranks than KV heads: heads are replicated, not split further.
    assert m.kv_bytes_per_token_per_rank(16) == 40_960


def test_mha_when_kv_heads_equal_heads() -> None:
    cfg = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
    }
    m = from_hf_config(cfg)
    assert m.attention is AttentionKind.MHA
    assert m.kv_bytes_per_token("bf16") == 2 * 4 * 16 * 2 * 2


def test_deepseek_v3_parameter_counts() -> None:
    m = load_preset("deepseek-v3")
    assert m.attn_params_per_layer() == 187_107_328  # 187.1M
    assert round(m.params_total() / 1e9, 1) == 671.0
    assert round(m.attn_params_total() * 1 / 1e9, 1) == 11.4  # GB in FP8
    assert round(m.num_dense_layers() * m.dense_mlp_params() / 1e9, 2) == 1.19


def test_llama_parameter_count() -> None:
    assert round(load_preset("llama-3.3-70b").params_total() / 1e9, 1) == 70.6


def test_config_json_missing_field_is_named(tmp_path: Path) -> None:
    cfg = json.loads(Path("router/presets/deepseek-v3.json").read_text())
    del cfg["qk_rope_head_dim"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim"):
        load_model(str(path))


def test_config_json_directory_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(Path("router/presets/llama-3.3-70b.json").read_text())
    assert load_model(str(tmp_path)).kv_bytes_per_token() == 327_680


@pytest.mark.parametrize("bad", [0, -3, "8", True])
def test_config_json_rejects_non_positive_or_non_int(bad: object) -> None:
    cfg = json.loads(Path("router/presets/llama-3.3-70b.json").read_text())
    cfg["num_hidden_layers"] = bad
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        from_hf_config(cfg)


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ModelConfigError, match=r"deepseek-v3, llama-3\.3-70b"):
        load_model("gpt-5")


def test_invalid_json_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model(str(path))
