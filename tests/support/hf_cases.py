"""Tiny random transformers models (float32, eval) for the parity tests, one per CASE.

Every case randomises what init leaves trivial (RMSNorm weights, the DeepSeek-V3 score-correction
bias) so a swapped norm or an ignored bias shows in the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
_DS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
_YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0
)

# name -> (config class, kwargs). Together they exercise every option the converter maps.
# name -> (transformers config class, config kwargs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # MLA with query LoRA, grouped noaux_tc routing with a random bias, dense first layer, 1 shared
    # expert, renormalised top-k, routed_scaling_factor 2.5, YaRN with both mscale corrections
    "v3_full": (
        "DeepseekV3Config",
        dict(
            _DS,
            num_hidden_layers=3,
            q_lora_rank=24,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=0.707),
        ),
    ),
    # Kimi-K2-like: one expert group, no query LoRA, no dense layer, 2 shared experts, no renormalisation,
    # non-interleaved rope
    "v3_plain": (
        "DeepseekV3Config",
        dict(
            _DS,
            num_hidden_layers=2,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            rope_interleave=False,
            rope_parameters=dict(rope_type="default", rope_theta=5000.0),
        ),
    ),
    # DeepSeek-V2-Lite-like: greedy softmax routing, YaRN with mscale = mscale_all_dim
    "v2_greedy": (
        "DeepseekV2Config",
        dict(
            _DS,
            num_hidden_layers=2,
            q_lora_rank=None,
            topk_method="greedy",
            first_k_dense_replace=1,
            n_shared_experts=2,
            routed_scaling_factor=1.0,
            rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707),
        ),
    ),
    # DeepSeek-V2-like: group-limited greedy (group score = max)
    "v2_group": (
        "DeepseekV2Config",
        dict(
            _DS,
            num_hidden_layers=2,
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            n_shared_experts=1,
            routed_scaling_factor=2.0,
        ),
    ),
    # Qwen3-MoE: GQA 4 heads / 2 kv heads with q/k norm, softmax top-k renormalised
    "qwen3_norm": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            initializer_range=0.1,
            max_position_embeddings=256,
        ),
    ),
    # Qwen3-MoE: multi-query (1 kv head), dense first layer, no renormalisation, YaRN without mscale
    "qwen3_dense_first": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            initializer_range=0.1,
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=64),
        ),
    ),
}

MODEL_CLASSES = {
    "DeepseekV3Config": "DeepseekV3ForCausalLM",
    "DeepseekV2Config": "DeepseekV2ForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
}


def build_model(name: str, seed: int = 0):
    cls_name, kwargs = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, cls_name)(dtype="float32", **kwargs)
    model = getattr(transformers, MODEL_CLASSES[cls_name])(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


class Built:
    def __init__(self, model, path: Path):
        self.model, self.path = model, path

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def save_tiny_deepseek_v3(out: Path, vocab: int, max_positions: int = 256, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V3-layout checkpoint (MLA without query LoRA, one dense layer, 8 experts,
    top-2, one shared expert) of `vocab` tokens, random weights, saved by transformers at `out`."""
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in _DS.items() if k not in ("vocab_size", "max_position_embeddings", "initializer_range")}
    config = transformers.DeepseekV3Config(
        dtype="float32",
        **kwargs,
        vocab_size=vocab,
        num_hidden_layers=2,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        max_position_embeddings=max_positions,
    )
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(out)
    return out
