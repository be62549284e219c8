"""Packed-sequence masks: positions within segments, and which keys each query may see.

Shared by local attention (`attention.py`, `flash.py`) and context-parallel attention
(`context_parallel.py`), where queries and keys come from different devices' blocks; both read
them from the `AttentionContext` that `transformer.forward` builds once per pass.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """int32[batch, seq] segment ids -> int32[batch, seq] position of each token in its segment."""
    seq = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    is_start = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1
    )
    start = jax.lax.cummax(jnp.where(is_start, idx, 0), axis=segment_ids.ndim - 1)
    return idx - start


def causal_segment_mask(
    segment_ids: jax.Array,
    order: jax.Array | None = None,
    k_segment_ids: jax.Array | None = None,
    k_order: jax.Array | None = None,
) -> jax.Array:
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


Layout = Literal["contiguous", "zigzag", "any"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag", "any")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What every attention layer of one forward pass reads besides its input.

    cos, sin: float32[batch, seq, rope/2], the rotary tables at each token's position.
    segment_ids: int32[batch, seq] (0 = padding; no attention across segments); order:
    int32[batch, seq], each token's original index (causality follows it when the sequence axis
    is permuted). layout (static): "contiguous" promises that order increases along the sequence
    (blockwise attention skips key blocks after each query block), "zigzag" the
    context-parallel permutation, "any" anything else.
    cache_lengths: int32[batch], the tokens already in each row's KV cache, on the cached path
    only (None without a cache); the new tokens then see the cache (`kv_cache.cached_visibility`)
    and segment_ids / order are not read."""

    cos: jax.Array
    sin: jax.Array
    segment_ids: jax.Array
    order: jax.Array
    layout: Layout = dataclasses.field(default="contiguous", metadata=dict(static=True))
    cache_lengths: jax.Array | None = None
