"""config.json spellings found on the hub map to the intended ModelConfig (no tensors involved).

Expected values are the published configs' own numbers (DeepSeek-V3, Kimi K2, DeepSeek-V2-Lite)."""

from __future__ import annotations

import pytest

from composer_jax.config import RopeScalingConfig
from composer_jax.hf.config import hf_config_from_model, model_config_from_hf

# DeepSeek-V3's hub config.json (remote-code spelling: rope_scaling + top-level rope_theta)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "ep_size": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def test_deepseek_v3_hub_config():
    cfg, info = model_config_from_hf(DEEPSEEK_V3)
    assert (cfg.attention_type, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_interleave) == ("mla", 1536, 512, True)
    assert (cfg.num_experts, cfg.num_shared_experts, cfg.first_k_dense, cfg.num_dense_layers) == (256, 1, 3, 3)
    assert (cfg.score_func, cfg.topk_method, cfg.n_group, cfg.topk_group) == ("sigmoid", "noaux_tc", 8, 4)
    assert cfg.rope_scaling == RopeScalingConfig(
        type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert cfg.param_dtype == "bfloat16" and cfg.num_mtp_layers == 0
    assert info.requested_mtp_layers == 1 and info.fp8_block == (128, 128)


def test_kimi_k2_config():
    """Kimi K2: model_type kimi_k2 (DeepSeek-V3 code), one expert group, 384 experts, 1 dense layer."""
    k2 = dict(
        DEEPSEEK_V3,
        model_type="kimi_k2",
        vocab_size=163840,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=384,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        num_nextn_predict_layers=0,
        rope_theta=50000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    )
    cfg, info = model_config_from_hf(k2)
    assert (cfg.num_experts, cfg.n_group, cfg.first_k_dense, cfg.rope_theta) == (384, 1, 1, 50000.0)
    assert cfg.rope_scaling.beta_fast == 1.0 and info.requested_mtp_layers == 0
    assert hf_config_from_model(cfg)["model_type"] == "deepseek_v3"


def test_deepseek_v2_lite_config():
    lite = {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    }
    cfg, _ = model_config_from_hf(lite)
    assert (cfg.q_lora_rank, cfg.score_func, cfg.topk_method, cfg.norm_topk_prob) == (0, "softmax", "greedy", False)
    assert hf_config_from_model(cfg)["topk_method"] == "greedy"


def test_v2_norm_topk_prob_is_dropped_with_a_warning(caplog):
    lite = dict(
        model_type="deepseek_v2",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        kv_lora_rank=4,
        qk_rope_head_dim=2,
        v_head_dim=2,
        qk_nope_head_dim=2,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    with caplog.at_level("WARNING"):
        cfg, _ = model_config_from_hf(lite)
    assert cfg.norm_topk_prob is False and "norm_topk_prob=true is ignored" in caplog.text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dtype_override(dtype):
    cfg, _ = model_config_from_hf(DEEPSEEK_V3, dtype=dtype)
    assert cfg.param_dtype == cfg.compute_dtype == dtype
