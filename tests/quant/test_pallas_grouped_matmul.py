"""The grouped-matmul Pallas kernels (MXFP8 and NVFP4 operands): on ragged group sizes (empty
groups, one group, rows left over) each matches its jnp twin within float32 accumulation tolerance
in interpret mode, the twin equals the library's quantised forward (`quant.grouped_matmul`,
recipes mxfp8 and nvfp4_fwd_mxfp8_bwd), and each kernel lowers for CUDA as a Triton custom call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from composer_jax.quant import formats as F
from composer_jax.quant import grouped_matmul as G
from composer_jax.quant import recipe as R
from pallas_kernels import grouped_matmul as GM
from pallas_kernels import mx_quant as MQ
from pallas_kernels import nvfp4_quant as NV

ROWS, K, N, GROUPS = 128, 64, 64, 6


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(ROWS, K)).astype(np.float32))
    w = jnp.asarray((rng.normal(size=(GROUPS, K, N)) * np.exp2(rng.integers(-3, 3, (GROUPS, 1, N)))).astype(np.float32))
    xv, xs = MQ.mxfp8_quantize_ref(x, 1)
    # w blocked along K (its contraction axis): column-wise over the [K, G*N] matrix
    wv, ws = MQ.mxfp8_quantize_ref(w.transpose(1, 0, 2).reshape(K, GROUPS * N), 0)
    wv = wv.reshape(K, GROUPS, N).transpose(1, 0, 2)
    ws = ws.reshape(K // 32, GROUPS, N).transpose(1, 0, 2)
    return x, w, (xv, xs, wv, ws)


SIZES = {
    "ragged_with_empty": [0, 37, 0, 5, 64, 0],  # 106 rows, 22 past the groups
    "one_group": [0, 0, 128, 0, 0, 0],
    "all_empty": [0] * 6,
    "tile_multiples": [32, 32, 0, 32, 0, 32],
}


@pytest.mark.parametrize("case", list(SIZES))
def test_interpret_matches_the_twin_and_the_library(case):
    x, w, ops = _operands()
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    ref = np.asarray(GM.grouped_matmul_mxfp8_ref(*ops, sizes))
    got = np.asarray(GM.grouped_matmul_mxfp8(*ops, sizes, interpret=True))
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)
    valid = np.arange(ROWS) < sum(SIZES[case])
    assert np.all(got[~valid] == 0)
    lib = np.asarray(G.ragged_matmul(x, w, sizes, R.recipe("mxfp8")))
    np.testing.assert_allclose(ref, lib, rtol=1e-5, atol=1e-5 * scale)


def _nvfp4_operands(x, w):
    xp, xsb, xs2 = NV.nvfp4_quantize_ref(x)  # per token
    q = F.nvfp4_quantize(w, axis=1, second=(1, 2))  # packed along K, one second scale per expert
    return xp, xsb, xs2, q.data.transpose(0, 2, 1), q.scales.transpose(0, 2, 1), q.second.reshape(GROUPS)


@pytest.mark.parametrize("case", ["ragged_with_empty", "all_empty"])
def test_nvfp4_interpret_matches_the_twin_and_the_library(case):
    x, w, _ = _operands(1)
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    ops = _nvfp4_operands(x, w)
    ref = np.asarray(GM.grouped_matmul_nvfp4_ref(*ops, sizes))
    got = np.asarray(GM.grouped_matmul_nvfp4(*ops, sizes, interpret=True))
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)
    assert np.all(got[np.arange(ROWS) >= sum(SIZES[case])] == 0)
    lib = np.asarray(G.ragged_matmul(x, w, sizes, R.recipe("nvfp4_fwd_mxfp8_bwd")))
    np.testing.assert_allclose(ref, lib, rtol=1e-5, atol=1e-5 * scale)


def test_tile_schedule_never_spans_groups():
    group, first, end = (np.asarray(a) for a in GM.tile_schedule(jnp.asarray([0, 37, 0, 5, 64, 0]), ROWS, 32))
    used = first < ROWS
    np.testing.assert_array_equal(group[used], [1, 1, 3, 4, 4])
    np.testing.assert_array_equal(first[used], [0, 32, 37, 42, 74])
    np.testing.assert_array_equal(end[used], [37, 37, 42, 106, 106])
    assert len(group) == ROWS // 32 + 6


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_grouped_matmul_lowers_for_cuda_as_a_triton_custom_call(fmt):
    x, w, ops = _operands()
    if fmt == "nvfp4":
        ops = _nvfp4_operands(x, w)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ops] + [jax.ShapeDtypeStruct((GROUPS,), jnp.int32)]
    exp = export.export(
        jax.jit(GM.grouped_matmul_mxfp8 if fmt == "mxfp8" else GM.grouped_matmul_nvfp4),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
    assert exp.out_avals[0].shape == (ROWS, N)
