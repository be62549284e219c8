"""Context parallelism: the sequence split over the `context` mesh axis.

Two pieces belong together here: the zigzag layout of the sequence (which the train step applies
to its inputs and targets before splitting them over the context axis, so causal work is
balanced) and the attention that runs on that layout (an explicit `shard_map` that all-gathers
the key/value sources over the context axis and masks by original token order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange

from composer_jax.config import ModelConfig
from composer_jax.model.masks import AttentionContext, Visibility
from composer_jax.sharding import MeshRules


def zigzag_permutation(seq: int, context: int) -> np.ndarray:
    """perm[j] = original index of the token at position j of the zigzag layout: the sequence cut
    into 2C chunks, device d holding chunks d and 2C-1-d, so every device owns an equal share of
    early and late tokens and causal attention work is balanced."""
    if context == 1:
        return np.arange(seq)
    chunks = rearrange(np.arange(seq), "(chunk t) -> chunk t", chunk=2 * context)
    early, late = chunks[:context], chunks[context:][::-1]  # device d: chunks d and 2C-1-d
    return rearrange(np.stack([early, late], axis=1), "device part t -> (device part t)")


def context_axes(sharding: MeshRules | None) -> tuple[str, ...]:
    """Mesh axes (of size > 1) the sequence is split over; () without context parallelism."""
    return () if sharding is None else sharding.split_axes("act_seq")


def context_size(sharding: MeshRules | None) -> int:
    """How many ways the sequence is split (the product of the context axes' sizes)."""
    return int(np.prod([sharding.size(a) for a in context_axes(sharding)])) if sharding is not None else 1


def context_parallel_attention(
    core,
    queries: tuple,
    kv_sources: tuple,
    head_params: tuple,
    ctx: AttentionContext,
    cfg: ModelConfig,
    sharding: MeshRules,
) -> jax.Array:
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
    cax = context_axes(sharding)
    # shard_map specs from logical axes: tokens split as activations are, query heads as
    # `act_heads`; key/value sources and the head weights' other dimensions whole in the block
    q_spec = sharding.spec(("act_batch", "act_seq", "act_heads", None), queries[0].shape)
    tok_spec = sharding.spec(("act_batch", "act_seq"), queries[0].shape[:2])
    kv_spec = lambda x: sharding.spec(("act_batch", "act_seq") + (None,) * (x.ndim - 2), x.shape)
    hp_spec = lambda w: sharding.spec((None, "act_heads") + (None,) * (w.ndim - 2), w.shape)
    zigzag = ctx.layout == "zigzag"
    n_ctx = context_size(sharding)

    def body(queries, kv, hp, seg, order):
        gather = lambda x: jax.lax.all_gather(x, cax, axis=1, tiled=True)
        kv_all = tuple(gather(x) for x in kv)
        seg_all, order_all = gather(seg), gather(order)
        if not zigzag:
            return core(*queries, *kv_all, *hp, Visibility(seg, order, seg_all, order_all), cfg)
        half = seg.shape[1] // 2
        # keys of the first C chunks = the first half of every device's block
        blocks = lambda x: rearrange(x, "b (device part t) ... -> b device part t ...", device=n_ctx, part=2)
        first = lambda x: rearrange(blocks(x)[:, :, 0], "b device t ... -> b (device t) ...")
        qa = tuple(q[:, :half] for q in queries)
        qb = tuple(q[:, half:] for q in queries)
        vis_a = Visibility(seg[:, :half], order[:, :half], first(seg_all), first(order_all))
        vis_b = Visibility(seg[:, half:], order[:, half:], seg_all, order_all)
        out_a = core(*qa, *(first(x) for x in kv_all), *hp, vis_a, cfg)
        out_b = core(*qb, *kv_all, *hp, vis_b, cfg)
        return jnp.concatenate([out_a, out_b], axis=1)

    fn = jax.shard_map(
        body,
        mesh=sharding.mesh,
        in_specs=(
            tuple(q_spec for _ in queries),
            tuple(kv_spec(x) for x in kv_sources),
            tuple(hp_spec(w) for w in head_params),
            tok_spec,
            tok_spec,
        ),
        out_specs=q_spec,
    )
    return fn(queries, kv_sources, head_params, ctx.segment_ids, ctx.order)
