"""Block-scaled formats against independent values: hand-worked examples of the OCP MX v1.0
conversion and NVIDIA's NVFP4 description, and an exhaustive nearest-value check of every E4M3,
E5M2 and E2M1 code with ml_dtypes as the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from composer_jax.quant import formats as F

ORACLE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}
MX_OF = {"e4m3": "mxfp8_e4m3", "e5m2": "mxfp8_e5m2", "e2m1": "mxfp4"}


def _mx(values, fmt="mxfp8_e4m3", rule="ocp"):
    """One 32-element block: the given values, then zeros -> (dequantised values, E8M0 code)."""
    x = np.zeros(32, np.float32)
    x[: len(values)] = values
    q = F.mx_quantize(jnp.asarray(x), fmt, rule=rule)
    return np.asarray(q.dequantize())[: len(values)], int(q.scales[0])


# --------------------------------------------------------------------------------------------------
# OCP MX v1.0, hand-worked
# --------------------------------------------------------------------------------------------------


def test_mxfp8_e4m3_ocp_rule_by_hand():
    # amax = 300: floor(log2 300) = 8, emax(E4M3) = 8 -> shared exp 0, X = 1, E8M0 code 127.
    # 300 lies in [256, 512) where E4M3 steps by 2^(8-3) = 32: 300/32 = 9.375 -> 9 -> 288.
    # 1.1 lies in [1, 2), step 1/8: 8.8 -> 9 -> 1.125.  -0.3 in [0.25, 0.5), step 1/32: 9.6 -> 10 -> -0.3125.
    v, code = _mx([300.0, 1.1, -0.3])
    assert code == 127
    np.testing.assert_array_equal(v, [288.0, 1.125, -0.3125])


def test_mxfp8_e4m3_saturates_under_ocp_rule_and_not_under_ceil_rule():
    # amax = 500: OCP: s = floor(log2 500) - 8 = 0, X = 1, and 500 > 448 saturates to 448.
    # ceil rule: s = ceil(log2(500/448)) = 1, X = 2, 500/2 = 250 in [128, 256) step 16:
    # 15.625 -> 16 -> 256, times X = 512 (rounded up, not saturated).
    v, code = _mx([500.0, 10.0])
    assert code == 127
    np.testing.assert_array_equal(v, [448.0, 10.0])
    v, code = _mx([500.0, 10.0], rule="ceil")
    assert code == 128
    np.testing.assert_array_equal(v, [512.0, 10.0])
    # the ceil rule keeps X = 1 when amax equals the element max exactly
    assert _mx([448.0], rule="ceil")[1] == 127
    assert _mx([448.5], rule="ceil")[1] == 128


def test_mxfp8_e5m2_by_hand():
    # amax = 1: s = 0 - 15 = -15, X = 2^-15, code 112. 0.3 * 2^15 = 9830.4 in [8192, 16384), step
    # 2^(13-2) = 2048: 4.8 -> 5 -> 10240, times X = 0.3125.
    v, code = _mx([1.0, 0.3], "mxfp8_e5m2")
    assert code == 127 - 15
    np.testing.assert_array_equal(v, [1.0, 0.3125])


def test_mxfp4_ties_to_even_and_saturation_by_hand():
    # amax = 5: s = floor(log2 5) - 2 = 0. E2M1 values 0 .5 1 1.5 2 3 4 6:
    # 0.25 -> tie 0 / 0.5 -> 0 (even); 0.75 -> tie 0.5 / 1 -> 1; 2.5 -> tie 2 / 3 -> 2; 5 -> tie 4 / 6 -> 4.
    v, code = _mx([0.25, 0.75, 2.5, 5.0, -1.25], "mxfp4")
    assert code == 127
    np.testing.assert_array_equal(v, [0.0, 1.0, 2.0, 4.0, -1.0])
    # amax = 7: s = 0 and 7 saturates to 6; the ceil rule takes X = 2 and gives 8 (7/2 = 3.5 -> 4).
    assert _mx([7.0], "mxfp4")[0][0] == 6.0
    assert _mx([7.0], "mxfp4", "ceil")[0][0] == 8.0


def test_mx_zeros_subnormals_nan_inf_and_e8m0_clamp():
    # an all-zero block: the smallest scale 2^-127 (code 0) and zero elements
    v, code = _mx([0.0, -0.0])
    assert code == 0 and np.all(v == 0)
    # E4M3 subnormals (step 2^-9) under X = 1 (amax 256): 1.4 * 2^-9 -> 2^-9; 2^-10 is a tie between
    # 0 and 2^-9 -> 0 (even); 3 * 2^-10 is a tie between 2^-9 (mantissa 001) and 2^-8 (010) -> 2^-8.
    v, _ = _mx([256.0, 1.4 * 2**-9, 2**-10, 3 * 2**-10])
    np.testing.assert_array_equal(v, [256.0, 2**-9, 0.0, 2**-8])
    # NaN or Inf anywhere in a block: scale NaN (code 255) and every element decodes NaN (spec 5.2)
    for bad in (np.nan, np.inf, -np.inf):
        v, code = _mx([1.0, bad])
        assert code == 255 and np.all(np.isnan(v))
    # tiny amax: the exponent clamps at -127 and elements underflow; huge: clamps at 127
    assert _mx([2.0**-140])[1] == 0
    x = np.float32(2.0**126 * 1.5)
    v, code = _mx([x], rule="ceil")
    assert code == 127 + 118 and v[0] == x  # 1.5 * 2^126 / 2^118 = 384 is an E4M3 value


def test_mx_blocks_run_along_the_chosen_axis_and_pad_with_zeros():
    x = np.ones((40, 3), np.float32)
    x[33, 1] = 1000.0  # second block of 32 rows in column 1
    q = F.mx_quantize(jnp.asarray(x), "mxfp8_e4m3", axis=0)
    assert q.scales.shape == (3, 2)  # the axis moved last, 40 padded to 2 blocks
    # amax 1000 -> s = 9 - 8 = 1 (code 128); amax 1 -> s = 0 - 8 = -8 (code 119)
    assert int(q.scales[1, 1]) == 128 and int(q.scales[1, 0]) == 119
    np.testing.assert_array_equal(np.asarray(q.dequantize())[:, 0], 1.0)
    assert q.dequantize().shape == (40, 3)


# --------------------------------------------------------------------------------------------------
# NVFP4, hand-worked
# --------------------------------------------------------------------------------------------------


def test_nvfp4_two_level_scale_by_hand():
    # Tensor amax 2688 = 448 * 6 -> s_second = 1. Block 0 (amax 2688): s_block = 2688 / 6 = 448.
    # Block 1 (amax 3.3): s_block = 3.3 / 6 = 0.55 -> E4M3 in [0.5, 1) step 1/16: 8.8 -> 9 -> 0.5625;
    # 3.3 / 0.5625 = 5.87 -> 6 -> 3.375; 1.0 / 0.5625 = 1.78 -> 2 -> 1.125; 0.2 / 0.5625 = 0.36 -> 0.5 -> 0.28125.
    x = np.zeros(32, np.float32)
    x[0], x[16:19] = 2688.0, [3.3, 1.0, 0.2]
    q = F.nvfp4_quantize(jnp.asarray(x), second="tensor")
    assert float(q.second.reshape(())) == 1.0
    np.testing.assert_array_equal(np.asarray(q.scales.astype(jnp.float32)), [448.0, 0.5625])
    v = np.asarray(q.dequantize())
    np.testing.assert_array_equal(v[[0, 16, 17, 18]], [2688.0, 3.375, 1.125, 0.28125])
    # Per token: row amax 3.3 -> s_second = 3.3 / 2688; s_block = 3.3 / (6 s_second) = 448 exactly up
    # to float32 rounding of the division, and the row's max element decodes to 6 * 448 * s_second.
    xt = np.stack([x[16:32], 1000 * np.ones(16, np.float32)])
    q = F.nvfp4_quantize(jnp.asarray(xt), second="token")
    assert q.second.shape == (2, 1)
    np.testing.assert_allclose(np.asarray(q.second)[:, 0], [np.float32(3.3) / np.float32(2688), 1000 / 2688], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(q.dequantize())[0, 0], 3.3, rtol=1e-6)


def test_nvfp4_zeros_underflow_and_nan():
    q = F.nvfp4_quantize(jnp.zeros((2, 16)), second="token")
    assert np.all(np.asarray(q.dequantize()) == 0)
    # a block whose scale amax / (6 s_second) rounds to E4M3 zero (below 2^-10) gets the smallest
    # subnormal 2^-9 instead and keeps its value (tests/quant/test_nvfp4_scales.py has the boundaries)
    x = np.zeros(32, np.float32)
    x[0], x[16] = 2688.0, 2.0**-9
    assert np.asarray(F.nvfp4_quantize(jnp.asarray(x)).dequantize())[16] == 2.0**-9
    x[5] = np.nan
    assert np.all(np.isnan(np.asarray(F.nvfp4_quantize(jnp.asarray(x)).dequantize())))
    xt = np.ones((2, 16), np.float32)
    xt[1, 3] = np.inf
    v = np.asarray(F.nvfp4_quantize(jnp.asarray(xt), second="token").dequantize())
    assert np.all(v[0] == 1.0) and np.all(np.isnan(v[1]))


def test_nvfp4_2d_blocks_quantise_a_matrix_and_its_transpose_alike():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(48, 40)).astype(np.float32))
    a = F.nvfp4_quantize(w, axis=1, block_2d=True)
    b = F.nvfp4_quantize(w.T, axis=1, block_2d=True)
    assert a.scales.shape == (3, 3)
    np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b.dequantize()).T)
    err = float(jnp.linalg.norm(a.dequantize() - w) / jnp.linalg.norm(w))
    assert err < 0.15


def test_per_token_second_scale_makes_each_row_independent_of_the_others():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    y = x.copy()
    y[1:] *= 50.0  # other tokens change (one gets a large outlier row)
    tok = lambda a: np.asarray(F.nvfp4_quantize(jnp.asarray(a), second="token").dequantize())[0]
    ten = lambda a: np.asarray(F.nvfp4_quantize(jnp.asarray(a), second="tensor").dequantize())[0]
    np.testing.assert_array_equal(tok(x), tok(y))
    assert np.any(ten(x) != ten(y))


# --------------------------------------------------------------------------------------------------
# Exhaustive: every code of every element format, ml_dtypes as the oracle
# --------------------------------------------------------------------------------------------------


def _codes(name):
    bits = np.arange(16 if name == "e2m1" else 256, dtype=np.uint8)
    vals = bits.view(ORACLE[name]).astype(np.float32)
    keep = np.isfinite(vals)
    return bits[keep], vals[keep]


def _nearest_even(points, bits, vals):
    """Nearest representable value; a tie goes to the code with an even last bit."""
    d = np.abs(points[:, None] - vals[None, :])
    best = d.min(1, keepdims=True)
    cand = d == best
    even = (bits % 2 == 0)[None, :]
    pick = np.where(cand.sum(1) > 1, np.argmax(cand & even, axis=1), np.argmax(cand, axis=1))
    return vals[pick]


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_every_code_dequantises_to_the_nearest_representable_value(name):
    bits, vals = _codes(name)
    pos = np.unique(vals[vals >= 0])
    mids = (pos[1:] + pos[:-1]) / 2  # exact in float32 (few mantissa bits)
    pts = np.concatenate([pos, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)]).astype(np.float32)
    pts = np.concatenate([pts, -pts])
    fmt = F.ELEMENTS[name]
    expected = _nearest_even(pts, bits, vals)
    # the oracle's own round-to-nearest-even cast agrees with the brute-force nearest value
    np.testing.assert_array_equal(pts.astype(ORACLE[name]).astype(np.float32), expected)
    got = np.asarray(F.round_to_format(jnp.asarray(pts), fmt))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got[expected == 0]), np.signbit(pts[expected == 0]))
    # the same through a whole MX block (scale forced to 1 by a max-magnitude anchor, the ceil
    # rule) and, for E2M1, FP4 packing
    blocks = np.concatenate([pts, np.zeros(-len(pts) % 31, np.float32)]).reshape(-1, 31)
    anchored = np.concatenate([np.full((len(blocks), 1), fmt.max, np.float32), blocks], axis=1)
    q = F.mx_quantize(jnp.asarray(anchored), MX_OF[name], rule="ceil")
    assert np.all(np.asarray(q.scales) == 127)
    deq = np.asarray(q.dequantize())[:, 1:].reshape(-1)[: len(pts)]
    np.testing.assert_array_equal(deq, expected)
    # beyond the max: saturation
    assert float(F.round_to_format(jnp.float32(fmt.max * 1.2), fmt)) == fmt.max
    assert float(F.round_to_format(jnp.float32(-np.inf), fmt)) == -fmt.max


def test_codes_round_trip_through_the_jnp_dtype_and_fp4_packing():
    for name in ("e4m3", "e5m2"):
        bits, vals = _codes(name)
        got = np.asarray(jnp.asarray(vals).astype(F.ELEMENTS[name].dtype)).view(np.uint8)
        np.testing.assert_array_equal(got, bits)
    bits, vals = _codes("e2m1")
    np.testing.assert_array_equal(np.asarray(F.e2m1_to_codes(jnp.asarray(vals))), bits)
    np.testing.assert_array_equal(np.asarray(F.codes_to_e2m1(jnp.asarray(bits))), vals)
    # two codes per byte, element 2i in the low nibble: [1, 2] -> 0x21
    assert int(F.pack_fp4(jnp.asarray([1, 2], jnp.uint8))[0]) == 0x21
    every = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(F.pack_fp4(F.unpack_fp4(every))), np.arange(256))


def test_stochastic_rounding_is_unbiased_between_the_two_neighbours():
    x = jnp.full((20000,), 1.3, jnp.float32)  # E4M3 neighbours 1.25 and 1.375, p(up) = 0.4
    q = np.asarray(F.round_to_format(x, F.E4M3, key=jax.random.key(0)))
    assert set(np.unique(q)) == {1.25, 1.375}
    assert abs(q.mean() - 1.3) < 3e-3
    q = F.mx_quantize(jnp.full((4, 32), 0.3), "mxfp4", key=jax.random.key(1))
    assert abs(float(q.dequantize().mean()) - 0.3) < 0.02


def test_quant_array_is_a_pytree_that_crosses_jit():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 48)).astype(np.float32))
    for q in (F.mx_quantize(x, "mxfp4"), F.nvfp4_quantize(x, second="token"), F.mx_quantize(x, axis=0)):
        leaves = jax.tree_util.tree_leaves(q)
        assert len(leaves) == (3 if q.second is not None else 2)
        np.testing.assert_array_equal(np.asarray(jax.jit(F.dequantize)(q)), np.asarray(F.dequantize(q)))
        assert q.dequantize().shape == x.shape
    assert F.mx_quantize(x, "mxfp4").data.dtype == jnp.uint8 and F.mx_quantize(x, "mxfp4").data.shape == (8, 32)
