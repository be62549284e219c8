"""Blockwise (flash-style) attention in plain JAX, with its own VJP.

Never builds the [batch, heads, q, k] score matrix: queries go in blocks of `block_q`, each block
meets its keys in chunks of at most `block_k` with an online softmax, and the backward pass
recomputes every chunk's probabilities from the saved log-sum-exp (the FlashAttention-2
recurrences, Dao 2023), so activation memory is O(q x heads) instead of O(q x k x heads). That is
what makes the 256K stage's per-device attention fit, and on CPU it is also faster than the dense
form: the chunks stay in cache and there are fewer float32 passes over scores.

Query blocks are unrolled in the program (each has its own static key span), at most
MAX_QUERY_BLOCKS of them: past that the blocks grow (32K tokens: 16 blocks of 2048) so compile
time stays bounded; key chunks are a `lax.scan`, so their number is free.

Causal block skipping: with `causal_skip=True` the caller promises that queries and keys are the
same sequence in increasing token order (the contiguous layout), so query block i only visits keys
[0, (i + 1) * block_q): about half the score work at long sequence lengths. The mask is still
applied inside every visited chunk (packed segments, the diagonal), so skipping only ever drops
chunks that are entirely masked.

Masking: key j is visible to query i when k_order[j] <= q_order[i] and both lie in the same
segment (segment ids compared as given; padding is segment 0 and sees only padding). A query that
sees no key at all gets a zero output and no gradient.

Shapes: q [b, h, sq, d], k [b, h, sk, d], v [b, h, sk, dv]; segment ids / orders int32 [b, sq] and
[b, sk]. Scores and the softmax are float32; the probability-times-value products run in v's dtype
(as the dense path does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange

from composer_jax.sharding import vary_like

NEG = -1e30  # finite "minus infinity": exp(NEG - m) underflows to 0 without NaNs
MAX_QUERY_BLOCKS = 16  # unrolled query blocks per attention call (compile time); blocks grow past it


def _visible(q_seg, q_ord, k_seg, k_ord):
    """-> bool[b, 1, bq, bk]."""
    return (k_ord[:, None, None, :] <= q_ord[:, None, :, None]) & (k_seg[:, None, None, :] == q_seg[:, None, :, None])


def _plan(sq: int, sk: int, block_q: int, block_k: int, causal_skip: bool):
    """Static plan: [(q_start, q_stop, key_span, key_chunk)] per query block."""
    if causal_skip and sq != sk:
        raise ValueError(f"causal_skip needs queries and keys of one sequence; got {sq} queries, {sk} keys")
    # query blocks are unrolled (each has its own static key span), so their number is capped: at
    # 32K tokens and block_q=128 there would be 256 per layer. Blocks grow instead; the smallest
    # divisor of sq that is >= the wanted size keeps every block the same size.
    want = max(min(block_q, sq), -(-sq // MAX_QUERY_BLOCKS))
    bq = next(x for x in range(want, sq + 1) if sq % x == 0)
    plan = []
    for start in range(0, sq, bq):
        span = min(sk, start + bq) if causal_skip else sk
        # the largest chunk <= block_k that divides the span (powers of two in practice)
        # the largest chunk <= block_k that divides the span; when that is under half of block_k (a
        # span with no convenient divisor), chunks of block_k over keys padded past the span
        chunk = span if span <= block_k else next(c for c in range(block_k, 0, -1) if span % c == 0)
        if span > block_k and chunk < block_k // 2:
            chunk = block_k
        plan.append((start, start + bq, span, chunk))
    return plan


# by rank, keys / values [b, h, sk, d] and segment ids / orders [b, sk]: the key axis, and its split
# into (chunk n, key within the chunk c) with the chunk index leading (the axis lax.scan walks)
_KEY_CHUNKS = {4: (2, "b h (n c) d -> n b h c d"), 2: (1, "b (n c) -> n b c")}


def _chunks(x, span: int, chunk: int, fill=0):
    """x's keys [0, span), padded with `fill` to a multiple of `chunk` -> [n, ...chunk...] with the
    chunk index leading (`_KEY_CHUNKS`)."""
    axis, split = _KEY_CHUNKS[x.ndim]
    x = jax.lax.slice_in_dim(x, 0, span, axis=axis)
    if span % chunk:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, chunk - span % chunk)
        x = jnp.pad(x, pad, constant_values=fill)
    return rearrange(x, split, c=chunk)


def _key_chunks(k, v, k_seg, k_ord, span: int, chunk: int):
    """Keys [0, span) in chunks; padding keys (past the span) carry an order no query reaches."""
    big = jnp.iinfo(jnp.int32).max
    return (
        _chunks(k, span, chunk),
        _chunks(v, span, chunk),
        _chunks(k_seg, span, chunk),
        _chunks(k_ord, span, chunk, fill=big),
    )


def _block_forward(qi, qs, qo, k, v, ks, ko, span, chunk, scale):
    """One query block against keys [0, span) in chunks: -> (out [b,h,bq,dv] f32, lse [b,h,bq])."""
    b, h, bq, _ = qi.shape
    dv = v.shape[-1]

    def step(carry, xs):
        m, denom, acc = carry
        kc, vc, ksc, koc = xs
        s = jnp.einsum("bhqd,bhkd->bhqk", qi, kc, preferred_element_type=jnp.float32) * scale
        vis = _visible(qs, qo, ksc, koc)
        s = jnp.where(vis, s, NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        denom = denom * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum(
            "bhqk,bhkd->bhqd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32
        )
        return (m_new, denom, acc), None

    # inside shard_map the carry must vary over the same mesh axes as the per-step result
    init = tuple(
        vary_like(x, qi, qs, qo, k, v, ks, ko)
        for x in (
            jnp.full((b, h, bq), NEG, jnp.float32),
            jnp.zeros((b, h, bq), jnp.float32),
            jnp.zeros((b, h, bq, dv), jnp.float32),
        )
    )
    xs = _key_chunks(k, v, ks, ko, span, chunk)
    if span == chunk:  # one chunk: no loop
        (m, denom, acc), _ = step(init, jax.tree.map(lambda x: x[0], xs))
    else:
        (m, denom, acc), _ = jax.lax.scan(step, init, xs)
    seen = denom > 0
    denom = jnp.where(seen, denom, 1.0)
    out = acc / denom[..., None]
    lse = jnp.where(seen, m + jnp.log(denom), jnp.inf)  # exp(s - inf) = 0: unseen rows get no gradient
    return out, lse


def _forward(q, k, v, q_seg, q_ord, k_seg, k_ord, scale, plan):
    outs, lses = [], []
    for start, stop, span, chunk in plan:
        o, lse = _block_forward(
            q[:, :, start:stop], q_seg[:, start:stop], q_ord[:, start:stop], k, v, k_seg, k_ord, span, chunk, scale
        )
        outs.append(o)
        lses.append(lse)
    out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=2) if len(lses) > 1 else lses[0]
    return out.astype(v.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(q, k, v, q_seg, q_ord, k_seg, k_ord, scale, plan):
    return _forward(q, k, v, q_seg, q_ord, k_seg, k_ord, scale, plan)[0]


def _attention_fwd(q, k, v, q_seg, q_ord, k_seg, k_ord, scale, plan):
    out, lse = _forward(q, k, v, q_seg, q_ord, k_seg, k_ord, scale, plan)
    return out, (q, k, v, q_seg, q_ord, k_seg, k_ord, out, lse)


def _attention_bwd(scale, plan, res, d_out):
    q, k, v, q_seg, q_ord, k_seg, k_ord, out, lse = res
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, h, sq]
    dq_blocks = []
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for start, stop, span, chunk in plan:
        qi, doi = q[:, :, start:stop], d_out[:, :, start:stop]
        qs, qo = q_seg[:, start:stop], q_ord[:, start:stop]
        lse_i, delta_i = lse[:, :, start:stop], delta[:, :, start:stop]

        def step(dq, xs, qi=qi, doi=doi, qs=qs, qo=qo, lse_i=lse_i, delta_i=delta_i):
            kc, vc, ksc, koc = xs
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kc, preferred_element_type=jnp.float32) * scale
            p = jnp.where(_visible(qs, qo, ksc, koc), jnp.exp(s - lse_i[..., None]), 0.0)
            dvc = jnp.einsum("bhqk,bhqd->bhkd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bhqd,bhkd->bhqk", doi, vc, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(qi.dtype)
            dq = dq + jnp.einsum("bhqk,bhkd->bhqd", ds, kc, preferred_element_type=jnp.float32)
            dkc = jnp.einsum("bhqk,bhqd->bhkd", ds, qi, preferred_element_type=jnp.float32)
            return dq, (dkc, dvc)

        xs = _key_chunks(k, v, k_seg, k_ord, span, chunk)
        dq0 = vary_like(jnp.zeros(qi.shape, jnp.float32), qi, doi, qs, qo, lse_i, delta_i, k, v, k_seg, k_ord)
        if span == chunk:
            dq_i, (dk_c, dv_c) = step(dq0, jax.tree.map(lambda x: x[0], xs))
            dk_span, dv_span = dk_c, dv_c
        else:
            dq_i, (dk_c, dv_c) = jax.lax.scan(step, dq0, xs)
            merge = lambda x, span=span: rearrange(x, "n b h c d -> b h (n c) d")[:, :, :span]
            dk_span, dv_span = merge(dk_c), merge(dv_c)
        dq_blocks.append(dq_i)
        if span == k.shape[2]:
            dk, dv = dk + dk_span, dv + dv_span
        else:
            dk = dk.at[:, :, :span].add(dk_span)
            dv = dv.at[:, :, :span].add(dv_span)
    dq = jnp.concatenate(dq_blocks, axis=2) if len(dq_blocks) > 1 else dq_blocks[0]
    zeros = lambda x: jnp.zeros(x.shape, jax.dtypes.float0)
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        zeros(q_seg),
        zeros(q_ord),
        zeros(k_seg),
        zeros(k_ord),
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array,
    q_order: jax.Array,
    k_segment_ids: jax.Array,
    k_order: jax.Array,
    *,
    scale: float,
    block_q: int = 128,
    block_k: int = 1024,
    causal_skip: bool = False,
) -> jax.Array:
    """Softmax attention of q over k/v under the causal + same-segment mask (module docstring).

    q [b, h, sq, d]; k [b, h, sk, d]; v [b, h, sk, dv] -> [b, h, sq, dv] in v's dtype."""
    if q.ndim != 4 or k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"blockwise_attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
            "q [b, h, sq, d], k [b, h, sk, d], v [b, h, sk, dv]"
        )
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q={block_q}, block_k={block_k}: both must be >= 1")
    plan = tuple(_plan(q.shape[2], k.shape[2], block_q, block_k, causal_skip))
    i32 = lambda x: x.astype(jnp.int32)
    return _attention(q, k, v, i32(q_segment_ids), i32(q_order), i32(k_segment_ids), i32(k_order), float(scale), plan)
