"""The MoE inference-step path (`moe.decode_swiglu`): every scheme against a numpy reference (one
assignment at a time), a slice of the experts as an expert-parallel device holds them, replayed
routing with a duplicate expert, which scheme a step takes, and the whole layer with a KV cache
against the training dispatch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.model.kv_cache import init_cache
from composer_jax.model.moe import decode as moe
from composer_jax.model.params import init_params
from composer_jax.model.transformer import forward_cached

E, D, F, K = 8, 16, 12, 2


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32) * 0.3 for s in [(E, D, F), (E, D, F), (E, F, D)])


def _reference(x, experts, weights, gate, up, down, first=0, count=E):
    """sum over assignments to experts first..first+count-1 of w * SwiGLU_e(x), one at a time."""
    silu = lambda z: z / (1 + np.exp(-z))
    y = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            if first <= e < first + count:
                h = silu(x[t] @ gate[e]) * (x[t] @ up[e])
                y[t] += weights[t, j] * (h @ down[e])
    return y


@pytest.mark.parametrize("strategy", ["loop", "dense", "grouped", "tiled"])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_each_scheme_equals_the_per_assignment_reference(strategy, tokens):
    rng = np.random.default_rng(tokens)
    gate, up, down = _weights()
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32)
    experts[0] = [5, 5]  # a replayed routing may name one expert twice: both assignments count
    w = rng.random((tokens, K)).astype(np.float32)
    fn = jax.jit(moe.decode_swiglu, static_argnums=(6, 7))
    y = fn(x, experts, w, gate, up, down, strategy, 4)
    np.testing.assert_allclose(np.asarray(y), _reference(x, experts, w, gate, up, down), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("strategy", ["loop", "dense", "grouped"])
def test_a_slice_of_the_experts_sums_only_its_own_assignments(strategy):
    rng = np.random.default_rng(7)
    gate, up, down = _weights()
    x = rng.standard_normal((5, D)).astype(np.float32)
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(5)]).astype(np.int32)
    w = rng.random((5, K)).astype(np.float32)
    parts = []
    for first in range(0, E, 2):  # four devices of two experts each
        sl = slice(first, first + 2)
        y = moe.decode_swiglu(x, experts, w, gate[sl], up[sl], down[sl], strategy, first_expert=jnp.int32(first))
        np.testing.assert_allclose(
            np.asarray(y), _reference(x, experts, w, gate, up, down, first, 2), rtol=2e-5, atol=2e-5
        )
        parts.append(np.asarray(y))
    np.testing.assert_allclose(sum(parts), _reference(x, experts, w, gate, up, down), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("strategy", ["loop", "grouped"])
def test_the_loop_skips_experts_nobody_chose(strategy):
    """An expert no token chose is never evaluated: NaN weights there do not reach the output."""
    gate, up, down = (a.copy() for a in _weights())
    gate[3] = np.nan
    x = np.ones((2, D), np.float32)
    experts = np.array([[0, 1], [1, 2]], np.int32)
    w = np.full((2, K), 0.5, np.float32)
    y = np.asarray(moe.decode_swiglu(x, experts, w, gate, up, down, strategy))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, _reference(x, experts, w, gate, up, down), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
def test_grouped_tiles_of_any_size(rows):
    """An expert's assignments spread over several tiles (rows 1-3 for up to 9 of them), or one tile
    padded well past them (16): the same sums; a slice of the experts counts only its own."""
    rng = np.random.default_rng(rows)
    gate, up, down = _weights()
    x = rng.standard_normal((12, D)).astype(np.float32)
    experts = rng.integers(0, 3, (12, K)).astype(np.int32)  # 24 assignments onto experts 0-2
    experts[:, 1] = np.where(experts[:, 1] == experts[:, 0], 7, experts[:, 1])
    w = rng.random((12, K)).astype(np.float32)
    fn = jax.jit(moe.decode_swiglu, static_argnames=("strategy", "rows"))
    y = fn(x, experts, w, gate, up, down, strategy="grouped", rows=rows)
    np.testing.assert_allclose(np.asarray(y), _reference(x, experts, w, gate, up, down), rtol=2e-5, atol=2e-5)
    part = fn(x, experts, w, gate[1:3], up[1:3], down[1:3], strategy="grouped", first_expert=1, rows=rows)
    np.testing.assert_allclose(np.asarray(part), _reference(x, experts, w, gate, up, down, 1, 2), rtol=2e-5, atol=2e-5)


def test_grouped_rows():
    assert moe.grouped_rows(4, 4, 16) == 4  # a verify window: one tile per distinct expert
    assert moe.grouped_rows(16, 4, 16) == 4  # batch 16: 64 assignments, 4 per expert on average
    assert moe.grouped_rows(32, 4, 16) == 8
    assert moe.grouped_rows(256, 4, 16) == 64
    assert moe.grouped_rows(1024, 4, 16) == 64


def test_strategy_by_step_size():
    # the reference model: 16 experts, top-4
    assert moe.decode_strategy(1, 4, 16) == "loop"  # a batch-1 decode step
    assert moe.decode_strategy(4, 4, 16) == "loop"  # a verify window of k = 3
    assert moe.decode_strategy(8, 4, 16) == "loop"
    assert moe.decode_strategy(9, 4, 16) == "grouped"
    assert moe.decode_strategy(16, 4, 16) == "grouped"  # batch 16
    assert moe.decode_strategy(moe.GROUPED_MAX_TOKENS + 1, 4, 16) == "tiled"  # a long prefill
    with pytest.raises(ValueError, match="accepted: loop, dense, grouped, tiled"):
        moe.decode_swiglu(
            *(np.zeros((1, D), np.float32), np.zeros((1, K), np.int32), np.ones((1, K))), *_weights(), "x"
        )


@pytest.mark.parametrize("seq", [1, 3, 40])
def test_cached_forward_equals_the_training_forward(seq):
    """The MoE layer inside `forward_cached` (decode_swiglu) against the training forward
    (the tiled / gathered dispatch) on the same tokens: same routing, logits within 1e-5."""
    cfg = dataclasses.replace(cj.ModelConfig(num_layers=2, max_position_embeddings=64), moe_tile_size=8)
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(seq).integers(0, cfg.vocab_size, (2, seq)), jnp.int32)
    train = cj.forward(params, tokens, cfg)
    cached = forward_cached(params, tokens, cfg, init_cache(cfg, 2, 64))
    np.testing.assert_array_equal(np.asarray(cached.routing), np.asarray(train.routing))
    np.testing.assert_allclose(np.asarray(cached.logits), np.asarray(train.logits), rtol=1e-5, atol=1e-5)
