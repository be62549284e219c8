"""The quantisation Pallas kernels (MXFP8 row- and column-wise; NVFP4 with a per-token second
scale): in interpret mode on CPU each equals its jnp twin and the library's reference format bit
for bit (both MX scale rules, zeros, NaN, Inf, subnormal-range elements), and each lowers for
CUDA as a Triton custom call found in the `jax.export`ed module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from composer_jax.quant import formats as F
from pallas_kernels import mx_quant as K
from pallas_kernels import nvfp4_quant as NV


def _x(m=64, k=96, seed=0):
    rng = np.random.default_rng(seed)
    # magnitudes over 2^-30 .. 2^30 so that blocks hold E4M3 subnormals and saturating maxima
    x = (rng.normal(size=(m, k)) * np.exp2(rng.integers(-30, 30, size=(m, k)))).astype(np.float32)
    x[3, :] = 0.0  # all-zero blocks
    x[:, 5] = 0.0
    x[5, 40] = np.nan  # NaN and Inf blocks
    x[33, 70] = -np.inf
    x[10, :32] = 448.0 * 1.5  # amax exactly on a rule boundary
    return jnp.asarray(x)


def _same(v, s, v_ref, s_ref, axis):
    """Scales equal; elements equal bit for bit outside NaN-scale blocks (whose elements decode
    to NaN whatever they hold; the kernel writes NaN there)."""
    v, v_ref, s, s_ref = (np.asarray(a) for a in (v, v_ref, s, s_ref))
    np.testing.assert_array_equal(s, s_ref)
    nan_block = np.repeat(s == 255, 32, axis=axis)
    assert np.all(np.isnan(v.astype(np.float32))[nan_block])
    np.testing.assert_array_equal(v.view(np.uint8)[~nan_block], v_ref.view(np.uint8)[~nan_block])


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_kernel_in_interpret_mode_equals_its_twin_and_the_format_reference(axis, rule):
    x = _x()
    v, s = K.mxfp8_quantize(x, axis, rule, tile=32, interpret=True)
    v_ref, s_ref = K.mxfp8_quantize_ref(x, axis, rule)
    _same(v, s, v_ref, s_ref, axis)
    assert int(np.asarray(s_ref).max()) == 255 and int(np.asarray(s_ref).min()) == 0
    q = F.mx_quantize(x, "mxfp8_e4m3", axis=axis, rule=rule)  # the library's layout: blocked axis last
    data, scales = (q.data, q.scales) if axis == 1 else (q.data.T, q.scales.T)
    _same(v, s, data, scales, axis)


def test_kernel_takes_bfloat16():
    x = _x(seed=1).astype(jnp.bfloat16)
    v, s = K.mxfp8_quantize(x, 1, "ceil", tile=32, interpret=True)
    _same(v, s, *K.mxfp8_quantize_ref(x, 1, "ceil"), 1)


def test_nvfp4_per_token_kernel_equals_its_twin_and_the_format_reference():
    x = _x(seed=2)
    x = x.at[8, 3].set(-0.0).at[9, 16:32].set(0.0)
    u8 = lambda a: np.asarray(a).view(np.uint8)
    packed, sb, s2 = NV.nvfp4_quantize(x, tile=32, interpret=True)
    ref = NV.nvfp4_quantize_ref(x)
    q = F.nvfp4_quantize(x, axis=1, second="token")
    for got, want in ((packed, ref[0]), (sb, ref[1]), (packed, q.data), (sb, q.scales)):
        np.testing.assert_array_equal(u8(got), u8(want))
    for want in (ref[2], q.second):
        np.testing.assert_array_equal(np.asarray(s2), np.asarray(want))  # NaN rows included
    assert np.isnan(np.asarray(s2)[[5, 33], 0]).all()
    # a row's codes depend on that row alone
    other = x.at[:5].multiply(1000.0)
    np.testing.assert_array_equal(u8(NV.nvfp4_quantize(other, tile=32, interpret=True)[0])[10:], u8(packed)[10:])


KERNELS = {
    "mxfp8_rows": lambda a: K.mxfp8_quantize(a, 1, "ceil"),
    "mxfp8_cols": lambda a: K.mxfp8_quantize(a, 0, "ocp"),
    "nvfp4_token": lambda a: NV.nvfp4_quantize(a),
}
OUT_DTYPES = {
    "mxfp8_rows": [jnp.float8_e4m3fn, jnp.uint8],
    "mxfp8_cols": [jnp.float8_e4m3fn, jnp.uint8],
    "nvfp4_token": [jnp.uint8, jnp.float8_e4m3fn, jnp.float32],
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_lowers_for_cuda_as_a_triton_custom_call(name):
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    f = jax.jit(KERNELS[name])
    exp = export.export(
        f,
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(x)
    text = exp.mlir_module()
    assert "__gpu$xla.gpu.triton" in text
    assert exp.platforms == ("cuda",)
    assert [o.dtype for o in exp.out_avals] == OUT_DTYPES[name]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        K.mxfp8_quantize(jnp.zeros((64, 40)), 1, interpret=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        NV.nvfp4_quantize(jnp.zeros((64, 40)), interpret=True)
