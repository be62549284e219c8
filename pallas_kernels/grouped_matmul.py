"""Grouped matmuls over expert groups with MXFP8 or NVFP4 operands, scales applied in the kernel
(Triton, Hopper-class), and their jnp reference twins. MXFP8: FP8 x FP8 dots with float32
accumulation, one per 32-wide slice of K, each partial product multiplied by its two blocks'
power-of-two scales; NVFP4: E2M1 expanded in the kernel and multiplied by its block scales into
bfloat16 (exact), bfloat16 dots with float32 accumulation, second-level scales in the epilogue.
MXFP8 below; NVFP4 (`grouped_matmul_nvfp4`) at the end. Backward kernels: `grouped_matmul_bwd.py`.

    y[r] = dequant(x)[r] @ dequant(w)[g(r)]   for the rows r of group g (rows sorted by group)

x: float8_e4m3fn [rows, K] with E8M0 codes uint8 [rows, K/32] (row-wise MXFP8, blocks along K);
w: float8_e4m3fn [G, K, N] with codes uint8 [G, K/32, N] (blocks along K, the contraction axis);
sizes: int32 [G], known only at run time (empty groups allowed; rows past sum(sizes) give 0).
Output float32 [rows, N].

Schedule: the wrapper cuts every group into tiles of `tm` rows (a tile never spans two groups;
the number of tiles is bounded statically by rows / tm + G) and passes, per tile, its group, first
row and the group's end row as small int32 arrays. Grid (tiles, N / tn): a step loads its group's
weight columns and, for each 32-wide slice of K, its tile of rows, multiplies
the FP8 slices x_k @ w_k in float32 and accumulates that partial product times its scales. Masked
stores write only the tile's valid rows; the wrapper zeroes rows no tile covers. x is padded by
`tm` rows so that no load reads past its end (rows past a group's end are loaded unmasked: an
output row depends on its own x row only). E8M0 code 255 (NaN) decodes to NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange, repeat
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.shapes import out_struct

BLOCK = 32


def e8m0_to_f32(code: jax.Array) -> jax.Array:
    """uint8 E8M0 codes -> float32 2^(code - 127) (code 0: 2^-127, a float32 subnormal; 255: NaN)."""
    c = code.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(c << 23, jnp.float32)
    v = jnp.where(c == 0, 2.0**-127, normal)
    return jnp.where(c == 255, jnp.nan, v)


def grouped_matmul_mxfp8_ref(xv, xs, wv, ws, sizes) -> jax.Array:
    """The jnp twin: dequantise both operands exactly, then a float32 ragged_dot."""
    rows = xv.shape[0]
    x_blocks = rearrange(xv.astype(jnp.float32), "r (kb blk) -> r kb blk", blk=BLOCK)
    x = rearrange(x_blocks * e8m0_to_f32(xs)[..., None], "r kb blk -> r (kb blk)")
    w_blocks = rearrange(wv.astype(jnp.float32), "g (kb blk) n -> g kb blk n", blk=BLOCK)
    w = rearrange(w_blocks * e8m0_to_f32(ws)[:, :, None, :], "g kb blk n -> g (kb blk) n")
    y = jax.lax.ragged_dot(x, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return jnp.where((jnp.arange(rows) < sizes.sum())[:, None], y, 0.0)


def tile_schedule(sizes: jax.Array, rows: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per tile of tm rows (num_tiles = rows // tm + G, a static bound): (group, first row, end row
    of its group). Tiles past the used ones start at `rows` and are empty."""
    g = sizes.shape[0]
    num_tiles = rows // tm + g
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + tm - 1) // tm
    tile_ends = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), g - 1).astype(jnp.int32)
    used = t < tile_ends[-1]
    first = jnp.where(used, starts[group] + (t - (tile_ends - tiles)[group]) * tm, rows)
    end = jnp.where(used, ends[group], rows)
    return group, first.astype(jnp.int32), end.astype(jnp.int32)


def launch_grouped(kernel, sizes, rows: int, n: int, tm: int, tn: int, interpret: bool, group, *operands) -> jax.Array:
    """Run a grouped-matmul kernel over the tile schedule (one program per row tile x column tile;
    inputs padded by one tile of rows) -> float32[rows, n], rows past sum(sizes) zero."""
    y = pl.pallas_call(
        kernel,
        grid=(group.shape[0], n // tn),
        out_shape=out_struct((rows + tm, n), jnp.float32, group, *operands),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(group, *operands)
    return jnp.where((jnp.arange(rows) < sizes.sum())[:, None], y[:rows], 0.0)


def _kernel(group_ref, first_ref, end_ref, xv_ref, xs_ref, wv_ref, ws_ref, y_ref, *, tm, tn, k):
    t = pl.program_id(0)
    j = pl.program_id(1)
    g = group_ref[t]
    first = first_ref[t]
    end = end_ref[t]
    row_ok = first + jnp.arange(tm, dtype=jnp.int32) < end
    cols = pl.ds(j * tn, tn)
    rows = pl.ds(first, tm)

    # one loop over the K / 32 scaled slices (a loop in the kernel's IR, not K / 32 unrolled copies)
    def step(kb, acc):
        # rows past the group's end (another group's, or padding) are read but never stored: an
        # output row depends on its own x row only
        x = plt.load(xv_ref.at[rows, pl.ds(kb * BLOCK, BLOCK)])
        xs = plt.load(xs_ref.at[rows, kb])
        w = plt.load(wv_ref.at[g, pl.ds(kb * BLOCK, BLOCK), cols])
        ws = plt.load(ws_ref.at[g, kb, cols])
        # an FP8 x FP8 product with float32 accumulation (the tensor-core MMA); one block's scales
        # are constant along its 32-element slice of K, so they multiply the partial product
        part = jnp.dot(x, w, preferred_element_type=jnp.float32)
        return acc + (part * e8m0_to_f32(xs)[:, None]) * e8m0_to_f32(ws)[None, :]

    acc = jax.lax.fori_loop(0, k // BLOCK, step, jnp.zeros((tm, tn), jnp.float32))
    plt.store(y_ref.at[rows, cols], acc, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("tm", "tn", "interpret"))
def grouped_matmul_mxfp8(xv, xs, wv, ws, sizes, tm: int = 32, tn: int = 32, interpret: bool = False) -> jax.Array:
    """The Pallas kernel; arguments and result as `grouped_matmul_mxfp8_ref`. K a multiple of 32,
    N of tn; tm, tn powers of two >= 16."""
    rows, k = xv.shape
    g, _, n = wv.shape
    if k % BLOCK or n % tn:
        raise ValueError(f"K={k} must be a multiple of {BLOCK} and N={n} of tn={tn}")
    group, first, end = tile_schedule(sizes, rows, tm)
    pad = lambda a, fill: jnp.concatenate([a, jnp.full((tm,) + a.shape[1:], fill, a.dtype)])
    return launch_grouped(
        functools.partial(_kernel, tm=tm, tn=tn, k=k),
        sizes,
        rows,
        n,
        tm,
        tn,
        interpret,
        group,
        first,
        end,
        pad(xv, 0),
        pad(xs, 127),
        wv,
        ws,
    )


# --------------------------------------------------------------------------------------------------
# NVFP4 operands
# --------------------------------------------------------------------------------------------------

NVFP4_BLOCK = 16


def e2m1_decode(code: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (int) -> float32: magnitude index i is i/2 for i <= 4, then 3, 4, 6."""
    i = (code & 7).astype(jnp.float32)
    mag = jnp.where(i <= 4.0, i * 0.5, jnp.where(i == 5.0, 3.0, jnp.where(i == 6.0, 4.0, 6.0)))
    return jnp.where((code & 8) != 0, -mag, mag)


def _unpack_along_k(packed: jax.Array) -> jax.Array:
    """Bytes [a, K/2, ...] holding elements 2i (low nibble) and 2i+1 (high) along K -> float32 E2M1
    values [a, K, ...]."""
    c = packed.astype(jnp.int32)
    both = jnp.stack([e2m1_decode(c & 15), e2m1_decode(c >> 4)], axis=2)
    return rearrange(both, "a byte nibble ... -> a (byte nibble) ...")


def _block_scales_along_k(s: jax.Array) -> jax.Array:
    """E4M3 block scales [a, K/16, ...] -> float32 [a, K, ...], each repeated over its block."""
    return repeat(s.astype(jnp.float32), "a kb ... -> a (kb blk) ...", blk=NVFP4_BLOCK)


def grouped_matmul_nvfp4_ref(xp, xsb, xs2, wp, wsb, ws2, sizes) -> jax.Array:
    """The jnp twin of `grouped_matmul_nvfp4`: dequantise exactly ((e2m1 * s_block) * s_second),
    then a float32 ragged_dot."""
    rows = xp.shape[0]
    x = _unpack_along_k(xp) * _block_scales_along_k(xsb) * xs2.reshape(rows, 1)
    w = _unpack_along_k(wp) * _block_scales_along_k(wsb) * ws2.reshape(-1, 1, 1)
    y = jax.lax.ragged_dot(x, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return jnp.where((jnp.arange(rows) < sizes.sum())[:, None], y, 0.0)


def _nvfp4_kernel(
    group_ref, first_ref, end_ref, xp_ref, xsb_ref, xs2_ref, wp_ref, wsb_ref, ws2_ref, y_ref, *, tm, tn, k
):
    t = pl.program_id(0)
    j = pl.program_id(1)
    g = group_ref[t]
    first = first_ref[t]
    row_ok = first + jnp.arange(tm, dtype=jnp.int32) < end_ref[t]
    cols = pl.ds(j * tn, tn)
    rows = pl.ds(first, tm)
    first_half = jnp.arange(16, dtype=jnp.int32) < 8  # bytes 0-7 of a 32-element slice: its first block

    def step(kb, acc):  # 32 elements = 16 bytes = two NVFP4 blocks per step
        xb = plt.load(xp_ref.at[rows, pl.ds(kb * 16, 16)]).astype(jnp.int32)
        xa = plt.load(xsb_ref.at[rows, 2 * kb]).astype(jnp.float32)
        xc = plt.load(xsb_ref.at[rows, 2 * kb + 1]).astype(jnp.float32)
        sx = jnp.where(first_half[None, :], xa[:, None], xc[:, None])
        wb = plt.load(wp_ref.at[g, pl.ds(kb * 16, 16), cols]).astype(jnp.int32)
        wa = plt.load(wsb_ref.at[g, 2 * kb, cols]).astype(jnp.float32)
        wc = plt.load(wsb_ref.at[g, 2 * kb + 1, cols]).astype(jnp.float32)
        sw = jnp.where(first_half[:, None], wa[None, :], wc[None, :])
        # the low nibbles hold the even elements of both operands and the high nibbles the odd:
        # the contraction splits into two dots without reordering any element
        # E2M1 (2 significant bits) x an E4M3 block scale (4) is exact in bfloat16 (8): the expanded
        # operands go through the 16-bit MMA with float32 accumulation and lose nothing
        bf = lambda a: a.astype(jnp.bfloat16)
        lo = jnp.dot(bf(e2m1_decode(xb & 15) * sx), bf(e2m1_decode(wb & 15) * sw), preferred_element_type=jnp.float32)
        hi = jnp.dot(bf(e2m1_decode(xb >> 4) * sx), bf(e2m1_decode(wb >> 4) * sw), preferred_element_type=jnp.float32)
        return acc + lo + hi

    acc = jax.lax.fori_loop(0, k // 32, step, jnp.zeros((tm, tn), jnp.float32))
    y = acc * plt.load(xs2_ref.at[rows])[:, None] * ws2_ref[g]  # second-level scales in the epilogue
    plt.store(y_ref.at[rows, cols], y, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("tm", "tn", "interpret"))
def grouped_matmul_nvfp4(
    xp, xsb, xs2, wp, wsb, ws2, sizes, tm: int = 32, tn: int = 32, interpret: bool = False
) -> jax.Array:
    """Grouped matmul with NVFP4 operands, scales applied in the kernel.

    x: packed E2M1 uint8 [rows, K/2] (elements 2i / 2i+1 of a row in the low / high nibble of
    byte i), E4M3 block scales [rows, K/16], per-token second-level scales float32 [rows] (or
    [rows, 1]); w: packed along K, uint8 [G, K/2, N], E4M3 scales [G, K/16, N], a second-level
    scale per expert float32 [G]; sizes int32 [G] -> float32 [rows, N]. Block scales multiply the
    decoded elements before each dot, second-level scales the accumulator (the epilogue)."""
    rows, kh = xp.shape
    k = 2 * kh
    n = wp.shape[2]
    if k % 32 or n % tn:
        raise ValueError(f"K={k} must be a multiple of 32 and N={n} of tn={tn}")
    group, first, end = tile_schedule(sizes, rows, tm)
    pad = lambda a: jnp.concatenate([a, jnp.zeros((tm,) + a.shape[1:], a.dtype)])
    return launch_grouped(
        functools.partial(_nvfp4_kernel, tm=tm, tn=tn, k=k),
        sizes,
        rows,
        n,
        tm,
        tn,
        interpret,
        group,
        first,
        end,
        pad(xp),
        pad(xsb),
        pad(xs2.reshape(rows)),
        wp,
        wsb,
        ws2.reshape(-1),
    )
