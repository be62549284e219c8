"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) and GQA with q/k RMSNorm (Qwen3-MoE).

Packed sequences: `segment_ids` [batch, seq] (0 = padding) and per-segment `positions`; a token
attends only to earlier tokens of its own segment.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig
from composer_jax.model.layers import apply_rope, rms_norm, softmax_scale
from composer_jax.sharding import ShardingRules, constrain

# DeepSeek's q_a_layernorm / kv_a_layernorm are built with the RMSNorm default eps, not the
# config's rms_norm_eps (true of the reference and Hugging Face implementations alike).
LATENT_NORM_EPS = 1e-6


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """int32[batch, seq] segment ids -> int32[batch, seq] position of each token in its segment."""
    seq = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    is_start = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    start = jax.lax.cummax(jnp.where(is_start, idx, 0), axis=segment_ids.ndim - 1)
    return idx - start


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
    """int32[batch, seq] -> bool[batch, 1, q_seq, k_seq]: causal and within one segment."""
    seq = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same)[:, None]


def _softmax_attend(scores: jax.Array, mask: jax.Array) -> jax.Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def mla(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, cfg: ModelConfig,
        rules: ShardingRules | None = None) -> jax.Array:
    """Multi-head latent attention. x: [batch, seq, embed] -> [batch, seq, embed].

    Queries: optional low-rank path (q_a -> RMSNorm -> q_b). Keys/values: a shared latent
    c = RMSNorm(x W_kv_a[:kv_lora]) expanded per head by W_kv_b into k_nope and v, plus one rotary
    key k_rope = rope(x W_kv_a[kv_lora:]) shared by all heads.
    """
    dt = x.dtype
    nope = cfg.qk_nope_head_dim
    if cfg.q_lora_rank:
        q_lat = rms_norm(x @ p["q_a"].astype(dt), p["q_a_norm"], LATENT_NORM_EPS)
        q = jnp.einsum("bsr,rhk->bshk", q_lat, p["q_b"].astype(dt))
    else:
        q = jnp.einsum("bsd,dhk->bshk", x, p["q"].astype(dt))
    q = constrain(q, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    kv = x @ p["kv_a"].astype(dt)
    latent = rms_norm(kv[..., : cfg.kv_lora_rank], p["kv_a_norm"], LATENT_NORM_EPS)
    k_rope = kv[..., cfg.kv_lora_rank:][:, :, None, :]
    kvb = jnp.einsum("bsr,rhk->bshk", latent, p["kv_b"].astype(dt))
    kvb = constrain(kvb, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
    k_rope = apply_rope(k_rope, cos, sin, cfg.rope_interleave)[:, :, 0, :]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=jnp.float32)
    scores = scores + jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope, preferred_element_type=jnp.float32)
    probs = _softmax_attend(scores * softmax_scale(cfg), mask).astype(dt)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    out = constrain(out, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return jnp.einsum("bqhd,hdm->bqm", out, p["o"].astype(dt))


def gqa(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, cfg: ModelConfig,
        rules: ShardingRules | None = None) -> jax.Array:
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3). x: [batch, seq, embed]."""
    dt = x.dtype
    q = jnp.einsum("bsd,dhk->bshk", x, p["q"].astype(dt))
    k = jnp.einsum("bsd,dhk->bshk", x, p["k"].astype(dt))
    v = jnp.einsum("bsd,dhk->bshk", x, p["v"].astype(dt))
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin, cfg.rope_interleave)
    k = apply_rope(k, cos, sin, cfg.rope_interleave)
    b, s, h, hd = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, s, kvh, h // kvh, hd)
    scores = jnp.einsum("bqngd,bknd->bngqk", q, k, preferred_element_type=jnp.float32)
    probs = _softmax_attend(scores * softmax_scale(cfg), mask[:, :, None]).astype(dt)
    out = jnp.einsum("bngqk,bknd->bqngd", probs, v).reshape(b, s, h, hd)
    out = constrain(out, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return jnp.einsum("bqhd,hdm->bqm", out, p["o"].astype(dt))


def attention(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, cfg: ModelConfig,
              rules: ShardingRules | None = None) -> jax.Array:
    fn = mla if cfg.attention_type == "mla" else gqa
    return fn(p, x, cos, sin, mask, cfg, rules)
