"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) and GQA with q/k RMSNorm (Qwen3-MoE).

Packed sequences: `segment_ids` [batch, seq] (0 = padding) and per-segment `positions`; a token
attends only to earlier tokens of its own segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig
from composer_jax.model.context_parallel import context_axes, context_parallel_attention
from composer_jax.model.flash import blockwise_attention
from composer_jax.model.layers import apply_rope, linear, rms_norm, softmax_scale
from composer_jax.model.masks import Visibility, causal_segment_mask, segment_positions  # noqa: F401  (re-exported)
from composer_jax.sharding import MeshRules, constrain

# DeepSeek's q_a_layernorm / kv_a_layernorm are built with the RMSNorm default eps, not the
# config's rms_norm_eps (true of the reference and Hugging Face implementations alike).
LATENT_NORM_EPS = 1e-6


def _softmax_attend(scores: jax.Array, mask: jax.Array) -> jax.Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def _attend(q, k, v, vis: Visibility, cfg: ModelConfig):
    """q [b, q, h, d], k [b, k, h, d], v [b, k, h, dv] -> [b, q, h, dv] under `vis`."""
    if cfg.attention_impl == "dense":
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        probs = _softmax_attend(scores * softmax_scale(cfg), vis.mask()).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    out = blockwise_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        vis.q_seg,
        vis.q_ord,
        vis.k_seg,
        vis.k_ord,
        scale=softmax_scale(cfg),
        block_q=cfg.attn_block_q,
        block_k=cfg.attn_block_k,
        causal_skip=vis.causal_skip,
    )
    return heads_first(out)


def _mla_core(q_nope, q_rope, latent, k_rope, kv_b, vis: Visibility, cfg: ModelConfig):
    """Attention of MLA queries over latent keys. q_*: [b, q, h, *]; latent: [b, k, kv_lora];
    k_rope: [b, k, rope] (already rotated, shared by the heads); kv_b: [kv_lora, h, nope + v].
    Returns [b, q, h, v_head_dim]. The rotary key is broadcast to every head and joined to the
    per-head key, so q.k is one product over nope + rope numbers."""
    nope = cfg.qk_nope_head_dim
    kvb = linear(latent, kv_b)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :].astype(k_nope.dtype), k_nope.shape[:3] + k_rope.shape[-1:])
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    return _attend(q, k, v, vis, cfg)


def _gqa_core(q, k, v, vis: Visibility, cfg: ModelConfig):
    """q: [b, q, h, d]; k, v: [b, k, kvh, d] -> [b, q, h, d]. Key/value heads are repeated for
    their query group."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return _attend(q, k, v, vis, cfg)


def _local_visibility(ctx: dict) -> Visibility:
    seg, order = ctx["segment_ids"], ctx["order"]
    return Visibility(seg, order, seg, order, causal_skip=ctx.get("layout") == "contiguous")


def mla(p: dict, x: jax.Array, ctx: dict, cfg: ModelConfig, sharding: MeshRules | None = None) -> jax.Array:
    """Multi-head latent attention. x: [batch, seq, embed] -> [batch, seq, embed].

    Queries: optional low-rank path (q_a -> RMSNorm -> q_b). Keys/values: a shared latent
    c = RMSNorm(x W_kv_a[:kv_lora]) expanded per head by W_kv_b into k_nope and v, plus one rotary
    key k_rope = rope(x W_kv_a[kv_lora:]) shared by all heads.
    """
    nope = cfg.qk_nope_head_dim
    if cfg.q_lora_rank:
        q_lat = rms_norm(linear(x, p["q_a"]), p["q_a_norm"], LATENT_NORM_EPS)
        q = linear(q_lat, p["q_b"])
    else:
        q = linear(x, p["q"])
    q = constrain(q, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    kv = linear(x, p["kv_a"])
    latent = rms_norm(kv[..., : cfg.kv_lora_rank], p["kv_a_norm"], LATENT_NORM_EPS)
    q_rope = apply_rope(q_rope, ctx["cos"], ctx["sin"], cfg.rope_interleave)
    k_rope = apply_rope(kv[..., cfg.kv_lora_rank :][:, :, None, :], ctx["cos"], ctx["sin"], cfg.rope_interleave)[
        :, :, 0
    ]
    if sharding is not None and context_axes(sharding):
        out = context_parallel_attention(
            _mla_core, (q_nope, q_rope), (latent, k_rope), (p["kv_b"],), ctx, cfg, sharding
        )
    else:
        out = _mla_core(q_nope, q_rope, latent, k_rope, p["kv_b"], _local_visibility(ctx), cfg)
    out = constrain(out, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return linear(out, p["o"], contract=2)


def gqa(p: dict, x: jax.Array, ctx: dict, cfg: ModelConfig, sharding: MeshRules | None = None) -> jax.Array:
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3). x: [batch, seq, embed]."""
    q = linear(x, p["q"])
    k = linear(x, p["k"])
    v = linear(x, p["v"])
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, ctx["cos"], ctx["sin"], cfg.rope_interleave)
    k = apply_rope(k, ctx["cos"], ctx["sin"], cfg.rope_interleave)
    q = constrain(q, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    if sharding is not None and context_axes(sharding):
        out = context_parallel_attention(_gqa_core, (q,), (k, v), (), ctx, cfg, sharding)
    else:
        out = _gqa_core(q, k, v, _local_visibility(ctx), cfg)
    out = constrain(out, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return linear(out, p["o"], contract=2)


def attention(p: dict, x: jax.Array, ctx: dict, cfg: ModelConfig, sharding: MeshRules | None = None) -> jax.Array:
    """ctx: cos/sin [batch, seq, rope/2], segment_ids, order [batch, seq], layout ("contiguous": order
    increases along the sequence | "zigzag" | "any")."""
    fn = mla if cfg.attention_type == "mla" else gqa
    return fn(p, x, ctx, cfg, sharding)
