"""NVFP4's two scales at their boundaries: the second-level scale amax / (448 * 6) correctly rounded
(exhaustively over a binade of significands, hand-worked cases, torch as the oracle torchao uses),
and the block scale clamped at E4M3's smallest subnormal where it would round to zero.

The float64 reference: np.float32(np.float64(amax) / 2688) rounds the exact quotient twice, to 53
bits and then to 24. For a quotient of two floats that is the same as rounding once whenever the
intermediate precision is at least 2p + 2 bits for a p-bit target (Figueroa, "When is double
rounding innocuous?", SIGNUM 1995): 53 >= 2 * 24 + 2, so the reference is correctly rounded."""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.quant import formats as F
from pallas_kernels import nvfp4_quant as NV

DIVISOR = 448.0 * 6.0
SCALES = {"formats": F.nvfp4_second_scale, "kernel": NV.second_scale_of_amax}


def _reference(amax: np.ndarray) -> np.ndarray:
    return (amax.astype(np.float64) / DIVISOR).astype(np.float32)


def _binade(exponent: int) -> np.ndarray:
    """Every float32 in [2^exponent, 2^(exponent + 1)): all 2^23 significands."""
    m = np.arange(2**23, dtype=np.uint32) | np.uint32((exponent + 127) << 23)
    return m.view(np.float32)


@pytest.mark.parametrize("name", sorted(SCALES))
def test_second_scale_is_correctly_rounded_for_every_significand(name):
    # 2688 = 21 * 2^7, so which way amax / 2688 rounds depends on amax's significand alone (its
    # exponent only shifts the quotient): one binade is every case whose quotient is a normal float.
    a = _binade(0)
    got = np.asarray(jax.jit(SCALES[name])(a))
    np.testing.assert_array_equal(got, _reference(a))
    for e in (-100, 60, 127):  # other binades: a stride of the significands, the exponent path
        b = _binade(e)[::997]
        np.testing.assert_array_equal(np.asarray(SCALES[name](b)), _reference(b))
    # the bug this guards against: XLA's x / 2688 is x * (1 / 2688), 1 ulp off for ~22% of these
    naive = np.asarray(jax.jit(lambda x: x / DIVISOR)(a))
    assert 0.15 < np.mean(naive != _reference(a)) < 0.3


def test_second_scale_by_hand():
    # amax = 1 + 2^-23: the quotient lies in [2^-12, 2^-11), float32 steps of 2^-35 there, and
    # 2^35 (2^23 + 1) / (2^23 2688) = 4096 * 8388609 / 2688 = 12782642 + 768 / 2688 = 12782642.2857...
    # -> 12782642 * 2^-35. The product with the rounded reciprocal gives 12782643 * 2^-35.
    amax = np.float32(1 + 2.0**-23)
    assert Fraction(float(amax)) * 2**35 / 2688 == 12782642 + Fraction(768, 2688)
    s = F.nvfp4_second_scale(jnp.asarray(amax))
    assert float(s) == 12782642 * 2.0**-35
    assert float(jax.jit(lambda x: x / DIVISOR)(amax)) == 12782643 * 2.0**-35
    # exact quotients stay exact
    for k in (-20, 0, 1, 30):
        assert float(F.nvfp4_second_scale(jnp.float32(DIVISOR * 2.0**k))) == 2.0**k
    # the largest float32, (2 - 2^-23) 2^127: 2^127 (2^24 - 1) / (2^23 * 2688) -> nearest float32
    big = np.float32(np.finfo(np.float32).max)
    assert float(F.nvfp4_second_scale(jnp.asarray(big))) == float(_reference(np.array([big]))[0])


@pytest.mark.parametrize("name", sorted(SCALES))
def test_second_scale_clamps_below_the_smallest_normal_and_marks_specials(name):
    f = lambda v: float(SCALES[name](jnp.float32(v)))
    tiny = 2.0**-126
    assert f(DIVISOR * tiny) == tiny  # exactly the smallest normal quotient
    # a quotient below 2^-126 would be subnormal, which XLA:CPU flushes to 0 (zeroing the row):
    # clamped to 2^-126 instead
    assert f(np.nextafter(np.float32(DIVISOR * tiny), np.float32(0))) == tiny
    assert f(1e-36) == tiny and f(tiny) == tiny
    assert f(0.0) == 1.0
    assert np.isnan(f(np.inf)) and np.isnan(f(np.nan))


def test_second_scale_equals_torch_evaluating_torchaos_formula():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    a = (rng.random(20000) * 10.0 ** rng.integers(-30, 38, 20000)).astype(np.float32)
    # torchao 0.18's per_tensor_amax_to_scale: amax.to(torch.float32) / (F8E4M3_MAX * F4_E2M1_MAX)
    want = (torch.from_numpy(a).to(torch.float32) / (448.0 * 6.0)).numpy()
    np.testing.assert_array_equal(np.asarray(F.nvfp4_second_scale(jnp.asarray(a))), want)


# --------------------------------------------------------------------------------------------------
# Block scales that would round to E4M3 zero
# --------------------------------------------------------------------------------------------------


def _tensor_with_block(values) -> np.ndarray:
    """Block 0 holds 2688 (so s_second = 1 exactly), block 1 the given values."""
    x = np.zeros(32, np.float32)
    x[0] = DIVISOR
    x[16 : 16 + len(values)] = values
    return x


def test_block_scale_that_rounds_to_zero_is_clamped_to_the_smallest_subnormal():
    u = 2.0**-9  # E4M3's smallest subnormal
    # amax 2^-9: 2^-9 / 6 < 2^-10 rounds to E4M3 0, clamped to 2^-9. Elements / 2^-9:
    # 1 -> 1; 2^-2 -> tie of 0 and 0.5 -> 0 (even); 0.3125 -> 0.5; 0.75 -> tie of 0.5 and 1 -> 1
    # (even: 1.0's mantissa bit is 0); -1 -> -1.
    x = _tensor_with_block([u, u / 4, 1.25 * u / 4, 0.75 * u, -u])
    q = F.nvfp4_quantize(jnp.asarray(x))
    assert float(q.second.reshape(())) == 1.0
    assert float(q.scales.astype(jnp.float32)[1]) == u
    np.testing.assert_array_equal(np.asarray(q.dequantize())[16:21], [u, 0.0, u / 2, u, -u])
    # the tie: amax 3 * 2^-9 gives exactly 2^-10, half the smallest subnormal, which rounds to even 0;
    # clamped, the block's 3 * 2^-9 is E2M1 3 and kept exactly
    q = F.nvfp4_quantize(jnp.asarray(_tensor_with_block([3 * u, u])))
    assert float(q.scales.astype(jnp.float32)[1]) == u
    np.testing.assert_array_equal(np.asarray(q.dequantize())[16:18], [3 * u, u])
    # just above the tie the scale already rounds to 2^-9 (no clamp needed): same scale
    above = float(np.nextafter(np.float32(3 * u), np.float32(1)))
    q = F.nvfp4_quantize(jnp.asarray(_tensor_with_block([above])))
    assert float(q.scales.astype(jnp.float32)[1]) == u
    # an all-zero block keeps a zero scale
    q = F.nvfp4_quantize(jnp.asarray(_tensor_with_block([])))
    assert float(q.scales.astype(jnp.float32)[1]) == 0.0


def test_row_whose_second_scale_would_be_subnormal_is_kept():
    # row amax 1e-35 < 2688 * 2^-126: s_second = 2^-126; s_block = 1e-35 / (6 * 2^-126) = 141.8 ->
    # E4M3 144 (steps of 16 in [128, 256)); 1e-35 / (144 * 2^-126) = 5.908 -> 6 -> 864 * 2^-126
    x = np.zeros((2, 16), np.float32)
    x[0, 0], x[1, 0] = 1e-35, 1.0
    q = F.nvfp4_quantize(jnp.asarray(x), second="token")
    assert float(q.second[0, 0]) == 2.0**-126
    assert float(q.scales.astype(jnp.float32)[0, 0]) == 144.0
    assert float(q.dequantize()[0, 0]) == np.float32(864 * 2.0**-126)


def test_kernel_and_twin_clamp_as_the_reference():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 32)).astype(np.float32)
    u = 2.0**-9
    x[1:5] = 0.0
    x[1, 16:21] = np.array([u, u / 4, 1.25 * u / 4, 0.75 * u, -u]) * 1e-3  # tiny blocks of big rows
    x[1, 0] = 2688e-3
    x[2, 16:18] = np.array([3 * u, u]) * 7.0
    x[2, 0] = 2688 * 7.0
    x[3, 3] = 1e-35
    x[4, :16] = rng.normal(size=16)  # row 4: its second block all zero
    xj = jnp.asarray(x)
    ref = F.nvfp4_quantize(xj, axis=1, second="token")
    for packed, sb, s2 in (NV.nvfp4_quantize_ref(xj), NV.nvfp4_quantize(xj, tile=32, interpret=True)):
        np.testing.assert_array_equal(np.asarray(packed), np.asarray(ref.data))
        np.testing.assert_array_equal(np.asarray(sb.astype(jnp.float32)), np.asarray(ref.scales.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(s2), np.asarray(ref.second))
    assert float(ref.scales.astype(jnp.float32)[1, 1]) == u and float(ref.scales.astype(jnp.float32)[2, 1]) == u
    assert np.asarray(ref.dequantize())[1, 16] != 0.0 and np.asarray(ref.dequantize())[3, 3] != 0.0
