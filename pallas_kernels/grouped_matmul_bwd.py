"""The backward grouped matmuls with MXFP8 operands (Triton, Hopper-class) and their jnp twins.

For y = x @ w[g] on the rows of group g (x [rows, K] sorted by group, w [G, K, N]) and a cotangent
dy [rows, N]:

  dgrad  dx[r]  = dy[r] @ w[g(r)]^T            contraction over N: dy blocked along N (row-wise,
                                                scales [rows, N/32]); w blocked along N too
                                                (scales [G, K, N/32]), read transposed in the kernel
  wgrad  dw[g]  = x[rows of g]^T @ dy[rows of g]  contraction over each group's rows (a ragged K):
                                                x and dy blocked along the rows (column-wise), the
                                                blocks restarting at every group boundary

Both are FP8 x FP8 dots with float32 accumulation over 32-element slices of the contraction axis;
a block's E8M0 scale is constant along its slice, so each partial product is multiplied by its
scales (per output row and column) before it is accumulated.

The wgrad takes its operands in the group-padded layout (`group_padded_rows`): every group starts
at a multiple of 32 rows and its last block is padded with zero rows, so that the column-wise MXFP8
quantisation kernel (`mx_quant.mxfp8_quantize(axis=0)`) applied to the whole padded array gives
exactly the per-group blocks, and the wgrad kernel walks whole blocks. Its grid is (G, K / tk,
N / tn); a program loops over its group's blocks, a trip count known only at run time (an empty
group writes zeros).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.grouped_matmul import BLOCK, e8m0_to_f32, launch_grouped, tile_schedule
from pallas_kernels.shapes import out_struct


def _dequant_rows(v: jax.Array, s: jax.Array) -> jax.Array:
    """[..., M] elements with scales [..., M/32] along the last axis -> float32."""
    blocks = rearrange(v.astype(jnp.float32), "... (mb blk) -> ... mb blk", blk=BLOCK)
    return rearrange(blocks * e8m0_to_f32(s)[..., None], "... mb blk -> ... (mb blk)")


# --------------------------------------------------------------------------------------------------
# dgrad: dy @ w^T per group
# --------------------------------------------------------------------------------------------------


def grouped_matmul_mxfp8_dgrad_ref(dyv, dys, wv, ws, sizes) -> jax.Array:
    """The jnp twin: dyv float8_e4m3fn [rows, N], dys uint8 [rows, N/32]; wv float8_e4m3fn
    [G, K, N], ws uint8 [G, K, N/32]; sizes int32 [G] -> float32 [rows, K] (rows past sum(sizes)
    0): dequantise exactly, then a float32 ragged_dot with the weight transposed."""
    rows = dyv.shape[0]
    dy = _dequant_rows(dyv, dys)
    w = _dequant_rows(wv, ws)
    y = jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return jnp.where((jnp.arange(rows) < sizes.sum())[:, None], y, 0.0)


def _dgrad_kernel(group_ref, first_ref, end_ref, dyv_ref, dys_ref, wv_ref, ws_ref, dx_ref, *, tm, tk, n):
    t = pl.program_id(0)
    j = pl.program_id(1)
    g = group_ref[t]
    first = first_ref[t]
    row_ok = first + jnp.arange(tm, dtype=jnp.int32) < end_ref[t]
    rows = pl.ds(first, tm)
    cols = pl.ds(j * tk, tk)  # columns of dx = rows of w[g]

    def step(nb, acc):  # the N / 32 scaled slices of the contraction
        dy = plt.load(dyv_ref.at[rows, pl.ds(nb * BLOCK, BLOCK)])  # [tm, 32]
        w = plt.load(wv_ref.at[g, cols, pl.ds(nb * BLOCK, BLOCK)])  # [tk, 32]: w[g] read transposed
        part = jnp.dot(dy, w.T, preferred_element_type=jnp.float32)
        sd = e8m0_to_f32(plt.load(dys_ref.at[rows, nb]))
        sw = e8m0_to_f32(plt.load(ws_ref.at[g, cols, nb]))
        return acc + (part * sd[:, None]) * sw[None, :]

    acc = jax.lax.fori_loop(0, n // BLOCK, step, jnp.zeros((tm, tk), jnp.float32))
    plt.store(dx_ref.at[rows, cols], acc, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("tm", "tk", "interpret"))
def grouped_matmul_mxfp8_dgrad(dyv, dys, wv, ws, sizes, tm: int = 32, tk: int = 32, interpret: bool = False):
    """The Pallas dgrad kernel; arguments and result as `grouped_matmul_mxfp8_dgrad_ref`. N a
    multiple of 32, K of tk; tm, tk powers of two >= 16. Same tile schedule as the forward."""
    rows, n = dyv.shape
    k = wv.shape[1]
    if n % BLOCK or k % tk:
        raise ValueError(f"N={n} must be a multiple of {BLOCK} and K={k} of tk={tk}")
    group, first, end = tile_schedule(sizes, rows, tm)
    pad = lambda a, fill: jnp.concatenate([a, jnp.full((tm,) + a.shape[1:], fill, a.dtype)])
    kernel = functools.partial(_dgrad_kernel, tm=tm, tk=tk, n=n)
    return launch_grouped(
        kernel, sizes, rows, k, tm, tk, interpret, group, first, end, pad(dyv, 0), pad(dys, 127), wv, ws
    )


# --------------------------------------------------------------------------------------------------
# wgrad: x^T @ dy per group, over the group-padded layout
# --------------------------------------------------------------------------------------------------


def padded_rows_bound(rows: int, groups: int) -> int:
    """Static row count of the group-padded layout: every group rounded up to 32 rows."""
    return -(-(rows + groups * (BLOCK - 1)) // BLOCK) * BLOCK


def group_padded_rows(sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """-> (dest int32 [rows]: the padded row of each row, `padded_rows_bound` for rows past
    sum(sizes); padded_starts int32 [G]: the first padded row of each group, a multiple of 32)."""
    g = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded = (sizes + BLOCK - 1) // BLOCK * BLOCK
    padded_starts = jnp.cumsum(padded) - padded
    r = jnp.arange(rows, dtype=jnp.int32)
    grp = jnp.searchsorted(ends, r, side="right")
    valid = grp < g
    gc = jnp.minimum(grp, g - 1)
    dest = jnp.where(valid, padded_starts[gc] + r - starts[gc], padded_rows_bound(rows, g))
    return dest.astype(jnp.int32), padded_starts.astype(jnp.int32)


def to_group_padded(a: jax.Array, sizes: jax.Array) -> jax.Array:
    """[rows, C] sorted by group -> [padded_rows_bound, C] in the group-padded layout (zeros
    between groups and after the last one)."""
    rows = a.shape[0]
    dest, _ = group_padded_rows(sizes, rows)
    out = jnp.zeros((padded_rows_bound(rows, sizes.shape[0]),) + a.shape[1:], a.dtype)
    return out.at[dest].set(a, mode="drop")


def grouped_matmul_mxfp8_wgrad_ref(xv, xs, dyv, dys, sizes) -> jax.Array:
    """The jnp twin: in the group-padded layout (P rows), xv float8_e4m3fn [P, K] with scales
    uint8 [P/32, K], dyv [P, N] with [P/32, N]; sizes int32 [G] (the unpadded group sizes) ->
    float32 [G, K, N]: dequantise exactly, then dw[g] = x_g^T dy_g as the transpose of a float32
    ragged_dot over the padded group sizes."""
    p, k = xv.shape
    x = _dequant_rows(xv.T, xs.T).T
    dy = _dequant_rows(dyv.T, dys.T).T
    padded = (sizes.astype(jnp.int32) + BLOCK - 1) // BLOCK * BLOCK
    w0 = jnp.zeros((sizes.shape[0], k, dy.shape[1]), jnp.float32)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, padded, preferred_element_type=jnp.float32), w0)
    return vjp(dy)[0]


def _wgrad_kernel(start_ref, nblocks_ref, xv_ref, xs_ref, dyv_ref, dys_ref, dw_ref, *, tk, tn):
    g = pl.program_id(0)
    kc = pl.ds(pl.program_id(1) * tk, tk)
    nc = pl.ds(pl.program_id(2) * tn, tn)
    first_block = start_ref[g] // BLOCK

    def body(b, acc):
        rows = pl.ds((first_block + b) * BLOCK, BLOCK)
        x = plt.load(xv_ref.at[rows, kc])  # [32, tk]
        dy = plt.load(dyv_ref.at[rows, nc])  # [32, tn]
        part = jnp.dot(x.T, dy, preferred_element_type=jnp.float32)  # [tk, tn]
        sx = e8m0_to_f32(plt.load(xs_ref.at[first_block + b, kc]))
        sd = e8m0_to_f32(plt.load(dys_ref.at[first_block + b, nc]))
        return acc + (part * sx[:, None]) * sd[None, :]

    acc = jax.lax.fori_loop(0, nblocks_ref[g], body, jnp.zeros((tk, tn), jnp.float32))
    dw_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("tk", "tn", "interpret"))
def grouped_matmul_mxfp8_wgrad(xv, xs, dyv, dys, sizes, tk: int = 32, tn: int = 32, interpret: bool = False):
    """The Pallas wgrad kernel; arguments and result as `grouped_matmul_mxfp8_wgrad_ref`. K a
    multiple of tk, N of tn; P (the padded rows) a multiple of 32 holding every group's blocks."""
    p, k = xv.shape
    n = dyv.shape[1]
    g = sizes.shape[0]
    if p % BLOCK or k % tk or n % tn:
        raise ValueError(f"padded rows {p} must be a multiple of {BLOCK}, K={k} of tk={tk}, N={n} of tn={tn}")
    sizes = sizes.astype(jnp.int32)
    nblocks = (sizes + BLOCK - 1) // BLOCK
    starts = (jnp.cumsum(nblocks) - nblocks) * BLOCK
    return pl.pallas_call(
        functools.partial(_wgrad_kernel, tk=tk, tn=tn),
        grid=(g, k // tk, n // tn),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, tk, tn), lambda g_, k_, n_: (g_, k_, n_)),
        out_shape=out_struct((g, k, n), jnp.float32, sizes, xv, xs, dyv, dys),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(starts.astype(jnp.int32), nblocks.astype(jnp.int32), xv, xs, dyv, dys)
