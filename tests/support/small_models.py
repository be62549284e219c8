"""Attention variants of the small test models, shared by the cache, sampler and speculative tests
(`from support.small_models import ...`)."""

from __future__ import annotations

import dataclasses

import composer_jax as cj
from composer_jax.config import RopeScalingConfig

# YaRN over a 16-position original window: positions past it exercise the scaled rotary
YARN = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)


def mla_yarn(cfg: cj.ModelConfig) -> cj.ModelConfig:
    """`cfg` with MLA without q_lora and YaRN positions."""
    return dataclasses.replace(cfg, q_lora_rank=0, rope_scaling=YARN)


def gqa(cfg: cj.ModelConfig) -> cj.ModelConfig:
    """`cfg` with grouped-query attention (4 query heads over 2 KV heads of 16) and a softmax router."""
    return dataclasses.replace(
        cfg,
        attention_type="gqa",
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        score_func="softmax",
        topk_method="greedy",
        rope_interleave=False,
    )
