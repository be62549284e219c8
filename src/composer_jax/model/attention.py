"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) and GQA with q/k RMSNorm (Qwen3-MoE).

Packed sequences: `segment_ids` [batch, seq] (0 = padding) and per-segment `positions`; a token
attends only to earlier tokens of its own segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange, repeat

from composer_jax.config import ModelConfig
from composer_jax.model import kv_cache
from composer_jax.model.context_parallel import context_axes, context_parallel_attention
from composer_jax.model.flash import blockwise_attention
from composer_jax.model.layers import apply_rope, linear, rms_norm, softmax_scale
from composer_jax.model.lora import adapted_linear, merge_nodes, merged_weight
from composer_jax.model.masks import AttentionContext, Visibility
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
    heads_first = lambda x: rearrange(x, "b s h d -> b h s d")  # blockwise_attention's layout
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
    return rearrange(out, "b h s d -> b s h d")


def _mla_core(q_nope, q_rope, latent, k_rope, kv_b, vis: Visibility, cfg: ModelConfig):
    """Attention of MLA queries over latent keys. q_*: [b, q, h, *]; latent: [b, k, kv_lora];
    k_rope: [b, k, rope] (already rotated, shared by the heads); kv_b: [kv_lora, h, nope + v].
    Returns [b, q, h, v_head_dim]. The rotary key is broadcast to every head and joined to the
    per-head key, so q.k is one product over nope + rope numbers."""
    nope = cfg.qk_nope_head_dim
    kvb = linear(latent, kv_b)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k_rope = repeat(k_rope.astype(k_nope.dtype), "b k r -> b k h r", h=k_nope.shape[2])
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    return _attend(q, k, v, vis, cfg)


def _gqa_core(q, k, v, vis: Visibility, cfg: ModelConfig):
    """q: [b, q, h, d]; k, v: [b, k, kvh, d] -> [b, q, h, d]. Key/value heads are repeated for
    their query group: query head h = (kv, g) reads KV head kv (as `grouped_attend` views them)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = (repeat(x, "b k kv d -> b k (kv g) d", g=groups) for x in (k, v))
    return _attend(q, k, v, vis, cfg)


def _local_visibility(ctx: AttentionContext) -> Visibility:
    seg, order = ctx.segment_ids, ctx.order
    return Visibility(seg, order, seg, order, causal_skip=ctx.layout == "contiguous")


def _mla_project(p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig, sharding: MeshRules | None = None):
    """x [b, s, embed] -> (q_nope [b, s, h, nope], q_rope [b, s, h, rope] rotated, latent [b, s, kv_lora]
    normalised, k_rope [b, s, rope] rotated)."""
    nope = cfg.qk_nope_head_dim
    if cfg.q_lora_rank:
        q = adapted_linear(rms_norm(adapted_linear(x, p, "q_a"), p["q_a_norm"], LATENT_NORM_EPS), p, "q_b")
    else:
        q = adapted_linear(x, p, "q")
    q = constrain(q, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    kv = adapted_linear(x, p, "kv_a")
    latent = rms_norm(kv[..., : cfg.kv_lora_rank], p["kv_a_norm"], LATENT_NORM_EPS)
    q_rope = apply_rope(q[..., nope:], ctx.cos, ctx.sin, cfg.rope_interleave)
    k_rope = apply_rope(kv[..., cfg.kv_lora_rank :][:, :, None, :], ctx.cos, ctx.sin, cfg.rope_interleave)
    return q[..., :nope], q_rope, latent, k_rope[:, :, 0]


def mla(p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig, sharding: MeshRules | None = None) -> jax.Array:
    """Multi-head latent attention. x: [batch, seq, embed] -> [batch, seq, embed].

    Queries: optional low-rank path (q_a -> RMSNorm -> q_b). Keys/values: a shared latent
    c = RMSNorm(x W_kv_a[:kv_lora]) expanded per head by W_kv_b into k_nope and v, plus one rotary
    key k_rope = rope(x W_kv_a[kv_lora:]) shared by all heads.
    """
    q_nope, q_rope, latent, k_rope = _mla_project(p, x, ctx, cfg, sharding)
    kv_b = merged_weight(p, "kv_b")  # used whole (context-parallel and absorbed attention): merged
    if sharding is not None and context_axes(sharding):
        out = context_parallel_attention(_mla_core, (q_nope, q_rope), (latent, k_rope), (kv_b,), ctx, cfg, sharding)
    else:
        out = _mla_core(q_nope, q_rope, latent, k_rope, kv_b, _local_visibility(ctx), cfg)
    out = constrain(out, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return adapted_linear(out, p, "o", contract=2)


def _gqa_project(p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig):
    """x [b, s, embed] -> q [b, s, h, d], k, v [b, s, kv_heads, d]; q and k normed (Qwen3) and rotated."""
    q, k, v = adapted_linear(x, p, "q"), adapted_linear(x, p, "k"), adapted_linear(x, p, "v")
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, ctx.cos, ctx.sin, cfg.rope_interleave)
    k = apply_rope(k, ctx.cos, ctx.sin, cfg.rope_interleave)
    return q, k, v


def gqa(p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig, sharding: MeshRules | None = None) -> jax.Array:
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3). x: [batch, seq, embed]."""
    q, k, v = _gqa_project(p, x, ctx, cfg)
    q = constrain(q, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    if sharding is not None and context_axes(sharding):
        out = context_parallel_attention(_gqa_core, (q,), (k, v), (), ctx, cfg, sharding)
    else:
        out = _gqa_core(q, k, v, _local_visibility(ctx), cfg)
    out = constrain(out, sharding, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return adapted_linear(out, p, "o", contract=2)


def _cache_lengths(ctx: AttentionContext) -> jax.Array:
    if ctx.cache_lengths is None:
        raise ValueError("cached attention needs AttentionContext.cache_lengths (the cached path sets it)")
    return ctx.cache_lengths


def mla_cached(p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig, cache: dict) -> tuple[jax.Array, dict]:
    """MLA over a KV cache with the absorbed weights (DeepSeek-V2 section 2.1.2).

    x: [b, n, embed] new tokens at positions ctx.cache_lengths[b] + 0..n-1; cache: {"latent":
    [b, T, kv_lora], "k_rope": [b, T, rope]}. W_UK (kv_b's key part) is folded into the query,
    q_lat = q_nope W_UK^T, so the scores are q_lat . c + q_rope . k_rope over the cached latents;
    W_UV is applied after the probabilities weight the latents. No per-head key or value is built:
    the cost per cached token is kv_lora + rope numbers, whatever the number of heads.
    Returns (out [b, n, embed], updated cache)."""
    nope = cfg.qk_nope_head_dim
    q_nope, q_rope, latent, k_rope = _mla_project(p, x, ctx, cfg)
    start = _cache_lengths(ctx)
    cache = {
        "latent": kv_cache.write(cache["latent"], latent, start),
        "k_rope": kv_cache.write(cache["k_rope"], k_rope, start),
    }
    w_uk, w_uv = p["kv_b"][..., :nope], p["kv_b"][..., nope:]  # [kv_lora, h, nope], [kv_lora, h, v]
    c, kr = cache["latent"], cache["k_rope"]
    q_lat = jnp.einsum("bqhn,rhn->bqhr", q_nope, w_uk.astype(q_nope.dtype))
    scores = jnp.einsum("bqhr,bkr->bhqk", q_lat, c.astype(q_lat.dtype), preferred_element_type=jnp.float32)
    scores += jnp.einsum("bqhe,bke->bhqk", q_rope, kr.astype(q_rope.dtype), preferred_element_type=jnp.float32)
    visible = kv_cache.cached_visibility(start, x.shape[1], c.shape[1])
    probs = _softmax_attend(scores * softmax_scale(cfg), visible).astype(c.dtype)
    o_lat = jnp.einsum("bhqk,bkr->bqhr", probs, c)
    out = jnp.einsum("bqhr,rhv->bqhv", o_lat, w_uv.astype(o_lat.dtype))
    return linear(out, p["o"], contract=2), cache


def grouped_attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention without repeating keys or values: q [b, n, h, d] over k [b, T, kvh, d],
    v [b, T, kvh, dv] under bool `visible` [b, 1, n, T] -> [b, n, h, dv].

    Query head h belongs to KV head h // groups (the order `jnp.repeat` of the KV heads gives), so
    the queries are viewed as [b, n, kv_heads, groups, d] and meet each KV head's keys in one
    product batched over (b, kv_heads): the cache is read once per KV head instead of being copied
    `groups` times per decode step. Scores and the softmax are float32; probabilities are cast to
    v's dtype for the value product (as `_attend`'s dense path)."""
    qg = rearrange(q, "b n (kv g) d -> b n kv g d", kv=k.shape[2])
    scores = jnp.einsum("bnkgd,btkd->bkgnt", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    probs = _softmax_attend(scores * scale, visible[:, :, None]).astype(v.dtype)  # mask [b, 1, 1, n, T]
    out = jnp.einsum("bkgnt,btkd->bnkgd", probs, v)
    return rearrange(out, "b n kv g d -> b n (kv g) d")


def gqa_cached(p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig, cache: dict) -> tuple[jax.Array, dict]:
    """GQA over a KV cache {"k", "v": [b, T, kv_heads, head_dim]} (keys stored rotated and normed);
    the query heads of a group share their KV head's cache rows (`grouped_attend`)."""
    q, k, v = _gqa_project(p, x, ctx, cfg)
    start = _cache_lengths(ctx)
    cache = {"k": kv_cache.write(cache["k"], k, start), "v": kv_cache.write(cache["v"], v, start)}
    kc, vc = cache["k"], cache["v"]
    visible = kv_cache.cached_visibility(start, x.shape[1], kc.shape[1])
    out = grouped_attend(q, kc, vc, visible, softmax_scale(cfg))
    return linear(out, p["o"], contract=2), cache


def attention(
    p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig, sharding: MeshRules | None = None
) -> jax.Array:
    """Attention of x [batch, seq, embed] over itself under `ctx` (`masks.AttentionContext`)."""
    fn = mla if cfg.attention_type == "mla" else gqa
    with jax.named_scope(cfg.attention_type):
        return fn(p, x, ctx, cfg, sharding)


def attention_cached(
    p: dict, x: jax.Array, ctx: AttentionContext, cfg: ModelConfig, cache: dict
) -> tuple[jax.Array, dict]:
    """Attention of new tokens over (and into) one layer's KV cache; see `mla_cached`/`gqa_cached`."""
    fn = mla_cached if cfg.attention_type == "mla" else gqa_cached
    with jax.named_scope(cfg.attention_type + "_cached"):
        return fn(merge_nodes(p), x, ctx, cfg, cache)
