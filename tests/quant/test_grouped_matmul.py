"""The quantised grouped matmuls: gradients against float32 within stated bounds, the exact
products each recipe defines, the ragged and tiled layouts agreeing, and per-token NVFP4 keeping a
token's output independent of the rest of the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.quant import grouped_matmul as G
from composer_jax.quant import recipe as R
from composer_jax.quant.formats import fake_quantize

# Relative Frobenius-norm error of a quantised product against float32, with Gaussian operands
# (measured: MXFP8 E4M3 with round-up scales 0.037-0.038 for y, dx and dw; NVFP4 forward 0.13-0.14).
BOUND = {"mxfp8": 0.05, "nvfp4": 0.17}
SIZES = [40, 0, 77, 3, 50, 0, 60, 16]  # ragged, empty groups, 10 trailing rows past the groups
ROWS, K, N = 256, 64, 32


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(ROWS, K)).astype(np.float32))
    w = jnp.asarray((rng.normal(size=(len(SIZES), K, N)) / 8).astype(np.float32))
    dy = jnp.asarray(rng.normal(size=(ROWS, N)).astype(np.float32))
    return x, w, jnp.asarray(SIZES, jnp.int32), dy


def _value_and_grads(f, x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4_fwd_mxfp8_bwd"])
def test_ragged_gradients_agree_with_float32_within_the_stated_bound(name):
    x, w, sizes, dy = _data()
    ref = jax.jit(lambda x, w: _value_and_grads(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w, dy))(x, w)
    r = R.recipe(name)
    got = jax.jit(lambda x, w: _value_and_grads(lambda a, b: G.ragged_matmul(a, b, sizes, r), x, w, dy))(x, w)
    fwd_bound = BOUND["nvfp4" if name.startswith("nvfp4") else "mxfp8"]
    valid = np.arange(ROWS) < sum(SIZES)
    assert _rel(got[0][valid], ref[0][valid]) < fwd_bound
    assert np.all(np.asarray(got[0])[~valid] == 0) and np.all(np.asarray(got[1])[~valid] == 0)
    assert _rel(got[1], ref[1]) < BOUND["mxfp8"]  # dgrad
    assert _rel(got[2], ref[2]) < BOUND["mxfp8"]  # wgrad
    np.testing.assert_array_equal(np.asarray(got[2])[[1, 5]], 0.0)  # empty groups get no gradient
    # bf16 for scale: its gradients are ~100x closer
    bf = lambda a: a.astype(jnp.bfloat16)
    ref_bf = jax.lax.ragged_dot(bf(x), bf(w), sizes, preferred_element_type=jnp.float32)
    assert _rel(ref_bf, ref[0]) < 0.01


def test_the_products_are_the_ones_the_recipe_defines():
    """Forward NVFP4 (per-token activations, per-expert weights) along k; dgrad MXFP8 along n;
    wgrad MXFP8 along the rows of each group - checked against products written out per group."""
    x, w, sizes, dy = _data(1)
    r = R.recipe("nvfp4_fwd_mxfp8_bwd")
    y, dx, dw = jax.jit(lambda x, w: _value_and_grads(lambda a, b: G.ragged_matmul(a, b, sizes, r), x, w, dy))(x, w)
    xq = np.asarray(fake_quantize(x, "nvfp4", 1, second="token"))
    wq = np.asarray(fake_quantize(w, "nvfp4", 1, second=(1, 2)))
    mx = lambda a, axis: np.asarray(fake_quantize(a, "mxfp8_e4m3", axis, rule="ceil"))
    dyq, wb = mx(dy, 1), mx(w, 2)
    # wgrad blocks of 32 rows start at each group's first row: every group quantised on its own,
    # zero-padded to 128 rows (zeros change no block's scale)
    groups = lambda a: np.stack([np.pad(part, ((0, 128 - len(part)), (0, 0))) for part in np.split(a, ends)[:-1]])
    ends = np.cumsum(SIZES)
    xg, dyg = mx(groups(np.asarray(x)), 1), mx(groups(np.asarray(dy)), 1)
    y, dx, dw = (np.asarray(a) for a in (y, dx, dw))
    start = 0
    for g, s in enumerate(SIZES):
        rows = slice(start, start + s)
        np.testing.assert_allclose(y[rows], xq[rows] @ wq[g], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx[rows], dyq[rows] @ wb[g].T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw[g], xg[g].T @ dyg[g], rtol=1e-5, atol=1e-5)
        start += s


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4_fwd_mxfp8_bwd"])
def test_tiled_and_ragged_layouts_give_the_same_values_and_gradients(name):
    """One 128-row tile per group, zero-padded: MX blocks in a tile equal blocks restarting at
    group boundaries in the ragged layout, so the two agree to float32 summation order."""
    x, w, sizes, dy = _data(2)
    r = R.recipe(name)
    m = 128
    xt = jnp.zeros((len(SIZES), m, K))
    dyt = jnp.zeros((len(SIZES), m, N))
    start = 0
    for g, s in enumerate(SIZES):
        xt = xt.at[g, :s].set(x[start : start + s])
        dyt = dyt.at[g, :s].set(dy[start : start + s])
        start += s
    yr, dxr, dwr = jax.jit(lambda x, w: _value_and_grads(lambda a, b: G.ragged_matmul(a, b, sizes, r), x, w, dy))(x, w)
    yt, dxt, dwt = jax.jit(lambda x, w: _value_and_grads(lambda a, b: G.tile_matmul(a, b, r), x, w, dyt))(xt, w)
    np.testing.assert_allclose(dwt, dwr, rtol=1e-5, atol=1e-5)
    start = 0
    for g, s in enumerate(SIZES):
        np.testing.assert_allclose(yt[g, :s], yr[start : start + s], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dxt[g, :s], dxr[start : start + s], rtol=1e-5, atol=1e-6)
        start += s


def test_per_token_nvfp4_output_ignores_the_other_tokens_and_per_tensor_does_not():
    x, w, sizes, _ = _data(3)
    other = x.at[1:].multiply(40.0)  # every other token changes, by a lot
    for layout in ("ragged", "tiled"):
        for second, independent in (("token", True), ("tensor", False)):
            r = R.recipe("nvfp4_fwd_mxfp8_bwd", nvfp4_second=second)
            if layout == "ragged":
                f = jax.jit(lambda a, r=r: G.ragged_matmul(a, w, sizes, r)[0])
            else:
                f = jax.jit(lambda a, r=r: G.tile_matmul(a.reshape(8, 32, K), w, r)[0, 0])
            same = bool(jnp.all(f(x) == f(other)))
            assert same == independent, (layout, second)


def test_recipe_names():
    assert R.recipe("nvfp4_fwd_mxfp8_bwd") == R.Recipe("nvfp4", "mxfp8", "token", "ceil")
    with pytest.raises(ValueError, match="accepted: bf16, mxfp8, nvfp4_fwd_mxfp8_bwd"):
        R.recipe("fp8")
    assert R.recipe("mxfp8", backend="pallas").backend == "pallas"  # tests/quant/test_pallas_backend.py
