"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) and GQA with q/k RMSNorm (Qwen3-MoE).

Packed sequences: `segment_ids` [batch, seq] (0 = padding) and per-segment `positions`; a token
attends only to earlier tokens of its own segment.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from composer_jax.config import ModelConfig
from composer_jax.model.flash import blockwise_attention
from composer_jax.model.layers import apply_rope, linear, rms_norm, softmax_scale
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


def causal_segment_mask(segment_ids: jax.Array, order: jax.Array | None = None,
                        k_segment_ids: jax.Array | None = None, k_order: jax.Array | None = None) -> jax.Array:
    """-> bool[batch, 1, q_seq, k_seq]: key not after the query (by original token index `order`,
    which differs from the array index when the sequence is permuted for context parallelism) and
    in the same segment. Keys default to the queries."""
    if order is None:
        order = jnp.broadcast_to(jnp.arange(segment_ids.shape[-1], dtype=jnp.int32), segment_ids.shape)
    k_segment_ids = segment_ids if k_segment_ids is None else k_segment_ids
    k_order = order if k_order is None else k_order
    causal = k_order[:, None, :] <= order[:, :, None]
    same = segment_ids[:, :, None] == k_segment_ids[:, None, :]
    return (causal & same)[:, None]


def _softmax_attend(scores: jax.Array, mask: jax.Array) -> jax.Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


class Visibility(NamedTuple):
    """Which keys each query sees: causal by token order, within one segment. q_*: [b, sq],
    k_*: [b, sk]. causal_skip: queries and keys are one sequence in increasing token order, so whole
    key blocks after a query block can be skipped (blockwise attention only)."""

    q_seg: jax.Array
    q_ord: jax.Array
    k_seg: jax.Array
    k_ord: jax.Array
    causal_skip: bool = False

    def mask(self) -> jax.Array:
        return causal_segment_mask(self.q_seg, self.q_ord, self.k_seg, self.k_ord)


def _attend(q, k, v, vis: Visibility, cfg: ModelConfig):
    """q [b, q, h, d], k [b, k, h, d], v [b, k, h, dv] -> [b, q, h, dv] under `vis`."""
    if cfg.attention_impl == "dense":
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        probs = _softmax_attend(scores * softmax_scale(cfg), vis.mask()).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    out = blockwise_attention(heads_first(q), heads_first(k), heads_first(v), vis.q_seg, vis.q_ord, vis.k_seg,
                              vis.k_ord, scale=softmax_scale(cfg), block_q=cfg.attn_block_q,
                              block_k=cfg.attn_block_k, causal_skip=vis.causal_skip)
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


def _context_axes(rules: ShardingRules | None, mesh) -> tuple[str, ...]:
    if rules is None or mesh is None:
        return ()
    return tuple(a for a in rules.mesh_axes("act_seq") if mesh.shape[a] > 1)


def context_parallel_attention(core, queries: tuple, kv_sources: tuple, head_params: tuple, ctx: dict,
                               cfg: ModelConfig, rules: ShardingRules, mesh) -> jax.Array:
    """Attention with the sequence split over the context mesh axis (explicit `shard_map`).

    Each device keeps its query block and all-gathers the key/value *sources* over the context
    axis: for MLA that is the compressed latent and the shared rotary key (kv_lora + rope numbers
    per token, instead of heads x (k + v) for expanded keys: the MLA-specific saving), expanded
    per head locally. Masks come from gathered segment ids and original token order, so packed
    sequences and any permutation of the sequence are exact. With the zigzag layout (device d
    holds chunks d and 2C-1-d), the first local chunk can only see the first C chunks, so it is
    computed against those alone: every device does 3C/4C of the full work, the same amount.

    queries: arrays [b, s, h, *]; kv_sources: arrays [b, s, *]; head_params: weights whose axis 1 is
    heads (sharded like the query heads); core(*queries, *gathered_kv, *head_params, mask, cfg).
    """
    cax = _context_axes(rules, mesh)
    b, s = queries[0].shape[:2]
    tok = rules.spec(("act_batch", "act_seq"), (b, s), mesh)
    heads = rules.spec(("act_heads",), (queries[0].shape[2],), mesh)[0]
    q_spec = P(tok[0], tok[1], heads, None)
    kv_spec = lambda x: P(tok[0], tok[1], *([None] * (x.ndim - 2)))
    hp_spec = lambda w: P(None, heads, *([None] * (w.ndim - 2)))
    zigzag = ctx.get("layout") == "zigzag"
    n_ctx = int(np.prod([mesh.shape[a] for a in cax]))

    def body(queries, kv, hp, seg, order):
        gather = lambda x: jax.lax.all_gather(x, cax, axis=1, tiled=True)
        kv_all = tuple(gather(x) for x in kv)
        seg_all, order_all = gather(seg), gather(order)
        if not zigzag:
            return core(*queries, *kv_all, *hp, Visibility(seg, order, seg_all, order_all), cfg)
        half = seg.shape[1] // 2
        # keys of the first C chunks = the first half of every device's block
        first = lambda x: x.reshape(x.shape[0], n_ctx, 2, half, *x.shape[2:])[:, :, 0].reshape(
            x.shape[0], n_ctx * half, *x.shape[2:])
        qa = tuple(q[:, :half] for q in queries)
        qb = tuple(q[:, half:] for q in queries)
        vis_a = Visibility(seg[:, :half], order[:, :half], first(seg_all), first(order_all))
        vis_b = Visibility(seg[:, half:], order[:, half:], seg_all, order_all)
        out_a = core(*qa, *(first(x) for x in kv_all), *hp, vis_a, cfg)
        out_b = core(*qb, *kv_all, *hp, vis_b, cfg)
        return jnp.concatenate([out_a, out_b], axis=1)

    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(tuple(q_spec for _ in queries), tuple(kv_spec(x) for x in kv_sources),
                                 tuple(hp_spec(w) for w in head_params), P(tok[0], tok[1]), P(tok[0], tok[1])),
                       out_specs=q_spec)
    return fn(queries, kv_sources, head_params, ctx["segment_ids"], ctx["order"])


def _local_visibility(ctx: dict) -> Visibility:
    seg, order = ctx["segment_ids"], ctx["order"]
    return Visibility(seg, order, seg, order, causal_skip=ctx.get("layout") == "contiguous")


def mla(p: dict, x: jax.Array, ctx: dict, cfg: ModelConfig, rules: ShardingRules | None = None,
        mesh=None) -> jax.Array:
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
    q = constrain(q, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    kv = linear(x, p["kv_a"])
    latent = rms_norm(kv[..., : cfg.kv_lora_rank], p["kv_a_norm"], LATENT_NORM_EPS)
    q_rope = apply_rope(q_rope, ctx["cos"], ctx["sin"], cfg.rope_interleave)
    k_rope = apply_rope(kv[..., cfg.kv_lora_rank:][:, :, None, :], ctx["cos"], ctx["sin"], cfg.rope_interleave)[:, :, 0]
    if _context_axes(rules, mesh):
        out = context_parallel_attention(_mla_core, (q_nope, q_rope), (latent, k_rope), (p["kv_b"],),
                                         ctx, cfg, rules, mesh)
    else:
        out = _mla_core(q_nope, q_rope, latent, k_rope, p["kv_b"], _local_visibility(ctx), cfg)
    out = constrain(out, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return linear(out, p["o"], contract=2)


def gqa(p: dict, x: jax.Array, ctx: dict, cfg: ModelConfig, rules: ShardingRules | None = None,
        mesh=None) -> jax.Array:
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3). x: [batch, seq, embed]."""
    q = linear(x, p["q"])
    k = linear(x, p["k"])
    v = linear(x, p["v"])
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, ctx["cos"], ctx["sin"], cfg.rope_interleave)
    k = apply_rope(k, ctx["cos"], ctx["sin"], cfg.rope_interleave)
    q = constrain(q, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    if _context_axes(rules, mesh):
        out = context_parallel_attention(_gqa_core, (q,), (k, v), (), ctx, cfg, rules, mesh)
    else:
        out = _gqa_core(q, k, v, _local_visibility(ctx), cfg)
    out = constrain(out, rules, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    return linear(out, p["o"], contract=2)


def attention(p: dict, x: jax.Array, ctx: dict, cfg: ModelConfig, rules: ShardingRules | None = None,
              mesh=None) -> jax.Array:
    """ctx: cos/sin [batch, seq, rope/2], segment_ids, order [batch, seq], layout ("contiguous": order
    increases along the sequence | "zigzag" | "any")."""
    fn = mla if cfg.attention_type == "mla" else gqa
    return fn(p, x, ctx, cfg, rules, mesh)
