"""MXFP8 (E4M3) quantisation kernels, row-wise and column-wise, with their jnp reference twin.

x [M, K] (float32 or bfloat16) -> (elements float8_e4m3fn [M, K], E8M0 scale codes uint8), one
scale per 32 consecutive elements along K ("row-wise": scales [M, K/32], the layout of an operand
contracted over K) or along M ("column-wise": scales [M/32, K], the same tensor's layout for a
product contracted over M, e.g. the weight gradient).

Scale rules (`rule`): "ocp", the OCP MX v1.0 conversion, s = floor(log2 amax) - 8, elements above
448 saturate; "ceil", the round-up rule, s = ceil(log2(amax / 448)), never saturates. Both with s
clamped to [-127, 127], s = -127 for an all-zero block and the NaN code 255 for a block holding a
NaN or an Inf. The scale is computed with integer operations on the float32 bits (exact, no log2):
amax = 1.f * 2^E gives floor(log2 amax) = E, and amax / 2^(E - 8) = 1.f * 256 <= 448 exactly when
the fraction bits are <= 0x600000 (1.f <= 1.75). Elements: x * 2^-s (exact), clamped to +-448 and
converted to E4M3 (round to nearest, ties to even). Equal, bit for bit, to
`composer_jax.quant.formats.mx_quantize(x, "mxfp8_e4m3", axis, rule)` (tested).

The kernels are Triton-style Pallas (BlockSpec + grid, one 32-element block of scales per step
along the blocked axis), lowered for CUDA through `jax.experimental.pallas.triton`; on CPU they
run with `interpret=True`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.shapes import out_struct

BLOCK = 32
E4M3_MAX = 448.0
_FRAC_175 = 0x600000  # fraction bits of 1.75 = 448 / 256


def _scale_exponent(amax: jax.Array, rule: str) -> jax.Array:
    """int32 shared exponent from float32 amax >= 0 (finite), by bit operations."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    e = ((bits >> 23) & 0xFF) - 127  # floor(log2 amax) for normal amax; -127 for 0 and subnormals
    s = e - 8
    if rule == "ceil":
        s = s + ((bits & 0x7FFFFF) > _FRAC_175).astype(jnp.int32)
    elif rule != "ocp":
        raise ValueError(f"MX scale rule {rule!r} is not accepted; accepted: ocp, ceil")
    s = jnp.where(amax > 0, s, -127)
    return jnp.clip(s, -127, 127)


def _pow2(k: jax.Array) -> jax.Array:
    """float32 2^k for int32 k in [-126, 127], built from its exponent bits."""
    return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _quantize_block(x: jax.Array, axis: int, rule: str) -> tuple[jax.Array, jax.Array]:
    """x: a float32 tile whose `axis` is exactly one 32-element block -> (E4M3 elements, codes)."""
    # NaN counted as Inf explicitly: XLA:CPU's vectorised max reduction may drop a NaN
    amax = jnp.max(jnp.where(x == x, jnp.abs(x), jnp.inf), axis=axis)
    finite = amax < jnp.inf  # False for a block holding Inf or NaN
    s = _scale_exponent(jnp.where(finite, amax, 0.0), rule)
    inv = jnp.expand_dims(_pow2(-s), axis)
    v = jnp.clip(x * inv, -E4M3_MAX, E4M3_MAX)
    v = jnp.where(jnp.expand_dims(finite, axis), v, jnp.nan)
    code = jnp.where(finite, s + 127, 255)
    return v.astype(jnp.float8_e4m3fn), code.astype(jnp.uint8)


def mxfp8_quantize_ref(x: jax.Array, axis: int = 1, rule: str = "ceil") -> tuple[jax.Array, jax.Array]:
    """The jnp reference twin: x [M, K] -> (float8_e4m3fn [M, K], uint8 scales [M, K/32] for
    axis=1 or [M/32, K] for axis=0)."""
    xf = x.astype(jnp.float32)
    if axis == 1:
        v, code = _quantize_block(rearrange(xf, "m (kb blk) -> m kb blk", blk=BLOCK), 2, rule)
        return rearrange(v, "m kb blk -> m (kb blk)"), code
    v, code = _quantize_block(rearrange(xf, "(mb blk) k -> mb blk k", blk=BLOCK), 1, rule)
    return rearrange(v, "mb blk k -> (mb blk) k"), code


def _row_kernel(x_ref, v_ref, s_ref, *, rule):
    v, code = _quantize_block(x_ref[...].astype(jnp.float32), 1, rule)
    v_ref[...] = v
    s_ref[...] = code


def _col_kernel(x_ref, v_ref, s_ref, *, rule):
    v, code = _quantize_block(x_ref[...].astype(jnp.float32), 0, rule)
    v_ref[...] = v
    s_ref[...] = code


@functools.partial(jax.jit, static_argnames=("axis", "rule", "tile", "interpret"))
def mxfp8_quantize(
    x: jax.Array, axis: int = 1, rule: str = "ceil", tile: int = 64, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel: x [M, K] with the blocked axis a multiple of 32 and the other a multiple
    of `tile` (a power of two) -> as `mxfp8_quantize_ref`. Each grid step quantises a [tile, 32]
    (row-wise) or [32, tile] (column-wise) tile of x into one scale per row / column."""
    m, k = x.shape
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 or 1, got {axis}")
    blocked, other = (k, m) if axis == 1 else (m, k)
    if blocked % BLOCK or other % tile:
        raise ValueError(f"x {x.shape}: axis {axis} must be a multiple of {BLOCK}, the other of tile={tile}")
    if axis == 1:
        grid = (m // tile, k // BLOCK)
        in_spec = pl.BlockSpec((tile, BLOCK), lambda i, j: (i, j))
        scale_spec = pl.BlockSpec((tile, None), lambda i, j: (i, j))
        scale_shape = (m, k // BLOCK)
        kernel = functools.partial(_row_kernel, rule=rule)
    else:
        grid = (m // BLOCK, k // tile)
        in_spec = pl.BlockSpec((BLOCK, tile), lambda i, j: (i, j))
        scale_spec = pl.BlockSpec((None, tile), lambda i, j: (i, j))
        scale_shape = (m // BLOCK, k)
        kernel = functools.partial(_col_kernel, rule=rule)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[in_spec],
        out_specs=[in_spec, scale_spec],
        out_shape=[
            out_struct((m, k), jnp.float8_e4m3fn, x),
            out_struct(scale_shape, jnp.uint8, x),
        ],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(x)
