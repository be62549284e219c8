"""MoE routing and dispatch against numpy references and hand-worked examples."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.moe_cases import moe_cfg as _cfg
from support.moe_cases import moe_params as _moe_params
from support.moe_cases import numpy_moe as _numpy_moe

from composer_jax.model.moe import layer, router


def test_grouped_routing_hand_worked():
    # 8 experts in 4 groups of 2; scores (sigmoid of logits chosen so scores are easy to read).
    scores = np.array([[0.9, 0.1, 0.5, 0.45, 0.2, 0.3, 0.8, 0.05]], np.float32)
    bias = np.array([0, 0, 0, 0, 0, 0, 0, 0.5], np.float32)
    # group sums of top-2 (scores + bias): g0 = 1.0, g1 = 0.95, g2 = 0.5, g3 = 0.8 + 0.55 = 1.35
    # -> top-2 groups {g3, g0}; candidates e0 .9, e1 .1, e6 .8, e7 .55 (biased) -> top-2 = e0, e6.
    # gate weights use the unbiased scores: .9, .8 -> normalised .529.., .470.. -> x 2.5
    logits = np.log(scores / (1 - scores))
    x = np.ones((1, 8), np.float32)  # x @ diag(logits) = logits
    r = router.route(jnp.asarray(np.diag(logits[0])), jnp.asarray(bias), jnp.asarray(x), _cfg())
    assert sorted(np.asarray(r.experts)[0].tolist()) == [0, 6]
    w = dict(zip(np.asarray(r.experts)[0].tolist(), np.asarray(r.weights)[0].tolist()))
    np.testing.assert_allclose([w[0], w[6]], [0.9 / 1.7 * 2.5, 0.8 / 1.7 * 2.5], rtol=1e-5)


def test_bias_changes_selection_not_weights():
    cfg = _cfg(n_group=1, topk_group=1, num_experts_per_tok=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    logits = jnp.array([[2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    eye = jnp.eye(8)
    r0 = router.route(eye, jnp.zeros(8), logits, cfg)
    r1 = router.route(eye, jnp.array([0, 0.5, 0, 0, 0, 0, 0, 0.0]), logits, cfg)
    assert int(r0.experts[0, 0]) == 0 and int(r1.experts[0, 0]) == 1
    np.testing.assert_allclose(float(r1.weights[0, 0]), 1 / (1 + np.exp(-1.0)), rtol=1e-6)


def test_group_limited_softmax_v2_rule():
    # DeepSeek-V2: softmax scores, group score = max within group, no renormalisation.
    cfg = _cfg(
        score_func="softmax",
        topk_method="group_limited",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        n_group=2,
        topk_group=1,
    )
    logits = jnp.array([[0.0, 3.0, 0.1, 0.2, 2.9, 2.8, 2.7, 0.0]])
    r = router.route(jnp.eye(8), jnp.zeros(8), logits, cfg)
    # group 0 = e0..3 (max 3.0), group 1 = e4..7 (max 2.9): group 0 wins although e4,e5 beat e3,e2
    assert sorted(np.asarray(r.experts[0]).tolist()) == [1, 3]
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(sorted(np.asarray(r.weights[0]).tolist()), sorted([p[1], p[3]]), rtol=1e-5)


def _numpy_reference(p, x, cfg):
    """The numpy MoE over x's tokens, routed by the library's router: [tokens, embed]."""
    r = router.route(p["router"], p["router_bias"], x.reshape(-1, cfg.hidden_size), cfg)
    flat = np.asarray(x).reshape(-1, cfg.hidden_size)
    return _numpy_moe(jax.tree.map(np.asarray, p), flat, cfg, np.asarray(r.experts), np.asarray(r.weights))


@pytest.mark.parametrize("impl", ["tiled", "ragged", "dense"])
@pytest.mark.parametrize("tile", [8, 128])
def test_dispatch_matches_numpy(impl, tile):
    cfg = _cfg(moe_impl=impl, moe_tile_size=tile)
    p = _moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 37, cfg.hidden_size))
    y, experts, stats = layer.moe_layer(p, x, cfg, None)
    counts = stats["expert_counts"]
    ref = _numpy_reference(p, x, cfg)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, cfg.hidden_size), ref, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(np.asarray(experts).ravel(), minlength=8))
    assert float(counts.sum()) == 2 * 37 * 2


@pytest.mark.parametrize("tile", [8, 128])
def test_tiled_gradient_matches_dense(tile):
    """The tiled dispatch moves rows by gathers with hand-written backward passes (tokens ->
    padded tiles -> assignments, per-tile expert weights): its gradients equal autodiff's of the
    dense reference, with several tiles per expert (8) and one (128)."""
    cfg = _cfg(moe_tile_size=tile)
    p = _moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 21, cfg.hidden_size))

    def loss(p, x, impl):
        y, _, _ = layer.moe_layer(p, x, dataclasses.replace(cfg, moe_impl=impl), None)
        return jnp.sum(jnp.sin(y))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)  # op by op took ~40 s
    g_tiled = grad(p, x, "tiled")
    g_dense = grad(p, x, "dense")
    for a, b in zip(jax.tree.leaves(g_tiled), jax.tree.leaves(g_dense)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_router_replay_uses_recorded_experts():
    cfg = _cfg()
    p = _moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 9, cfg.hidden_size))
    forced = jnp.tile(jnp.array([3, 5], jnp.int32), (1, 9, 1))
    y, experts, stats = layer.moe_layer(p, x, cfg, None, routing=forced)
    counts = stats["expert_counts"]
    assert (np.asarray(experts) == np.asarray(forced)).all()
    assert np.asarray(counts).tolist() == [0, 0, 0, 9, 0, 9, 0, 0]
    # gate weights are the current router's scores of the replayed experts, renormalised
    s = jax.nn.sigmoid(x.reshape(9, -1) @ p["router"])[:, jnp.array([3, 5])]
    w = s / s.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    ref = _numpy_moe(
        jax.tree.map(np.asarray, p), np.asarray(x).reshape(9, -1), cfg, np.asarray(forced[0]), np.asarray(w)
    )
    np.testing.assert_allclose(np.asarray(y).reshape(9, -1), ref, atol=1e-5)


def test_router_bias_update_rule():
    # DeepSeek-V3: overloaded experts' bias falls by u, underloaded rises by u, mean-loaded stays.
    bias = jnp.zeros((2, 4))
    counts = jnp.array([[10.0, 2.0, 4.0, 0.0], [4.0, 4.0, 4.0, 4.0]])  # mean 4 in both layers
    out = router.router_bias_update(bias, counts, 0.01)
    np.testing.assert_allclose(np.asarray(out), [[-0.01, 0.01, 0.0, 0.01], [0, 0, 0, 0]])


def test_sequence_balance_hand_worked():
    # one sequence of 2 tokens, 4 experts, k=1. Token scores (already normalised):
    # t0 = [.7, .1, .1, .1] picks e0; t1 = [.1, .1, .7, .1] picks e2.
    # f = E/(kS) * counts = 4/2 * [1, 0, 1, 0] = [2, 0, 2, 0]; P = mean scores = [.4, .1, .4, .1]
    # loss = 2 * .4 + 2 * .4 = 1.6
    scores = jnp.array([[[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]]])
    experts = jnp.array([[[0], [2]]])
    np.testing.assert_allclose(float(router.sequence_balance(scores, experts, 4)), 1.6, rtol=1e-6)
    # perfectly balanced choices with uniform scores give exactly 1 per sequence
    uni = jnp.full((3, 4, 4), 0.25)
    np.testing.assert_allclose(
        float(router.sequence_balance(uni, jnp.array([[[0], [1], [2], [3]]] * 3), 4)), 3.0, rtol=1e-6
    )


def test_forward_rejects_inputs_of_the_wrong_shape_or_type():
    import chex
    import jax.numpy as jnp

    import composer_jax as cj

    cfg = cj.ModelConfig(num_layers=2, num_mtp_layers=0)
    params = cj.init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(AssertionError):  # [seq] instead of [batch, seq]
        cj.forward(params, tokens[0], cfg)
    with pytest.raises(AssertionError):  # float tokens
        cj.forward(params, tokens.astype(jnp.float32), cfg)
    with pytest.raises(AssertionError):  # segment ids of another shape
        cj.forward(params, tokens, cfg, segment_ids=jnp.ones((2, 7), jnp.int32))
    with pytest.raises(AssertionError):  # routing must be [moe_layers, batch, seq, k]
        cj.forward(params, tokens, cfg, routing=jnp.zeros((1, 2, 8, 3), jnp.int32))
    out = cj.forward(params, tokens, cfg, routing=jnp.zeros((1, 2, 8, 2), jnp.int32))
    chex.assert_shape(out.logits, (2, 8, cfg.vocab_size))


def test_decode_path_gathers_only_the_experts_in_use():
    """With fewer assignments than experts (decoding: 3 tokens x top-2 < 8 experts) the auto path
    gathers each assignment's expert weights; output and gradients equal the numpy reference and
    the dense path's autodiff."""
    cfg = _cfg(moe_impl="auto")
    p = _moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (3, 1, cfg.hidden_size))
    y, experts, _ = layer.moe_layer(p, x, cfg, None)
    ref = _numpy_reference(p, x, cfg)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, cfg.hidden_size), ref, atol=1e-5)
    loss = lambda p, x, impl: jnp.sum(layer.moe_layer(p, x, dataclasses.replace(cfg, moe_impl=impl), None)[0] ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)  # op by op took ~20 s
    g_auto = grad(p, x, "auto")
    g_dense = grad(p, x, "dense")
    for a, b in zip(jax.tree.leaves(g_auto), jax.tree.leaves(g_dense)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
