"""The MXFP8 quantisation Pallas kernel: in interpret mode on CPU it equals its jnp twin and the
library's reference format bit for bit (row- and column-wise, both scale rules, zeros, NaN, Inf,
subnormal-range elements), and it lowers for CUDA as a Triton custom call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from composer_jax.quant import formats as F
from pallas_kernels import mx_quant as K


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


@pytest.mark.parametrize("axis", [1, 0])
def test_kernel_lowers_for_cuda_as_a_triton_custom_call(axis):
    x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    f = jax.jit(lambda a: K.mxfp8_quantize(a, axis, "ceil"))
    exp = export.export(
        f,
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(x)
    text = exp.mlir_module()
    assert "__gpu$xla.gpu.triton" in text
    assert exp.platforms == ("cuda",)
    assert [o.dtype for o in exp.out_avals] == [jnp.float8_e4m3fn, jnp.uint8]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        K.mxfp8_quantize(jnp.zeros((64, 40)), 1, interpret=True)
