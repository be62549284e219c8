"""Quantised grouped matmuls for the MoE experts: NVFP4 (or MXFP8) forward, MXFP8 backward.

Two shapes of grouped matmul, the two the MoE dispatch paths use (`model/moe/grouped.py`):
  - `tile_matmul(x [T, m, k], w [T, k, n])`: one matrix per tile (the tiled CPU path and the
    gather-only tiled dispatch; every tile's rows belong to one expert, its weights gathered);
  - `ragged_matmul(x [rows, k], w [G, k, n], sizes [G])`: rows sorted by group, group sizes known
    only at run time (`jax.lax.ragged_dot`, the GPU path and expert parallelism).

Both are `jax.custom_vjp`s. With y = x w (contraction over k):
  forward  y  = Q_f(x along k) Q_f(w along k)
  dgrad    dx = Q_b(dy along n) Q_b(w along n)^T
  wgrad    dw = Q_b(x along rows)^T Q_b(dy along rows)       (per group)
Every operand is quantised along the contraction axis of its own product, as block-scaled tensor
cores need (a block's scale factors out of the dot product). The backward quantises the saved
high-precision x and w afresh (not the forward's codes). Recipes:
  - "bf16": no quantisation (the callers do not come here at all);
  - "mxfp8": Q_f = Q_b = MXFP8 E4M3, one E8M0 scale per 32;
  - "nvfp4_fwd_mxfp8_bwd" (Composer 2): Q_f = NVFP4 with a per-token second-level scale for the
    activations (each row of x: its quantisation depends on that token alone) and one per expert
    matrix for the weights; Q_b = MXFP8 E4M3.
MX scales use the round-up rule by default (never saturates; `Recipe.mx_rule="ocp"` for the
specification's). Along the rows of the wgrad, MX blocks restart at every group boundary (as if
each group were zero-padded to a multiple of 32), so one group's scales never see another's rows;
in the tiled layout groups are tile-aligned and a tile is padded with zeros to 32 rows.

Backend "xla" is the reference: operands are quantised and dequantised exactly in float32
(`quant.formats`) and multiplied with float32 accumulation, which is what a block-scaled MMA computes
up to the order of its sums. Backend "pallas" (`quant/pallas_backend.py`) runs the quantisation and
all three products as `pallas_kernels` (compiled on a GPU, interpreted elsewhere); it equals the
reference bit for bit in quantisation and to float32 accumulation order in the products (tested).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange

from composer_jax.quant import pallas_backend
from composer_jax.quant.formats import (
    E4M3,
    MX_BLOCK,
    ScaleRule,
    fake_quantize,
    mx_scale_exponent,
    round_to_format,
)
from composer_jax.quant.recipe import Recipe
from composer_jax.sharding import vary_like


def _mx(a: jax.Array, axis: int, r: Recipe) -> jax.Array:
    return fake_quantize(a, "mxfp8_e4m3", axis, rule=r.mx_rule)


def _fwd_act(x: jax.Array, axis: int, r: Recipe) -> jax.Array:
    if r.fwd == "nvfp4":
        return fake_quantize(x, "nvfp4", axis, second=r.nvfp4_second)
    if r.fwd == "mxfp8":
        return _mx(x, axis, r)
    return x.astype(jnp.float32)


def _fwd_weight(w: jax.Array, axis: int, r: Recipe) -> jax.Array:
    """w: [groups, k, n]; NVFP4's second-level scale is per group (expert) matrix."""
    if r.fwd == "nvfp4":
        return fake_quantize(w, "nvfp4", axis, second=(1, 2))
    if r.fwd == "mxfp8":
        return _mx(w, axis, r)
    return w.astype(jnp.float32)


def _bwd_q(a: jax.Array, axis: int, r: Recipe) -> jax.Array:
    return _mx(a, axis, r) if r.bwd == "mxfp8" else a.astype(jnp.float32)


def mx_fake_quantize_grouped_rows(a: jax.Array, sizes: jax.Array, rule: ScaleRule = "ceil") -> jax.Array:
    """MXFP8 E4M3 quantise-dequantise of a [rows, n] array along its rows, in blocks of 32 that
    restart at every group boundary (rows sorted by group, `sizes` per group; rows past the last
    group form one more group). Equal to zero-padding every group to a multiple of 32 rows."""
    rows = a.shape[0]
    g = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    r = jnp.arange(rows, dtype=jnp.int32)
    grp = jnp.searchsorted(ends, r, side="right")  # g for rows past the valid ones
    first_row = jnp.concatenate([starts, ends[-1:]])[grp]
    block_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((sizes + MX_BLOCK - 1) // MX_BLOCK)])
    seg = block_start[grp] + (r - first_row) // MX_BLOCK
    num = rows // MX_BLOCK + g + 2  # static bound on the number of blocks
    af = a.astype(jnp.float32)
    mag = jnp.where(jnp.isnan(af), jnp.inf, jnp.abs(af))  # NaN counted as Inf
    amax = jax.ops.segment_max(mag, seg, num_segments=num)[seg]  # [rows, n]
    s = mx_scale_exponent(amax, E4M3, rule)
    v = jnp.ldexp(round_to_format(jnp.ldexp(af, -s), E4M3), s)
    return jnp.where(jnp.isfinite(amax), v, jnp.nan)


# --------------------------------------------------------------------------------------------------
# One matrix per tile
# --------------------------------------------------------------------------------------------------


def _one_type(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map, both operands cast to vary over every manual axis either varies over
    (tokens vary over the data axes, expert weights only over the expert axis): the custom VJP's
    gradients then have its inputs' type, and autodiff turns the cast of w into the psum of its
    gradient over the data axes. Outside shard_map nothing changes."""
    return vary_like(x, w), vary_like(w, x)


def _tile_sizes(x: jax.Array) -> jax.Array:
    """[tiles, m, k] as groups of m rows, one per tile (the pallas backend's ragged layout)."""
    return jnp.full((x.shape[0],), x.shape[1], jnp.int32)


# the pallas backend's ragged layout of [tiles, m, *] tiles: their rows stacked, m rows per group
_STACK_TILES = "tile m c -> (tile m) c"
_UNSTACK_TILES = "(tile m) c -> tile m c"


def _tile_fwd(x, w, r):
    if r.backend == "pallas":
        y = pallas_backend.forward(rearrange(x, _STACK_TILES), w, _tile_sizes(x), r)
        return rearrange(y, _UNSTACK_TILES, tile=x.shape[0]).astype(x.dtype), (x, w)
    y = jnp.einsum("tmk,tkn->tmn", _fwd_act(x, 2, r), _fwd_weight(w, 1, r))
    return y.astype(x.dtype), (x, w)


def _tile_bwd(r, res, dy):
    x, w = res
    if r.backend == "pallas":
        sizes, dyr = _tile_sizes(x), rearrange(dy, _STACK_TILES)
        dx = rearrange(pallas_backend.dgrad(dyr, w, sizes, r), _UNSTACK_TILES, tile=x.shape[0])
        dw = pallas_backend.wgrad(rearrange(x, _STACK_TILES), dyr, sizes, r)
        return dx.astype(x.dtype), dw.astype(w.dtype)
    dx = jnp.einsum("tmn,tkn->tmk", _bwd_q(dy, 2, r), _bwd_q(w, 2, r))
    dw = jnp.einsum("tmk,tmn->tkn", _bwd_q(x, 1, r), _bwd_q(dy, 1, r))
    return dx.astype(x.dtype), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tile_matmul(x: jax.Array, w: jax.Array, r: Recipe) -> jax.Array:
    return _tile_fwd(x, w, r)[0]


_tile_matmul.defvjp(_tile_fwd, _tile_bwd)


def tile_matmul(x: jax.Array, w: jax.Array, r: Recipe) -> jax.Array:
    """x: [tiles, m, k] @ w: [tiles, k, n] -> [tiles, m, n] (dtype of x), quantised by recipe r."""
    return _tile_matmul(*_one_type(x, w), r)


# --------------------------------------------------------------------------------------------------
# Rows sorted by group, sizes known at run time
# --------------------------------------------------------------------------------------------------


def _ragged(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def _ragged_fwd(x, w, sizes, r):
    sizes = sizes.astype(jnp.int32)
    if r.backend == "pallas":
        y = pallas_backend.forward(x, w, sizes, r)
    else:
        y = _ragged(_fwd_act(x, 1, r), _fwd_weight(w, 1, r), sizes)
    return y.astype(x.dtype), (x, w, sizes)


def _ragged_bwd(r, res, dy):
    x, w, sizes = res
    f0 = np.zeros(sizes.shape, jax.dtypes.float0)
    if r.backend == "pallas":
        dx, dw = pallas_backend.dgrad(dy, w, sizes, r), pallas_backend.wgrad(x, dy, sizes, r)
        return dx.astype(x.dtype), dw.astype(w.dtype), f0
    dx = _ragged(_bwd_q(dy, 1, r), jnp.swapaxes(_bwd_q(w, 2, r), 1, 2), sizes)
    if r.bwd == "mxfp8":
        xs, dys = (mx_fake_quantize_grouped_rows(a, sizes, r.mx_rule) for a in (x, dy))
    else:
        xs, dys = x.astype(jnp.float32), dy.astype(jnp.float32)
    # linearised at w itself (ragged_dot is linear in w): the point carries w's manual-axis type
    _, wgrad = jax.vjp(lambda w_: _ragged(xs, w_, sizes), w.astype(jnp.float32))
    (dw,) = wgrad(dys)
    return dx.astype(x.dtype), dw.astype(w.dtype), f0


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, r: Recipe) -> jax.Array:
    return _ragged_fwd(x, w, sizes, r)[0]


_ragged_matmul.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, r: Recipe) -> jax.Array:
    """x: [rows, k] sorted by group @ w: [groups, k, n] with sizes int[groups] -> [rows, n];
    rows past sum(sizes) give 0. Quantised by recipe r."""
    return _ragged_matmul(*_one_type(x, w), sizes, r)
