"""The whole model as pure functions: one trunk (embedding, layer stacks, final norm) with two
entries, `forward(params, tokens, cfg)` over whole sequences (training and scoring, with the MTP
heads) and `forward_cached(params, tokens, cfg, cache)` over each row's next tokens with a KV
cache (prefill and decode), as jax-llm-examples separates prefill from decode."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig
from composer_jax.model.attention import attention, attention_cached
from composer_jax.model.kv_cache import KVCache, stack_slice
from composer_jax.model.layers import linear, rms_norm, rope_cos_sin
from composer_jax.model.lora import adapted_linear, merge_nodes
from composer_jax.model.masks import LAYOUTS, AttentionContext, Layout, segment_positions
from composer_jax.model.moe.decode import EXPERT_WEIGHTS, LayerView
from composer_jax.model.moe.layer import moe_layer
from composer_jax.model.quant_base import dequantized, is_quant
from composer_jax.sharding import MeshRules, constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutput:
    """logits: float32[batch, seq, vocab] (next token); mtp_logits: float32[depth, batch, seq, vocab]
    (depth k predicts token i+k+1) or None; routing: int32[moe_layers, batch, seq, k] experts chosen
    per token per MoE layer (feed back as `routing=` to replay); mtp_routing likewise for the MTP
    layers; hidden: float32[batch, seq, embed] final normed hidden state; aux: statistics, with
    expert_counts float32[moe_layers, experts] (assignments per expert over the whole batch)."""

    logits: jax.Array
    mtp_logits: jax.Array | None
    routing: jax.Array | None
    mtp_routing: jax.Array | None
    hidden: jax.Array
    aux: dict[str, Any]
    cache: KVCache | None = None  # the updated KV cache of `forward_cached`


def _remat(fn, policy: str, quantised: bool = False):
    """`fn` under the model's remat policy. With a quantised frozen base in the stack (`quantised`),
    "none" runs as "dots": without a checkpoint the backward would keep each layer's dequantised
    weights as residuals, the whole float base (a policy saving all but the named weights does not
    do: it saves the last unnamed step before them instead, and saving every matmul output keeps
    the experts' A B' products, [experts, in, out] each). "dots" and "full" save no dequantised
    weight (no matmul in a dequantisation)."""
    if policy == "none" and quantised:
        policy = "dots"
    if policy == "none":
        return fn
    if policy == "dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
    return jax.checkpoint(fn)


def decoder_layer(
    lp: dict,
    h: jax.Array,
    ctx: AttentionContext,
    cfg: ModelConfig,
    sharding: MeshRules | None,
    routing: jax.Array | None = None,
    cache=None,
):
    """One pre-norm block. h: [batch, seq, embed] -> (h, experts or None, counts or None, cache).

    routing: int32[batch, seq, k], this layer's recorded experts to replay (one layer of the
    forward's `routing`), or None.

    cache: this layer's KV cache (`kv_cache.KVCache.layers[stack]` at one layer) or None; the new
    tokens' keys are written into it and it comes back updated (None without a cache).

    A quantised frozen base's weights (`model/quant_base.py`) are dequantised here, one layer's."""
    lp = dequantized(lp, cfg.compute_dtype, cfg.param_dtype)
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    if cache is None:
        h = h + attention(lp["attn"], x, ctx, cfg, sharding)
    else:
        a, cache = attention_cached(lp["attn"], x, ctx, cfg, cache)
        h = h + a
    h = constrain(h, sharding, ("act_batch", "act_seq", "act_embed"))
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    if "moe" in lp:
        with jax.named_scope("moe"):
            # routed-expert adapters are merged into the expert stacks (model/lora.py says why)
            y, experts, counts = moe_layer(merge_nodes(lp["moe"]), x, cfg, sharding, routing, decode=cache is not None)
    else:
        m = lp["mlp"]
        with jax.named_scope("mlp"):
            h_mlp = jax.nn.silu(adapted_linear(x, m, "gate")) * adapted_linear(x, m, "up")
            y, experts, counts = adapted_linear(h_mlp, m, "down"), None, None
    h = constrain(h + y, sharding, ("act_batch", "act_seq", "act_embed"))
    return h, experts, counts, cache


def _run_stack(
    stack: dict,
    h: jax.Array,
    ctx: AttentionContext,
    cfg: ModelConfig,
    sharding: MeshRules | None,
    routing: jax.Array | None,
    cache=None,
):
    """lax.scan over a stack of identical layers (leading `layers` axis); the stack's KV cache (if
    any) and recorded routing (int32[layers, batch, seq, k], or None) are scanned with its layers,
    the cache coming back updated. -> (h, (experts, counts) or None, cache)."""
    moe = "moe" in stack
    views = {}
    if moe and cache is not None and _experts_as_views(cfg, sharding):
        # an inference step: the routed experts' weights stay stacked, and each layer reads the
        # experts it uses from the stack (`moe.decode.LayerView`) instead of a sliced copy of the layer's
        views = {k: stack["moe"][k] for k in EXPERT_WEIGHTS}
        stack = {**stack, "moe": {k: v for k, v in stack["moe"].items() if k not in views}}
    n = jax.tree.leaves(stack)[0].shape[0]

    def body(h, xs):
        lp, rp, c, i = xs
        if views:
            lp = {**lp, "moe": {**lp["moe"], **{k: LayerView(v, i) for k, v in views.items()}}}
        h, experts, counts, c = decoder_layer(lp, h, ctx, cfg, sharding, rp, c)
        return h, ((experts, counts) if moe else None, c)

    body = _remat(body, cfg.remat, any(is_quant(x) for x in jax.tree.leaves(stack, is_leaf=is_quant)))
    xs = (stack, routing, cache, jnp.arange(n, dtype=jnp.int32))
    h, (ys, new_cache) = jax.lax.scan(body, h, xs, unroll=not cfg.scan_layers)
    return h, ys, new_cache


def _experts_as_views(cfg: ModelConfig, sharding: MeshRules | None) -> bool:
    """Whether an inference step's MoE layers take their routed experts as `moe.decode.LayerView`s: on
    one device (or a mesh of size 1) with the plain decode path (`moe.dispatch.Dispatch.DECODE`);
    sharded runs slice the layer as before (the views do not cross `shard_map`)."""
    single = sharding is None or all(n == 1 for n in dict(sharding.mesh.shape).values())
    return single and cfg.moe_impl == "auto" and cfg.moe_precision == "bf16"


def attention_context(
    positions: jax.Array,
    segment_ids: jax.Array,
    token_order: jax.Array,
    cfg: ModelConfig,
    layout: Layout,
    cache_lengths: jax.Array | None = None,
) -> AttentionContext:
    """The `AttentionContext` of one pass: the rotary tables at `positions` (int32[batch, seq]),
    the segments and token order, and on the cached path the rows' cache lengths."""
    rope_dim = cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim
    cos, sin = rope_cos_sin(positions, rope_dim, cfg)
    return AttentionContext(cos, sin, segment_ids, token_order, layout, cache_lengths)


def compute_params(params: dict, cfg: ModelConfig) -> dict:
    """The weights as the forward computes with them: with `param_dtype` != `compute_dtype` (float32
    master weights, bfloat16 compute), every leaf in `param_dtype` is cast to `compute_dtype` once,
    at the entry of each forward (so the FSDP gathers move the narrower copy and the gradient comes
    back in `param_dtype` through the cast); the router's weights and bias keep their float32 (the
    routing scores are computed in float32). The same tree when the two dtypes agree."""
    if cfg.param_dtype == cfg.compute_dtype:
        return params
    keep, to = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)

    def cast(path, x):
        name = str(getattr(path[-1], "key", "")) if path else ""
        # (a quantised frozen weight is cast where the layer dequantises it: `quant_base.dequantized`)
        if name.startswith("router") or is_quant(x) or not hasattr(x, "dtype") or x.dtype != keep:
            return x
        return x.astype(to)

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=is_quant)


def _embed(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    return params["embed"].astype(cfg.compute_dtype)[tokens]


def output_head(params: dict, cfg: ModelConfig) -> jax.Array:
    """The output projection [embed, vocab] (the embedding table transposed when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def _logits(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    w = output_head(params, cfg)
    return linear(h, w, preferred_element_type=jnp.float32)


def _checked_tokens(tokens: jax.Array, cfg: ModelConfig, logits_at: jax.Array | None, routing: jax.Array | None):
    """Shapes and dtypes at the public boundary (checked at trace time: free under jit)."""
    chex.assert_rank(tokens, 2)
    chex.assert_type(tokens, int)
    if logits_at is not None:
        chex.assert_shape(logits_at, tokens.shape[:1])
    if routing is not None:
        chex.assert_shape(routing, (cfg.num_moe_layers, *tokens.shape, cfg.num_experts_per_tok))


def _training_context(
    tokens: jax.Array,
    cfg: ModelConfig,
    segment_ids: jax.Array | None,
    positions: jax.Array | None,
    token_order: jax.Array | None,
    context_layout: Layout,
) -> AttentionContext:
    """The training pass's `AttentionContext`, its inputs checked and defaulted: one segment,
    positions within the segment, the sequence's own order."""
    chex.assert_equal_shape([tokens] + [x for x in (segment_ids, positions, token_order) if x is not None])
    if context_layout not in LAYOUTS:
        raise ValueError(f"context_layout={context_layout!r} is not accepted; accepted: {', '.join(LAYOUTS)}")
    if segment_ids is None:
        segment_ids = jnp.ones(tokens.shape, jnp.int32)
    if positions is None:
        positions = segment_positions(segment_ids)
    if token_order is None:
        token_order = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return attention_context(positions, segment_ids, token_order, cfg, context_layout)


def cached_context(cfg: ModelConfig, cache: KVCache, n: int) -> AttentionContext:
    """A cached pass's `AttentionContext` for n new tokens per row: positions cache.lengths[b] +
    0..n-1; no segment ids or token order are read (each row is one sequence): the defaults."""
    positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    return attention_context(positions, jnp.ones_like(positions), positions, cfg, "contiguous", cache.lengths)


class _Trunk(NamedTuple):
    hidden: jax.Array  # float32[batch, seq, embed], after the final norm
    routing: jax.Array | None  # int32[moe_layers, batch, seq, k]
    aux: dict[str, Any]
    cache: dict[str, Any]  # the stacks' updated caches (None entries without a cache)


def _trunk(
    params: dict,
    tokens: jax.Array,
    ctx: AttentionContext,
    cfg: ModelConfig,
    sharding: MeshRules | None,
    routing: jax.Array | None,
    cache: KVCache | None,
) -> _Trunk:
    """Embedding, the dense and MoE layer stacks and the final norm: what the training and the
    cached entries share."""
    new_cache: dict[str, Any] = {}
    h = constrain(_embed(params, tokens, cfg), sharding, ("act_batch", "act_seq", "act_embed"))
    aux: dict[str, Any] = {}
    if "dense_layers" in params:
        with jax.named_scope("dense_layers"):
            h, _, new_cache["dense_layers"] = _run_stack(
                params["dense_layers"], h, ctx, cfg, sharding, None, stack_slice(cache, "dense_layers")
            )
    experts = None
    if "moe_layers" in params:
        with jax.named_scope("moe_layers"):
            h, (experts, stats), new_cache["moe_layers"] = _run_stack(
                params["moe_layers"], h, ctx, cfg, sharding, routing, stack_slice(cache, "moe_layers")
            )
        aux["expert_counts"] = stats["expert_counts"]
        aux["seq_balance"] = stats["seq_balance"]
        # float32[moe_layers]: assignments the expert-parallel bound dropped, rows each device sent
        aux["moe_dropped"], aux["moe_a2a_rows"] = stats["moe_dropped"], stats["moe_a2a_rows"]
    return _Trunk(rms_norm(h, params["final_norm"], cfg.rms_norm_eps), experts, aux, new_cache)


def _head(
    params: dict, h_final: jax.Array, cfg: ModelConfig, sharding: MeshRules | None, logits_at: jax.Array | None
) -> jax.Array:
    """The output head on every position, or on one per row (`logits_at`) -> float32 logits."""
    with jax.named_scope("output_head"):
        at = h_final if logits_at is None else jnp.take_along_axis(h_final, logits_at[:, None, None], axis=1)
        return constrain(_logits(params, at, cfg), sharding, ("act_batch", "act_seq", "act_vocab"))


def forward(
    params: dict,
    tokens: jax.Array,
    cfg: ModelConfig,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    routing: jax.Array | None = None,
    mtp_routing: jax.Array | None = None,
    token_order: jax.Array | None = None,
    mtp_tokens: jax.Array | None = None,
    context_layout: Layout = "contiguous",
    sharding: MeshRules | None = None,
    logits_at: jax.Array | None = None,
) -> ModelOutput:
    """Run the model over whole sequences (training, scoring; no KV cache: `forward_cached`).

    tokens: int32[batch, seq]. segment_ids: int32[batch, seq] for packed sequences (0 = padding; no
    attention across segments); positions: int32[batch, seq] (default: position within segment).
    routing: int32[moe_layers, batch, seq, k] recorded experts to replay instead of routing;
    mtp_routing likewise for the MTP layers.
    token_order: int32[batch, seq] original index of each token when the sequence axis has been
    permuted (zigzag context parallelism); causality follows it. mtp_tokens: int32[depth, batch,
    seq] the token k ahead of each position for MTP depth k (default: shift `tokens`, valid only
    when the sequence is not permuted). context_layout: "contiguous" (the default) promises that
    token_order increases along the sequence (as the default does), which lets blockwise attention
    skip key blocks after each query block; "zigzag" when the sequence was permuted by
    `model.context_parallel.zigzag_permutation` (context-parallel attention then skips the keys the first
    local chunk cannot see); "any" for any other order.
    sharding: the mesh and its rules; by default the mesh set with `jax.set_mesh` (if any) with the
    default rules (`MeshRules.resolve`). Without a mesh everything runs as on one device.
    logits_at: int32[batch], one position per row: the output head runs there only and `logits` is
    [batch, 1, vocab] (a prefill needs the distribution after the prompt's last token only; XLA:CPU
    already narrows a gather of the full head to those rows, measured no faster, so this states it
    for every backend and keeps [batch, seq, vocab] from being materialised); hidden states and
    routing are those of every position as without it.
    """
    sharding = MeshRules.resolve(sharding)
    _checked_tokens(tokens, cfg, logits_at, routing)
    params = compute_params(params, cfg)
    if mtp_tokens is not None:
        chex.assert_shape(mtp_tokens, (cfg.num_mtp_layers, *tokens.shape))
    ctx = _training_context(tokens, cfg, segment_ids, positions, token_order, context_layout)
    trunk = _trunk(params, tokens, ctx, cfg, sharding, routing, None)
    logits = _head(params, trunk.hidden, cfg, sharding, logits_at)
    aux = dict(trunk.aux)
    mtp_logits = mtp_experts = None
    if cfg.num_mtp_layers and "mtp" in params:
        with jax.named_scope("mtp"):
            mtp_logits, mtp_experts, mtp_stats = mtp_forward(
                params, trunk.hidden, tokens, ctx, cfg, sharding, mtp_routing, mtp_tokens
            )
        if mtp_stats is not None:
            aux["mtp_expert_counts"] = mtp_stats["expert_counts"]
            aux["mtp_moe_dropped"], aux["mtp_moe_a2a_rows"] = mtp_stats["moe_dropped"], mtp_stats["moe_a2a_rows"]
    return ModelOutput(logits, mtp_logits, trunk.routing, mtp_experts, trunk.hidden, aux)


def forward_cached(
    params: dict,
    tokens: jax.Array,
    cfg: ModelConfig,
    cache: KVCache,
    *,
    sharding: MeshRules | None = None,
    logits_at: jax.Array | None = None,
) -> ModelOutput:
    """Run the model over each row's next tokens with a KV cache: a prefill is a call with the
    prompt (a long one may be prefilled in chunks), decoding a call per step.

    tokens: int32[batch, n], each row's next n tokens, at positions cache.lengths[b] + 0..n-1
    (YaRN/RoPE continue from the cached prefix); they attend to the row's cached tokens and
    themselves, and their keys are appended. cache: a `KVCache` (`model.kv_cache.init_cache`); the
    updated cache (lengths advanced by n) is `ModelOutput.cache`. The MTP heads are not run
    (speculative decoding drives them itself: `mtp_forward_cached`). sharding and logits_at as in
    `forward`; hidden states, routing and the cache are those of every position.
    """
    sharding = MeshRules.resolve(sharding)
    _checked_tokens(tokens, cfg, logits_at, None)
    params = compute_params(merge_nodes(params), cfg)  # adapters (model/lora.py) merged once per call
    ctx = cached_context(cfg, cache, tokens.shape[1])
    trunk = _trunk(params, tokens, ctx, cfg, sharding, None, cache)
    logits = _head(params, trunk.hidden, cfg, sharding, logits_at)
    layers = {k: v for k, v in trunk.cache.items() if v is not None}
    new_cache = KVCache(layers, cache.lengths + tokens.shape[1])
    return ModelOutput(logits, None, trunk.routing, None, trunk.hidden, trunk.aux, new_cache)


def mtp_forward(
    params: dict,
    h_main: jax.Array,
    tokens: jax.Array,
    ctx: AttentionContext,
    cfg: ModelConfig,
    sharding: MeshRules | None,
    routing: jax.Array | None = None,
    mtp_tokens=None,
):
    """DeepSeek-V3 multi-token prediction (sec. 2.2), sequential depths k = 1..D:

        h^k_i = Block_k(eh_proj[ RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i) ]),  logits^k = Head(RMSNorm(h^k))

    with the embedding and output head shared with the main model and h^0 its final hidden state.
    Positions past the end of the sequence see token 0 (their loss is masked by the caller).
    routing: int32[depth, batch, seq, k] recorded experts of the MTP layers to replay, or None.
    Returns (float32[depth, batch, seq, vocab], experts or None, counts or None).
    """
    depth = cfg.num_mtp_layers
    moe = cfg.num_experts > 0

    if mtp_tokens is None:
        b, s = tokens.shape
        mtp_tokens = jnp.stack(
            [jnp.concatenate([tokens[:, k:], jnp.zeros((b, k), tokens.dtype)], axis=1) for k in range(1, depth + 1)]
        )

    def body(h_prev, xs):
        mp, rp, shifted = xs
        h, h_normed, experts, counts, _ = mtp_block(params, mp, h_prev, shifted, ctx, cfg, sharding, rp)
        logits = _logits(params, h_normed, cfg)
        return h, (logits, experts, counts) if moe else (logits, None, None)

    quantised = any(is_quant(x) for x in jax.tree.leaves(params["mtp"], is_leaf=is_quant))
    body = _remat(body, cfg.remat, quantised)
    _, (logits, experts, counts) = jax.lax.scan(
        body, h_main, (params["mtp"], routing, mtp_tokens), length=depth, unroll=not cfg.scan_layers
    )
    return logits, experts, counts


def mtp_block(
    params: dict,
    mp: dict,
    h_prev: jax.Array,
    next_tokens: jax.Array,
    ctx: AttentionContext,
    cfg: ModelConfig,
    sharding: MeshRules | None,
    routing: jax.Array | None = None,
    cache=None,
):
    """One MTP module (DeepSeek-V3 sec. 2.2), the code both training and speculative drafting run:
    h^k = Block_k(eh_proj[RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1})]).

    mp: the module's parameters (one entry of params["mtp"]); h_prev: [batch, seq, embed];
    next_tokens: int32[batch, seq] (t_{i+k}); cache: the module's layer cache or None. Returns
    (h^k [batch, seq, embed], RMSNorm(h^k) with the module's norm (the shared head's input),
    experts, counts, cache)."""
    mp = dequantized(mp, cfg.compute_dtype, cfg.param_dtype)  # a quantised frozen base's (`decoder_layer`)
    e = rms_norm(_embed(params, next_tokens, cfg), mp["enorm"], cfg.rms_norm_eps)
    hh = rms_norm(h_prev, mp["hnorm"], cfg.rms_norm_eps)
    x = linear(jnp.concatenate([e, hh], axis=-1), mp["eh_proj"])
    x = constrain(x, sharding, ("act_batch", "act_seq", "act_embed"))
    h, experts, counts, cache = decoder_layer(mp["layer"], x, ctx, cfg, sharding, routing, cache)
    return h, rms_norm(h, mp["norm"], cfg.rms_norm_eps), experts, counts, cache


def mtp_forward_cached(
    params: dict,
    h_prev: jax.Array,
    next_tokens: jax.Array,
    cfg: ModelConfig,
    cache: KVCache,
    *,
    module: int = 0,
    sharding: MeshRules | None = None,
) -> tuple[jax.Array, KVCache]:
    """MTP module `module` (0 = depth 1) over its KV cache (`init_cache(..., mtp_modules=...)`).

    h_prev: [batch, n, embed] the previous depth's hidden state at positions cache.lengths[b] +
    0..n-1 (depth 1: the main model's final hidden state, `ModelOutput.hidden`); next_tokens:
    int32[batch, n] the token `module + 1` places ahead of each position. The new positions attend
    to the module's cached positions and themselves and are appended (the returned cache's lengths
    advance by n; the caller sets them back to roll a draft back). Returns (RMSNorm(h^k) [batch, n,
    embed], the shared output head's input; the updated cache). With the cache holding the
    module's states of positions 0..L-1 this equals the training `mtp_forward` at positions
    L..L+n-1."""
    sharding = MeshRules.resolve(sharding)
    chex.assert_rank(next_tokens, 2)
    params = compute_params(params, cfg)
    chex.assert_equal_shape_prefix([h_prev, next_tokens], 2)
    n = next_tokens.shape[1]
    ctx = cached_context(cfg, cache, n)
    mp = jax.tree.map(lambda x: x[module], params["mtp"])
    if "moe" in mp["layer"] and _experts_as_views(cfg, sharding):  # as in `_run_stack`
        moe_p = params["mtp"]["layer"]["moe"]
        views = {k: LayerView(moe_p[k], jnp.int32(module)) for k in EXPERT_WEIGHTS}
        mp = {**mp, "layer": {**mp["layer"], "moe": {**mp["layer"]["moe"], **views}}}
    layer_cache = {k: v[module] for k, v in cache.layers["mtp"].items()}
    with jax.named_scope("mtp_cached"):
        _, h_normed, _, _, layer_cache = mtp_block(
            params, mp, h_prev, next_tokens, ctx, cfg, sharding, None, layer_cache
        )
    layers = {"mtp": {k: v.at[module].set(layer_cache[k]) for k, v in cache.layers["mtp"].items()}}
    return h_normed, KVCache(layers, cache.lengths + n)


def logits_of(params: dict, h_normed: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The shared output head on normed hidden states [..., embed] -> float32[..., vocab]."""
    return _logits(params, h_normed, cfg)
