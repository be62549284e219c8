"""Losses over packed sequences, each returned as (sum, denominator) in float32 so that gradient
accumulation over micro-batches is exact and the normalisation is one division at the end.

Batch convention (data pipeline): tokens, segment_ids (0 = padding), positions, loss_mask, all
[batch, seq]. Position i is trained to predict tokens[i+1] with weight
loss_mask[i+1] * (segment_ids[i+1] == segment_ids[i] != 0).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array, z_loss: float = 0.0):
    """Token-level cross-entropy with PaLM's z-loss. logits float32[..., vocab]; targets int32[...];
    weights float32[...]. Returns (nll_sum, z_sum, weight_sum, correct_sum)."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = (log_z - target_logit) * weights
    z = z_loss * jnp.square(log_z) * weights
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32) * weights
    return nll.sum(), z.sum(), weights.sum(), correct.sum()


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
