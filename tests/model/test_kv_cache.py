"""Decoding with the KV cache equals recomputing the full forward at every step: the same greedy
tokens and log-probabilities within 1e-5, for MLA (with and without query LoRA, with YaRN) and GQA;
prefill in chunks equals one prefill; routing is the one the full forward picks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.small_models import gqa, mla_yarn

import composer_jax as cj
from composer_jax.model.attention import grouped_attend
from composer_jax.model.kv_cache import cached_visibility, init_cache
from composer_jax.model.transformer import forward_cached

BASE = cj.ModelConfig(num_layers=3, num_mtp_layers=0, max_position_embeddings=64)
CONFIGS = {
    "mla_q_lora": dataclasses.replace(BASE, q_lora_rank=32),
    "mla_yarn": mla_yarn(BASE),
    "gqa": gqa(BASE),
}


def _full_forward_check(params, cfg, seq, prompt_len):
    """Reference: the full forward over the whole sequence. Causal attention makes its logits at
    position t those of recomputing the model on seq[:, :t+1] alone, so one pass checks every step:
    the greedy token after t is seq[:, t+1]. Returns (log-probs of the chosen tokens, routing)."""
    out = jax.jit(lambda p, t: cj.forward(p, t, cfg))(params, jnp.asarray(seq))
    lp = jax.nn.log_softmax(out.logits[:, prompt_len - 1 : -1], axis=-1)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(lp, axis=-1)), seq[:, prompt_len:])
    chosen = jnp.take_along_axis(lp, jnp.asarray(seq)[:, prompt_len:, None], axis=-1)[..., 0]
    routes = [np.asarray(out.routing[:, :, t]) for t in range(prompt_len - 1, seq.shape[1] - 1)]
    return np.asarray(chosen), routes


def _greedy_cached(params, cfg, prompt, steps, chunks=1):
    fwd = jax.jit(lambda p, t, c: forward_cached(p, t, cfg, c))
    cache = init_cache(cfg, prompt.shape[0], 32)
    bounds = np.linspace(0, prompt.shape[1], chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):  # prefill, possibly in chunks
        out = fwd(params, prompt[:, a:b], cache)
        cache = out.cache
    seq, logps, routes = prompt, [], []
    for _ in range(steps):
        lp = jax.nn.log_softmax(out.logits[:, -1], axis=-1)
        nxt = jnp.argmax(lp, axis=-1).astype(jnp.int32)
        logps.append(np.asarray(jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]))
        routes.append(np.asarray(out.routing[:, :, -1]))
        seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
        out = fwd(params, nxt[:, None], cache)
        cache = out.cache
    assert np.all(np.asarray(cache.lengths) == seq.shape[1])
    return np.asarray(seq), np.stack(logps, 1), routes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_full_recompute(name):
    cfg = CONFIGS[name]
    params = cj.init_params(cfg, jax.random.key(1))
    prompt = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size, jnp.int32)
    # 7 + 12 = 19 tokens: past YaRN's original 16 positions, so the extended rotary range is used
    seq, lp, routes = _greedy_cached(params, cfg, prompt, 12)
    ref_lp, ref_routes = _full_forward_check(params, cfg, seq, prompt.shape[1])
    np.testing.assert_allclose(lp, ref_lp, atol=1e-5, rtol=0)
    for r, ref in zip(routes, ref_routes):
        np.testing.assert_array_equal(r, ref)


def test_chunked_prefill_equals_one_prefill():
    cfg = CONFIGS["mla_q_lora"]
    params = cj.init_params(cfg, jax.random.key(1))
    prompt = jax.random.randint(jax.random.key(3), (2, 9), 0, cfg.vocab_size, jnp.int32)
    one = _greedy_cached(params, cfg, prompt, 4, chunks=1)
    three = _greedy_cached(params, cfg, prompt, 4, chunks=3)
    np.testing.assert_array_equal(one[0], three[0])
    np.testing.assert_allclose(one[1], three[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("cached", [False, True])
def test_logits_at_one_position_per_row_equal_the_full_heads_there(cached):
    cfg = CONFIGS["mla_yarn"]
    params = cj.init_params(cfg, jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(4), (3, 11), 0, cfg.vocab_size, jnp.int32)
    at = jnp.asarray([10, 0, 6], jnp.int32)
    if cached:
        run = lambda **kw: forward_cached(params, tokens, cfg, init_cache(cfg, 3, 32), **kw)
    else:
        run = lambda **kw: cj.forward(params, tokens, cfg, **kw)
    full = run()
    one = run(logits_at=at)
    assert one.logits.shape == (3, 1, cfg.vocab_size)
    want = np.asarray(full.logits)[np.arange(3), np.asarray(at)]
    np.testing.assert_allclose(np.asarray(one.logits[:, 0]), want, atol=1e-5, rtol=1e-5)
    # everything else is every position's, as without it
    np.testing.assert_array_equal(np.asarray(one.routing), np.asarray(full.routing))
    np.testing.assert_array_equal(np.asarray(one.hidden), np.asarray(full.hidden))
    if cached:
        for a_, b_ in zip(jax.tree.leaves(one.cache), jax.tree.leaves(full.cache)):
            np.testing.assert_array_equal(np.asarray(a_), np.asarray(b_))


def test_mla_cache_holds_latent_and_rotary_key_only():
    cfg = CONFIGS["mla_q_lora"]
    cache = init_cache(cfg, 2, 32)
    shapes = {s: {k: v.shape for k, v in d.items()} for s, d in cache.layers.items()}
    # 1 dense + 2 MoE layers; per token kv_lora (32) + rope (8) numbers, whatever the heads (4 x 32)
    assert shapes == {
        "dense_layers": {"latent": (1, 2, 32, 32), "k_rope": (1, 2, 32, 8)},
        "moe_layers": {"latent": (2, 2, 32, 32), "k_rope": (2, 2, 32, 8)},
    }
    with pytest.raises(ValueError, match="max_len=65 exceeds model.max_position_embeddings=64"):
        init_cache(cfg, 2, 65)


def test_cache_is_sharded_by_logical_axes():
    cfg = CONFIGS["gqa"]
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, tensor=2))
    cache = init_cache(cfg, 4, 16, mesh)
    spec = cache.layers["moe_layers"]["k"].sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"), None, "tensor", None)


def _repeat_attend(q, k, v, visible, scale):
    """The form `grouped_attend` replaced: each KV head repeated for its query group, then plain
    multi-head attention."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(visible, scores, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


@pytest.mark.parametrize("heads, kv_heads, new", [(8, 2, 1), (6, 3, 3), (4, 4, 2), (4, 1, 1)])
def test_grouped_attend_equals_repeating_the_kv_heads(heads, kv_heads, new):
    b, cap, d = 3, 24, 16
    kq, kk, kv = jax.random.split(jax.random.key(heads * 10 + kv_heads), 3)
    q = jax.random.normal(kq, (b, new, heads, d), jnp.float32)
    k = jax.random.normal(kk, (b, cap, kv_heads, d), jnp.float32)
    v = jax.random.normal(kv, (b, cap, kv_heads, d), jnp.float32)
    lengths = jnp.asarray([0, 9, cap - new], jnp.int32)  # an empty row, a partial one, a full one
    visible = cached_visibility(lengths, new, cap)
    got = jax.jit(grouped_attend, static_argnums=4)(q, k, v, visible, 0.25)
    want = jax.jit(_repeat_attend, static_argnums=4)(q, k, v, visible, 0.25)
    assert got.shape == (b, new, heads, d)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    # query head h reads KV head h // groups: swapping two KV heads' values changes the heads of
    # the first group only when there is more than one KV head
    if kv_heads > 1:
        v2 = v.at[:, :, 0].set(v[:, :, 1])
        moved = np.asarray(grouped_attend(q, k, v2, visible, 0.25) != got).any(axis=(0, 1, 3))
        groups = heads // kv_heads
        assert moved[:groups].all() and not moved[groups:].any()
