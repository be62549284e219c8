"""NVFP4 quantisation with a per-token second-level scale: a Pallas kernel and its jnp twin.

x [M, K] (float32 or bfloat16, K a multiple of 16) -> (packed E2M1 codes uint8 [M, K/2], E4M3
block scales float8_e4m3fn [M, K/16], per-token float32 second-level scales [M, 1]):

  s_second = amax(row) / (448 * 6)   correctly rounded (in integers: XLA folds a float division by a
                                     constant into a multiplication by the rounded reciprocal), at
                                     least 2^-126 (XLA:CPU flushes float32 subnormals to zero); 1 for
                                     an all-zero row, NaN for a row holding NaN or Inf
  s_block  = E4M3(clip(amax(block) / (6 * s_second), 2^-9, 448))    round to nearest even; the
                                     lower clip (E4M3's smallest subnormal) only for a nonzero block,
                                     so a block whose scale would round to 0 keeps what 2^-9 keeps
  e2m1     = E2M1(x / (s_block * s_second))                 round to nearest even, saturating at 6
                                                               (0 where s_block * s_second is 0)

Codes: sign << 3 | index of |e2m1| in (0, .5, 1, 1.5, 2, 3, 4, 6); element 2i in the low nibble of
byte i, 2i+1 in the high nibble. Equal, bit for bit, to `composer_jax.quant.formats.
nvfp4_quantize(x, axis=1, second="token")` (tested).

The row amax is one XLA reduction before the kernel (a whole row is a power-of-two block only for
some K). The kernel takes the even and odd columns as two operands (a strided slice each), so a
grid step holds one 16-element block per row as two [tile, 8] halves and writes its packed bytes
without an in-kernel shuffle. E2M1 rounding is arithmetic (the grid steps are 0.5, 1 and 2 in
[0, 2), [2, 4) and [4, 6]), ties to even by floor; no FP4 type is needed on the device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange, repeat
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.shapes import out_struct

BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_SMALLEST = 2.0**-9  # the least nonzero block scale
F32_TINY = 2.0**-126  # float32's smallest normal


def second_scale(x: jax.Array) -> jax.Array:
    """float32 [M, 1] per-token second-level scale (NaN counted as Inf in the amax)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.where(xf == xf, jnp.abs(xf), jnp.inf), axis=1, keepdims=True)
    return second_scale_of_amax(amax)


def second_scale_of_amax(amax: jax.Array) -> jax.Array:
    """float32 amax / 2688 correctly rounded, clamped below at 2^-126 (1 for amax 0, NaN for Inf
    or NaN): the integer quotient of amax's 24-bit significand times 2^5 by 21 (2688 = 21 * 2^7),
    one more bit dropped where it has 25, rounded up where the remainder is over one half (never
    exactly one half). The same computation as `composer_jax.quant.formats.nvfp4_second_scale`."""
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    e = (bits >> 23) & 0xFF
    n = ((bits & 0x7FFFFF) | 0x800000) << 5
    q, r = jax.lax.div(n, jnp.int32(21)), jax.lax.rem(n, jnp.int32(21))
    wide = q >= 2**24
    num, den = jnp.where(wide, (q & 1) * 21 + r, r), jnp.where(wide, 42, 21)
    q = jnp.where(wide, q >> 1, q) + (2 * num > den).astype(jnp.int32)
    s = jnp.ldexp(q.astype(jnp.float32), e - 162 + wide)
    s = jnp.where((e == 0) | ~(s >= F32_TINY), F32_TINY, s)
    return jnp.where(amax < jnp.inf, jnp.where(amax > 0, s, 1.0), jnp.nan)


def _rne(t: jax.Array) -> jax.Array:
    """Round half to even with floor only."""
    r = jnp.floor(t + 0.5)
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return jnp.where((r - t == 0.5) & odd, r - 1.0, r)


def _e2m1_codes(v: jax.Array) -> jax.Array:
    """float32 values -> uint8 4-bit E2M1 codes, round to nearest even, saturating."""
    a = jnp.abs(v)
    q = jnp.where(a < 2.0, _rne(a * 2.0) * 0.5, jnp.where(a < 4.0, _rne(a), _rne(a * 0.5) * 2.0))
    q = jnp.minimum(q, E2M1_MAX)
    idx = jnp.where(q <= 2.0, q * 2.0, jnp.where(q == 3.0, 5.0, jnp.where(q == 4.0, 6.0, 7.0))).astype(jnp.int32)
    neg = jax.lax.bitcast_convert_type(v, jnp.int32) < 0  # the sign bit, -0.0 included
    return jnp.where(neg, idx | 8, idx)


def _quantize_halves(even, odd, s2):
    """even/odd: float32 [rows, 8] (the two halves of one 16-element block per row), s2 [rows]
    -> (packed uint8 [rows, 8], E4M3 block scale [rows])."""
    mag = lambda a: jnp.max(jnp.where(a == a, jnp.abs(a), jnp.inf), axis=1)
    amax = jnp.maximum(mag(even), mag(odd))
    t = amax / (E2M1_MAX * s2)
    t = jnp.where((amax > 0) & (t < E4M3_SMALLEST), E4M3_SMALLEST, t)
    sb = jnp.minimum(t, E4M3_MAX).astype(jnp.float8_e4m3fn)
    scale = (sb.astype(jnp.float32) * s2)[:, None]
    pos = scale > 0  # False for 0 and NaN
    div = lambda a: jnp.where(pos, a / jnp.where(pos, scale, 1.0), 0.0)
    packed = _e2m1_codes(div(even)) | (_e2m1_codes(div(odd)) << 4)
    return packed.astype(jnp.uint8), sb


def nvfp4_quantize_ref(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The jnp reference twin of `nvfp4_quantize`."""
    m, k = x.shape
    xf = x.astype(jnp.float32)
    s2 = second_scale(xf)
    blocks = rearrange(xf, "m (kb blk) -> (m kb) blk", blk=BLOCK)  # one row per 16-element block
    packed, sb = _quantize_halves(blocks[:, 0::2], blocks[:, 1::2], repeat(s2, "m 1 -> (m kb)", kb=k // BLOCK))
    return rearrange(packed, "(m kb) byte -> m (kb byte)", m=m), rearrange(sb, "(m kb) -> m kb", m=m), s2


def _kernel(even_ref, odd_ref, s2_ref, packed_ref, sb_ref):
    packed, sb = _quantize_halves(
        even_ref[...].astype(jnp.float32), odd_ref[...].astype(jnp.float32), s2_ref[...].astype(jnp.float32)
    )
    packed_ref[...] = packed
    sb_ref[...] = sb


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def nvfp4_quantize(
    x: jax.Array, s2: jax.Array | None = None, tile: int = 64, interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Pallas kernel: x [M, K], M a multiple of `tile` (a power of two), K of 16 -> as
    `nvfp4_quantize_ref`. Grid: (M / tile, K / 16), one 16-element block per row and step.

    s2: float32 [M, 1] second-level scales to use instead of the per-token ones (e.g. one per
    expert matrix, repeated over its rows: `second_scale` of the whole matrix); returned as given."""
    m, k = x.shape
    if k % BLOCK or m % tile:
        raise ValueError(f"x {x.shape}: K must be a multiple of {BLOCK}, M of tile={tile}")
    s2 = second_scale(x) if s2 is None else s2.astype(jnp.float32).reshape(m, 1)
    half = pl.BlockSpec((tile, BLOCK // 2), lambda i, j: (i, j))
    per_row = pl.BlockSpec((tile, None), lambda i, j: (i, j))
    packed, sb = pl.pallas_call(
        _kernel,
        grid=(m // tile, k // BLOCK),
        in_specs=[half, half, pl.BlockSpec((tile, None), lambda i, j: (i, 0))],
        out_specs=[half, per_row],
        out_shape=[
            out_struct((m, k // 2), jnp.uint8, x, s2),
            out_struct((m, k // BLOCK), jnp.float8_e4m3fn, x, s2),
        ],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(x[:, 0::2], x[:, 1::2], s2)
    return packed, sb, s2
