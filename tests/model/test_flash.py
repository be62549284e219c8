"""Blockwise attention (model/flash.py) against the dense masked softmax, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model.flash import blockwise_attention

# Jitted for the value and gradient comparisons: op by op, the unrolled query blocks and their
# backward passes took most of these tests' time. Shape checks are tested on the plain function.
flash_jit = jax.jit(blockwise_attention, static_argnames=("scale", "block_q", "block_k", "causal_skip"))


def dense_reference(q, k, v, qs, qo, ks, ko, scale):
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    vis = (ko[:, None, None, :] <= qo[:, None, :, None]) & (ks[:, None, None, :] == qs[:, None, :, None])
    s = np.where(vis, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    p = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 0.0)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


def dense_jax(q, k, v, qs, qo, ks, ko, scale):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    vis = (ko[:, None, None, :] <= qo[:, None, :, None]) & (ks[:, None, None, :] == qs[:, None, :, None])
    p = jax.nn.softmax(jnp.where(vis, s, -1e30), axis=-1) * vis
    return jnp.einsum("bhqk,bhkd->bhqd", p, v)


def _inputs(b=2, h=3, s=64, d=8, dv=6, seed=0, packed=True):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, h, s, dv)).astype(np.float32)
    seg = np.ones((b, s), np.int32)
    if packed:  # row 0: three documents then padding; row 1: one document
        seg[0, 20:41] = 2
        seg[0, 41:57] = 3
        seg[0, 57:] = 0
    order = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    return q, k, v, seg, order


@pytest.mark.parametrize(
    "block_q,block_k,skip",
    [(16, 1024, True), (16, 16, True), (8, 24, True), (64, 64, False), (16, 32, False), (24, 1024, True)],
)
def test_matches_dense(block_q, block_k, skip):
    q, k, v, seg, order = _inputs()
    want = dense_reference(q, k, v, seg, order, seg, order, 0.3)
    got = flash_jit(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        seg,
        order,
        seg,
        order,
        scale=0.3,
        block_q=block_q,
        block_k=block_k,
        causal_skip=skip,
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block_q,block_k,skip", [(16, 16, True), (16, 1024, True), (32, 16, False)])
def test_gradients_match_dense(block_q, block_k, skip):
    q, k, v, seg, order = _inputs(seed=1)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 64, 6)).astype(np.float32))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * w)

    flash = lambda q, k, v: blockwise_attention(
        q, k, v, seg, order, seg, order, scale=0.3, block_q=block_q, block_k=block_k, causal_skip=skip
    )
    dense = lambda q, k, v: dense_jax(q, k, v, seg, order, seg, order, 0.3)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    g_flash = jax.jit(jax.grad(lambda *a: loss(flash, *a), argnums=(0, 1, 2)))(*args)
    g_dense = jax.jit(jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2)))(*args)
    for a, b in zip(g_flash, g_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_permuted_keys_and_rows_that_see_nothing():
    """Keys from another order (as under context parallelism): a query whose segment has no key in
    the key set gets zeros and no gradient; results equal the dense reference."""
    q, k, v, seg, order = _inputs(s=32, packed=False)
    perm = np.random.default_rng(3).permutation(32)
    ks, ko = seg[:, perm].copy(), order[:, perm].copy()
    ks[:, :] = 1
    qs = seg.copy()
    qs[0, :4] = 5  # segment 5 has no keys
    kp, vp = k[:, :, perm], v[:, :, perm]
    got = flash_jit(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), qs, order, ks, ko, scale=0.5, block_q=8, block_k=8
    )
    want = dense_reference(q, kp, vp, qs, order, ks, ko, 0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(got)[0, :, :4] == 0)
    g = jax.jit(
        jax.grad(
            lambda q: jnp.sum(
                blockwise_attention(
                    q, jnp.asarray(kp), jnp.asarray(vp), qs, order, ks, ko, scale=0.5, block_q=8, block_k=8
                )
            )
        )
    )(jnp.asarray(q))
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[0, :, :4] == 0)


def test_bad_shapes_are_named():
    q, k, v, seg, order = _inputs()
    with pytest.raises(ValueError, match="q .* do not fit"):
        blockwise_attention(jnp.asarray(q), jnp.asarray(k[:, :2]), jnp.asarray(v), seg, order, seg, order, scale=1.0)
    with pytest.raises(ValueError, match="causal_skip needs"):
        blockwise_attention(
            jnp.asarray(q),
            jnp.asarray(k[:, :, :32]),
            jnp.asarray(v[:, :, :32]),
            seg,
            order,
            seg[:, :32],
            order[:, :32],
            scale=1.0,
            causal_skip=True,
        )


# --------------------------------------------------------------------------------------------------
# Through the model: the blockwise path equals the dense reference path
# --------------------------------------------------------------------------------------------------

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import composer_jax as cj  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs/model"


# gqa in the full suite only: the blockwise function's grouped-head cases above (test_matches_dense,
# test_gradients_match_dense) and the [mla] model case keep the property by default
@pytest.mark.parametrize("attention", ["mla", pytest.param("gqa", marks=pytest.mark.slow)])
def test_model_blockwise_equals_dense(attention):
    m = cj.load_config(CONFIGS / "tiny.yaml").model
    if attention == "gqa":  # Qwen3-style: 4 query heads over 2 key/value heads, q/k norm
        m = dataclasses.replace(m, attention_type="gqa", num_kv_heads=2, head_dim=16, qk_norm=True)
    # blocks of 4 queries, key chunks of 8: the 24-token rows are 6 query blocks, causal skipping
    # and multi-chunk online softmax both happen
    blockwise = dataclasses.replace(m, attention_impl="blockwise", attn_block_q=4, attn_block_k=8)
    dense = dataclasses.replace(m, attention_impl="dense")
    params = cj.init_params(m, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, m.vocab_size)
    seg = jnp.asarray([[1] * 9 + [2] * 11 + [0] * 4, [1] * 24], jnp.int32)

    def loss(p, cfg):
        out = cj.forward(p, tokens, cfg, segment_ids=seg)
        return jnp.sum(jax.nn.log_softmax(out.logits)[..., 7]), out.logits

    (l_b, logits_b), g_b = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, blockwise)
    (l_d, logits_d), g_d = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, dense)
    np.testing.assert_allclose(np.asarray(logits_b), np.asarray(logits_d), atol=2e-5, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_b), jax.tree_util.tree_leaves(g_d)):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path)
        )


def test_memory_is_linear_in_sequence():
    """Forward + backward at 4096 tokens: the compiled temporary memory of the blockwise path stays
    far below one [heads, seq, seq] float32 score matrix (which the dense path needs)."""
    b, h, s, d = 1, 2, 4096, 16
    q = jax.ShapeDtypeStruct((b, h, s, d), jnp.float32)
    ids = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def grads(q, k, v, seg, order):
        f = lambda q, k, v: jnp.sum(
            blockwise_attention(q, k, v, seg, order, seg, order, scale=0.25, block_q=256, block_k=512, causal_skip=True)
        )
        return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

    mem = jax.jit(grads).lower(q, q, q, ids, ids).compile().memory_analysis()
    assert mem is not None, "XLA:CPU reports compiled memory; this test needs it"
    scores = b * h * s * s * 4
    assert mem.temp_size_in_bytes < scores / 4, (mem.temp_size_in_bytes, scores)


def test_plan_caps_unrolled_query_blocks():
    """Long sequences get at most MAX_QUERY_BLOCKS unrolled query blocks (compile time), every block
    the same size, spans causal, chunks dividing their span and at most block_k."""
    from composer_jax.model.flash import MAX_QUERY_BLOCKS, _plan

    plan = _plan(32768, 32768, 128, 1024, causal_skip=True)
    assert len(plan) == MAX_QUERY_BLOCKS
    assert {stop - start for start, stop, _, _ in plan} == {2048}
    assert [span for _, _, span, _ in plan] == [2048 * (i + 1) for i in range(16)]
    assert all(span % chunk == 0 and chunk <= 1024 for _, _, span, chunk in plan)
    # a length with no convenient divisor still gets equal blocks that tile the sequence
    plan = _plan(1000, 1000, 7, 64, causal_skip=False)
    sizes = {stop - start for start, stop, _, _ in plan}
    assert len(sizes) == 1 and 1000 % sizes.pop() == 0 and len(plan) <= MAX_QUERY_BLOCKS
    assert plan[-1][1] == 1000


def test_span_without_divisor_pads_keys():
    """97 keys (prime) with block_k=16: chunks of 16 over keys padded to 112 (not 97 chunks of 1);
    values and gradients still equal the dense reference."""
    from composer_jax.model.flash import _plan

    assert _plan(40, 97, 8, 16, causal_skip=False)[0][3] == 16
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 97, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 97, 4)).astype(np.float32)
    qs, ks = np.ones((1, 40), np.int32), np.ones((1, 97), np.int32)
    qo, ko = np.arange(57, 97, dtype=np.int32)[None], np.arange(97, dtype=np.int32)[None]
    flash = lambda q, k, v: blockwise_attention(q, k, v, qs, qo, ks, ko, scale=0.4, block_q=8, block_k=16)
    np.testing.assert_allclose(
        np.asarray(jax.jit(flash)(*map(jnp.asarray, (q, k, v)))),
        dense_reference(q, k, v, qs, qo, ks, ko, 0.4),
        atol=2e-6,
        rtol=1e-5,
    )
    dense = lambda q, k, v: dense_jax(q, k, v, qs, qo, ks, ko, 0.4)
    g_f = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(flash(*a))), argnums=(0, 1, 2)))(*map(jnp.asarray, (q, k, v)))
    g_d = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), argnums=(0, 1, 2)))(*map(jnp.asarray, (q, k, v)))
    for a, b in zip(g_f, g_d):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_inside_shard_map_with_gathered_keys():
    """As under context parallelism: queries split over a mesh axis, keys all-gathered, several key
    chunks per query block (the scan path, whose carry must take the queries' varying mesh axes).
    Values and gradients equal the unsharded call."""
    from jax.sharding import PartitionSpec as P

    q, k, v, seg, order = _inputs(b=2, h=2, s=32, packed=True)
    mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    kw = dict(scale=0.3, block_q=4, block_k=8)

    def body(q, k, v, seg, order):
        g = lambda x, axis: jax.lax.all_gather(x, "context", axis=axis, tiled=True)
        return blockwise_attention(q, g(k, 2), g(v, 2), seg, order, g(seg, 1), g(order, 1), **kw)

    spec4, spec2 = P(None, None, "context", None), P(None, "context")
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(spec4, spec4, spec4, spec2, spec2), out_specs=spec4)
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, seg, order)))
    plain = lambda q, k, v, s_, o_: blockwise_attention(q, k, v, s_, o_, s_, o_, **kw)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    np.testing.assert_allclose(
        np.asarray(jax.jit(sharded)(*args, seg, order)),
        np.asarray(jax.jit(plain)(*args, seg, order)),
        atol=2e-6,
        rtol=1e-5,
    )
    g_s = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(*args)
    g_p = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(*args)
    for a, b in zip(g_s, g_p):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
