"""`masks.AttentionContext`: a frozen pytree whose layout is static (part of the tree structure,
so jit specialises on it) and whose cached-path field is optional; attention over a KV cache
refuses a context without cache lengths with a message saying so."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from support.small_models import gqa

import composer_jax as cj
from composer_jax.model.attention import attention_cached
from composer_jax.model.masks import AttentionContext
from composer_jax.model.transformer import attention_context

CFG = gqa(cj.ModelConfig(num_layers=2, num_mtp_layers=0, max_position_embeddings=64))


def _ctx(layout="contiguous", lengths=None) -> AttentionContext:
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    return attention_context(positions, jnp.ones((2, 4), jnp.int32), positions, CFG, layout, lengths)


def test_layout_is_static_and_cache_lengths_optional():
    plain, zigzag = _ctx(), _ctx("zigzag")
    assert len(jax.tree.leaves(plain)) == 4  # cos, sin, segment_ids, order; no cache lengths
    assert jax.tree.structure(plain) != jax.tree.structure(zigzag)
    assert jax.tree.map(lambda x: x, zigzag).layout == "zigzag"
    cached = _ctx(lengths=jnp.array([3, 5], jnp.int32))
    assert len(jax.tree.leaves(cached)) == 5
    assert plain.cos.shape == (2, 4, CFG.head_dim // 2)
    seen = jax.jit(lambda c: c.cache_lengths + 1)(cached)
    assert seen.tolist() == [4, 6]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.layout = "any"


def test_cached_attention_needs_cache_lengths():
    params = cj.init_params(CFG, jax.random.key(0))
    layer = jax.tree.map(lambda w: w[0], params["moe_layers"]["attn"])
    cache = {k: jnp.zeros((2, 8, CFG.num_kv_heads, CFG.head_dim)) for k in ("k", "v")}
    x = jnp.zeros((2, 4, CFG.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="cached attention needs AttentionContext.cache_lengths"):
        attention_cached(layer, x, _ctx(), CFG, cache)
