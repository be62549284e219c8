"""Losses over packed sequences, each returned as (sum, denominator) in float32 so that gradient
accumulation over micro-batches is exact and the normalisation is one division at the end.

Batch convention (data pipeline): tokens, segment_ids (0 = padding), positions, loss_mask, all
[batch, seq]. Position i is trained to predict tokens[i+1] with weight
loss_mask[i+1] * (segment_ids[i+1] == segment_ids[i] != 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange


def shifted_targets(tokens: jax.Array, segment_ids: jax.Array, loss_mask: jax.Array, shift: int):
    """Targets `shift` tokens ahead and their weights. [batch, seq] -> ([batch, seq], [batch, seq]).

    The weight is nonzero only when tokens i..i+shift all lie in the same (non-padding) segment."""
    b, s = tokens.shape
    pad = lambda x, v: jnp.concatenate([x[:, shift:], jnp.full((b, shift), v, x.dtype)], axis=1)
    targets = pad(tokens, 0)
    weight = pad(loss_mask.astype(jnp.float32), 0.0)
    same = segment_ids != 0
    for j in range(1, shift + 1):
        nxt = jnp.concatenate([segment_ids[:, j:], jnp.zeros((b, j), segment_ids.dtype)], axis=1)
        same = same & (nxt == segment_ids)
    return targets, weight * same


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    z_loss: float = 0.0,
    groups: jax.Array | None = None,
    num_groups: int = 0,
):
    """Token-level cross-entropy with PaLM's z-loss. logits float32[..., vocab]; targets int32[...];
    weights float32[...]. Returns (nll_sum, z_sum, weight_sum, correct_sum), and with `groups`
    (int32[...] in 0..num_groups-1) a fifth value, the nll sum per group."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = (log_z - target_logit) * weights
    z = z_loss * jnp.square(log_z) * weights
    # top-1: the target holds the largest logit (exact float ties count as correct)
    correct = (target_logit >= jnp.max(logits, -1)).astype(jnp.float32) * weights
    if groups is not None:
        return nll.sum(), z.sum(), weights.sum(), correct.sum(), grouped_sum(nll, groups, num_groups)
    return nll.sum(), z.sum(), weights.sum(), correct.sum()


def fused_linear_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    z_loss: float = 0.0,
    chunks: int = 1,
    groups: jax.Array | None = None,
    num_groups: int = 0,
):
    """`cross_entropy(hidden @ head, ...)` with the gradient computed chunk by chunk in the forward pass.

    hidden: [batch, seq, embed]; head: [embed, vocab]; targets int32[batch, seq]; weights
    float32[batch, seq]. Returns (loss_sum, nll_sum, z_sum, weight_sum, correct_sum): loss_sum =
    nll_sum + z_sum is the differentiable objective (w.r.t. hidden and head); the other four are
    metrics with no gradient. Same numbers as `cross_entropy` on float32 logits (up to summation
    order). With `groups` (int32[batch, seq] in 0..num_groups-1, e.g. each token's data source) a
    sixth value: the nll sum per group, float32[num_groups] (`grouped_sum` of the per-token nll).

    Why: differentiating `cross_entropy(einsum(hidden, head))` makes XLA:CPU materialise the
    float32 [tokens, vocab] logits gradient, scatter the target term into it and transpose it
    (0.5 GB each at 4096 tokens x 32000 vocab) before the two backward matmuls; this was ~2/3 of the
    whole training step on CPU. Here each chunk of `seq / chunks` positions builds its logits, their
    gradient d(nll + z)/dlogits = w * (softmax * (1 + 2 z_loss logZ) - onehot(target)) and
    contributes d hidden = dlogits head^T and d head += hidden^T dlogits, so no [tokens, vocab]
    array outlives its chunk and the backward is a scaling by the incoming cotangent.
    """
    b, s, d = hidden.shape
    if s % chunks:
        raise ValueError(f"chunks={chunks} must divide the sequence length {s}")
    if groups is None:
        groups, num_groups = jnp.zeros(targets.shape, jnp.int32), 0
    loss, metrics = _fused_ce(
        hidden, head, targets, weights.astype(jnp.float32), groups, float(z_loss), int(chunks), int(num_groups)
    )
    metrics = metrics if num_groups else metrics[:4]
    return (loss,) + tuple(jax.lax.stop_gradient(m) for m in metrics)


def grouped_sum(values: jax.Array, groups: jax.Array, num_groups: int) -> jax.Array:
    """float32[num_groups]: the sum of `values` over the positions of each group (ids outside
    0..num_groups-1 are dropped)."""
    return jax.ops.segment_sum(values.reshape(-1).astype(jnp.float32), groups.reshape(-1), num_groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _fused_ce(hidden, head, targets, weights, groups, z_loss, chunks, num_groups):
    return _fused_ce_fwd(hidden, head, targets, weights, groups, z_loss, chunks, num_groups)[0]


def _fused_ce_fwd(hidden, head, targets, weights, groups, z_loss, chunks, num_groups):
    b, s, d = hidden.shape
    c = s // chunks
    split = lambda x: rearrange(x, "b (chunk c) ... -> chunk b c ...", chunk=chunks)  # chunks along seq
    head_c = head.astype(hidden.dtype)
    # [vocab, embed] once, so the d hidden product reads its weight in row-major order (XLA:CPU
    # transposed the [embed, vocab] operand for every chunk)
    head_t = jnp.transpose(head).astype(jnp.float32)
    rows = jnp.arange(b)[:, None], jnp.arange(c)[None, :]

    def chunk(d_head, xs):
        h, t, w, g = xs
        logits = jnp.einsum("bsd,dv->bsv", h, head_c, preferred_element_type=jnp.float32)
        top = jnp.max(logits, axis=-1)
        log_z = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
        target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        scale = w * (1.0 + 2.0 * z_loss * log_z)  # d(nll + z_loss logZ^2) / d logZ, weighted
        # float32 like the logits; the two backward matmuls in float32 (a no-op for float32 models).
        # The one-hot term is a scatter of the chunk's targets, not a [tokens, vocab] comparison.
        d_logits = jnp.exp(logits - log_z[..., None]) * scale[..., None]
        d_logits = d_logits.at[rows[0], rows[1], t].add(-w, unique_indices=True)
        d_h = jnp.einsum("bsv,vd->bsd", d_logits, head_t).astype(h.dtype)
        d_head = d_head + jnp.einsum("bsd,bsv->dv", h.astype(jnp.float32), d_logits)
        nll = jnp.sum((log_z - target_logit) * w)
        z = jnp.sum(z_loss * jnp.square(log_z) * w)
        # the target holds the largest logit (ties count as correct: the top-1 accuracy of
        # `cross_entropy` up to exact float ties), without a separate arg-max pass over the vocabulary
        correct = jnp.sum((target_logit >= top).astype(jnp.float32) * w)
        by_group = grouped_sum((log_z - target_logit) * w, g, num_groups)  # [0] when num_groups is 0
        return d_head, (nll, z, correct, by_group, d_h)

    d_head, (nll, z, correct, by_group, d_h) = jax.lax.scan(
        chunk, jnp.zeros(head.shape, jnp.float32), (split(hidden), split(targets), split(weights), split(groups))
    )
    d_h = rearrange(d_h, "chunk b c d -> b (chunk c) d")
    nll, z = nll.sum(), z.sum()
    out = (nll + z, (nll, z, weights.sum(), correct.sum(), by_group.sum(0)))
    return out, (d_h, d_head.astype(head.dtype), targets, weights, groups)


def _fused_ce_bwd(z_loss, chunks, num_groups, res, cotangents):
    d_h, d_head, targets, weights, groups = res
    g = cotangents[0]  # the metrics are stop-gradient'ed by the caller: their cotangents are ignored
    return (
        (g * d_h).astype(d_h.dtype),
        (g * d_head).astype(d_head.dtype),
        np.zeros(targets.shape, jax.dtypes.float0),
        jnp.zeros_like(weights),
        np.zeros(groups.shape, jax.dtypes.float0),
    )


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def self_distillation(student_logits: jax.Array, teacher_logits: jax.Array, weights: jax.Array):
    """KL(teacher || student) per token with the teacher stopped (the report trains its MTP layers
    on the main model's next-token distribution). Returns (kl_sum, weight_sum)."""
    t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)), axis=-1)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(t) * (t - s), axis=-1) * weights
    return kl.sum(), weights.sum()


def gather_seq(x: jax.Array, index: jax.Array) -> jax.Array:
    """x: [batch, seq, ...]; index: int32[batch, seq] -> x[b, index[b, i], ...]."""
    idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)
