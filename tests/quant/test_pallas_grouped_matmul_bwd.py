"""The backward grouped-matmul Pallas kernels with MXFP8 operands: dgrad (dy @ w^T per group) and
wgrad (x^T @ dy per group, a ragged contraction over the group-padded layout). On ragged group sizes
(empty groups, one group, rows left over) each matches its jnp twin within float32 accumulation
tolerance in interpret mode, the twin matches a numpy loop over the groups, and each kernel lowers
for CUDA as a Triton custom call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import grouped_matmul_bwd as B
from pallas_kernels import mx_quant as MQ

ROWS, K, N = 128, 64, 96
SIZES = {
    "ragged_with_empty": [0, 37, 0, 5, 64, 0],  # 106 rows in groups, 22 past them
    "one_group": [0, 0, 128, 0, 0, 0],
    "all_empty": [0] * 6,
}
G = 6


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, K)) * np.exp2(rng.integers(-5, 5, (ROWS, 1)))
    dy = rng.normal(size=(ROWS, N)) * np.exp2(rng.integers(-5, 5, (1, N)))
    w = rng.normal(size=(G, K, N)) * np.exp2(rng.integers(-3, 3, (G, K, 1)))
    return (jnp.asarray(a.astype(np.float32)) for a in (x, dy, w))


def _decode(v, s, axis):
    """numpy: E4M3 elements times 2^(code - 127) repeated over each 32-block along `axis`."""
    return np.asarray(v).astype(np.float64) * np.repeat(np.exp2(np.asarray(s).astype(np.float64) - 127), 32, axis)


def _dgrad_operands(dy, w):
    dyv, dys = MQ.mxfp8_quantize_ref(dy, 1)  # blocks along N
    wv, ws = MQ.mxfp8_quantize_ref(w.reshape(G * K, N), 1)  # w blocked along N, its dgrad contraction
    return dyv, dys, wv.reshape(G, K, N), ws.reshape(G, K, N // 32)


def _close(got, ref):
    scale = max(float(np.abs(ref).max()), 1e-30)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("case", list(SIZES))
def test_dgrad_matches_the_twin_and_a_numpy_loop(case):
    _, dy, w = _data()
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    ops = _dgrad_operands(dy, w)
    ref = np.asarray(B.grouped_matmul_mxfp8_dgrad_ref(*ops, sizes))
    got = np.asarray(B.grouped_matmul_mxfp8_dgrad(*ops, sizes, interpret=True))
    _close(got, ref)
    dyd, wd = _decode(ops[0], ops[1], 1), _decode(ops[2], ops[3], 2)
    loop = np.zeros((ROWS, K))
    start = 0
    for g, n in enumerate(SIZES[case]):
        loop[start : start + n] = dyd[start : start + n] @ wd[g].T
        start += n
    _close(ref, loop)
    assert np.all(got[start:] == 0)


@pytest.mark.parametrize("case", list(SIZES))
def test_wgrad_matches_the_twin_and_a_numpy_loop(case):
    x, dy, _ = _data(1)
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    xv, xs = MQ.mxfp8_quantize_ref(B.to_group_padded(x, sizes), 0)  # blocks along the padded rows
    dv, ds = MQ.mxfp8_quantize_ref(B.to_group_padded(dy, sizes), 0)
    ref = np.asarray(B.grouped_matmul_mxfp8_wgrad_ref(xv, xs, dv, ds, sizes))
    got = np.asarray(B.grouped_matmul_mxfp8_wgrad(xv, xs, dv, ds, sizes, interpret=True))
    _close(got, ref)
    xd, dd = _decode(xv, xs, 0), _decode(dv, ds, 0)
    dest, starts = (np.asarray(a) for a in B.group_padded_rows(sizes, ROWS))
    loop = np.zeros((G, K, N))
    for g, n in enumerate(SIZES[case]):
        rows = slice(starts[g], starts[g] + n)
        loop[g] = xd[rows].T @ dd[rows]
    _close(ref, loop)
    for g, n in enumerate(SIZES[case]):
        if n == 0:
            assert np.all(got[g] == 0)


def test_group_padded_layout_starts_every_group_on_a_block():
    dest, starts = (np.asarray(a) for a in B.group_padded_rows(jnp.asarray([0, 37, 0, 5, 64, 0]), ROWS))
    np.testing.assert_array_equal(starts, [0, 0, 64, 64, 96, 160])  # 37 -> 64 rows, 5 -> 32, 64 -> 64
    np.testing.assert_array_equal(dest[:37], np.arange(37))
    np.testing.assert_array_equal(dest[37:42], 64 + np.arange(5))
    np.testing.assert_array_equal(dest[42:106], 96 + np.arange(64))
    assert np.all(dest[106:] == B.padded_rows_bound(ROWS, 6)) and B.padded_rows_bound(ROWS, 6) == 320


@pytest.mark.parametrize("kernel", ["dgrad", "wgrad"])
def test_backward_kernels_lower_for_cuda_as_triton_custom_calls(kernel):
    e4m3, u8 = jnp.float8_e4m3fn, jnp.uint8
    spec = jax.ShapeDtypeStruct
    if kernel == "dgrad":
        fn = B.grouped_matmul_mxfp8_dgrad
        args = [spec((ROWS, N), e4m3), spec((ROWS, N // 32), u8), spec((G, K, N), e4m3), spec((G, K, N // 32), u8)]
        out = (ROWS, K)
    else:
        fn = B.grouped_matmul_mxfp8_wgrad
        p = B.padded_rows_bound(ROWS, G)
        args = [spec((p, K), e4m3), spec((p // 32, K), u8), spec((p, N), e4m3), spec((p // 32, N), u8)]
        out = (G, K, N)
    exp = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args, spec((G,), jnp.int32))
    module = exp.mlir_module()
    assert "__gpu$xla.gpu.triton" in module
    assert exp.out_avals[0].shape == out
