"""Block-scaled low-precision formats in plain jnp: MXFP8 (E4M3 / E5M2), MXFP4 and NVFP4.

Reference implementations, exact and deterministic: every step below is a float32 operation whose
result is exact (scaling by powers of two, rounding a value that already lies on a power-of-two
grid) except where noted for NVFP4's float32 scale products.

Element formats (OCP 8-bit floating point v1.0 and OCP MX v1.0 section 5.3):

    name  bias  emin  mantissa bits  max normal  min subnormal  specials
    E4M3    7    -6        3            448         2^-9        NaN only (no Inf)
    E5M2   15   -14        2          57344         2^-16       Inf and NaN
    E2M1    1     0        1              6         0.5         none

Rounding to an element format (`round_to_format`): write |x| = m 2^e with 1 <= m < 2, clamp e below
at emin (subnormals), and round |x| / 2^(e - mbits) to an integer, halves to even (IEEE
round-to-nearest-even); magnitudes beyond the max normal saturate to it (the MX conversion's
saturating mode; Inf and NaN are handled by the block scale, see below). Stochastic rounding
replaces round-half-even by floor(v + u), u ~ U[0, 1): unbiased, E[q] = x, for gradients.

MX (OCP MX v1.0, section 6.3): one E8M0 scale X = 2^s per block of 32 elements along one axis,
x_i ~= X * P_i with P_i in the element format. Two rules for s are in use:
  - "ocp" (the specification's reference conversion): s = floor(log2(amax)) - emax_elem with
    emax_elem = 8 (E4M3), 15 (E5M2), 2 (E2M1). amax / X lies in [2^emax, 2^(emax+1)), so the block
    maximum may exceed the element max (E4M3: 448 < 512) and saturates.
  - "ceil" (Transformer Engine, JAX's `jax.nn` MX recipe): s = ceil(log2(amax / max_elem)), the
    smallest power of two with amax / X <= max_elem: never saturates, at most one bit of range lost.
  s is clamped to the E8M0 range [-127, 127]; an all-zero block gets s = -127 (its elements are 0).
  E8M0 codes are stored as uint8 biased exponents s + 127; code 255 is NaN. A block holding a NaN
  or an Inf gets the NaN scale, and by the specification (section 5.2: "if X is NaN, all V_i are
  NaN") every element of it decodes to NaN.

NVFP4 (NVIDIA's description of the Blackwell format): x = e2m1 * s_block * s_second with one E4M3
scale per 16 elements and a float32 second-level scale. The standard recipe has one s_second per
tensor, s_second = amax(tensor) / (448 * 6), so that s_block = amax(block) / (6 s_second), rounded
to nearest E4M3, stays <= 448. Composer 2 uses one s_second per token (row) instead: the
per-tensor scale makes a token's quantisation depend on every other token of the batch (later ones
included, a causal leak). Here `second="tensor"`, `"token"` (amax over the quantised axis only) or
an explicit tuple of axes over which s_second's amax is taken.

s_second is the correctly rounded float32 quotient amax / 2688 (`nvfp4_second_scale`). A plain
`amax / 2688.0` is not: XLA rewrites a division by a constant, or by any broadcast scalar, into a
multiplication by the rounded reciprocal, 1 ulp off for about a quarter of all amax values. The
quotient is computed in integers instead (2688 = 21 * 2^7: amax's 24-bit significand times 2^5
divided by 21, the remainder deciding the rounding), which no compiler rewrites.

Quantising: s_block = E4M3(amax(block) / (6 s_second)) (the float32 quotient, then rounded to
nearest even E4M3, saturating at 448); e2m1 = round_to_E2M1(x / (s_block * s_second)) (float32
product, then division, both rounded once). A block whose amax is not zero but whose s_block would
round to E4M3 zero (amax(block) / (6 s_second) <= 2^-10) gets the smallest nonzero scale 2^-9
instead, so that its elements above 2^-11 s_second, which that scale keeps, are kept; only an
all-zero block has a zero scale (its elements are 0). A non-finite amax gives a NaN s_second, so
the tensor (or row) decodes to NaN. Dequantising is (e2m1 * s_block) * s_second in float32 (the
first product is exact). Optional 16 x 16 two-dimensional blocks (`block_2d`) for weights, so a
matrix and its transpose quantise to the same values.

Where this departs from torchao 0.18's `nvfp4_quantize` (`torchao.prototype.mx_formats`), by choice:
  - E4M3 subnormal block scales: s_block is the nearest E4M3 value, subnormals (2^-9 .. 7 * 2^-9)
    included, clamped below at 2^-9 only for a nonzero block; torchao clamps every block scale to
    at least E4M3's smallest normal 2^-6, so a small block's elements get a coarser scale there.
  - Inf or NaN in the amax of a second-level scale (the tensor, or the row with second="token"):
    s_second is NaN and every element under it decodes to NaN (as MX's NaN scale, OCP MX v1.0
    section 5.2); torchao's scale from an Inf amax is Inf, its block scales clamp to 2^-6 and its
    finite elements divide by an Inf scale to 0 (the Inf itself to NaN).
  - The block scale and the elements are float32 divisions by a value broadcast over the block
    (6 s_second; s_block * s_second), which XLA computes as a multiplication by the divisor's
    rounded reciprocal (1 ulp off the quotient for ~25% of operands); torch divides exactly, and
    torchao takes the block scale as (amax / 6) / s_second. Either can move a rounded E4M3 scale
    or E2M1 element by one step only where the exact quotient lies within an ulp or two of a
    rounding midpoint: bench/nvfp4_torchao.py finds 1 block scale of 51,200 (and the 13 of its
    block's 16 values) differing from torchao on 200 random tensors, every second-level scale and
    every other value equal.
  - float32 subnormals: XLA:CPU flushes them to zero (inputs and results), torch on CPU does not.
    So an input element below 2^-126 counts as 0, a product s_block * s_second below 2^-126
    flushes to 0 and its block decodes to 0, and s_second, whose exact value lies below 2^-126
    where amax < 2688 * 2^-126 (about 3.2e-35), is clamped to 2^-126 instead of flushing to 0
    (which would zero the row): with it every block scale amax(block) / (6 * 2^-126) is below
    448, so the row stays representable.

FP4 packing: two E2M1 codes per byte along the (padded) quantised axis, element 2i in the low
nibble and 2i+1 in the high nibble; a code is sign << 3 | index of |x| in (0, .5, 1, 1.5, 2, 3, 4, 6).

`QuantArray` holds codes + scales + format as a pytree: the quantised axis is moved last and zero
padded to a whole number of blocks (zeros do not change any block's amax), and `dequantize` undoes
both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange, repeat


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    name: str
    mbits: int  # mantissa (fraction) bits
    emin: int  # exponent of the smallest normal
    emax: int  # exponent of the largest normal (OCP MX emax_elem)
    max: float  # largest finite magnitude
    dtype: object  # the jnp dtype holding one element (E2M1 as codes in packed form)


E4M3 = ElementFormat("e4m3", 3, -6, 8, 448.0, jnp.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", 2, -14, 15, 57344.0, jnp.float8_e5m2)
E2M1 = ElementFormat("e2m1", 1, 0, 2, 6.0, jnp.float4_e2m1fn)
ELEMENTS = {f.name: f for f in (E4M3, E5M2, E2M1)}

MX_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_BIAS = 127
E8M0_NAN = 255
ScaleRule = Literal["ocp", "ceil"]

# format name -> (element format, block size)
FORMATS = {
    "mxfp8_e4m3": (E4M3, MX_BLOCK),
    "mxfp8_e5m2": (E5M2, MX_BLOCK),
    "mxfp4": (E2M1, MX_BLOCK),
    "nvfp4": (E2M1, 16),
}
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _element(fmt: ElementFormat | str) -> ElementFormat:
    return ELEMENTS[fmt] if isinstance(fmt, str) else fmt


def _floor_log2(a: jax.Array) -> jax.Array:
    """floor(log2(a)) exactly for finite a > 0 (frexp: a = m 2^e, 0.5 <= m < 1)."""
    return jnp.frexp(a)[1] - 1


@functools.partial(jax.jit, static_argnames=("fmt", "saturate"))
def round_to_format(
    x: jax.Array, fmt: ElementFormat | str, key: jax.Array | None = None, saturate: bool = True
) -> jax.Array:
    """x (float32) rounded to the nearest value of the element format, ties to even, as float32;
    with `key`, stochastic rounding instead. Beyond the max normal: saturated (or left as is with
    saturate=False, for callers that clip themselves). NaN stays NaN; +-Inf saturates."""
    f = _element(fmt)
    x = x.astype(jnp.float32)
    ax = jnp.abs(x)
    finite = jnp.isfinite(ax)
    safe = jnp.where(finite & (ax > 0), ax, 1.0)
    e = jnp.maximum(_floor_log2(safe), f.emin)
    v = jnp.ldexp(ax, f.mbits - e)  # |x| on the grid of integers: exact (power-of-two scaling)
    if key is None:
        q = jnp.round(v)  # half to even
    else:
        q = jnp.floor(v + jax.random.uniform(key, x.shape, jnp.float32))
    out = jnp.ldexp(q, e - f.mbits)
    if saturate:
        out = jnp.minimum(jnp.where(finite, out, f.max), f.max)
    out = jnp.where(jnp.isnan(x), jnp.nan, jnp.copysign(out, x))
    return out


def _amax(x: jax.Array, axis, keepdims: bool = False) -> jax.Array:
    """max |x| with NaN counted as Inf (XLA:CPU's vectorised max reduction may drop a NaN)."""
    return jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)), axis=axis, keepdims=keepdims)


def mx_scale_exponent(amax: jax.Array, fmt: ElementFormat | str, rule: ScaleRule = "ocp") -> jax.Array:
    """The block's shared exponent s (X = 2^s) as int32, clamped to [-127, 127]; amax == 0 -> -127.
    (The caller marks non-finite blocks NaN.)"""
    f = _element(fmt)
    safe = jnp.where(jnp.isfinite(amax) & (amax > 0), amax, 1.0).astype(jnp.float32)
    if rule == "ocp":
        s = _floor_log2(safe) - f.emax
    elif rule == "ceil":
        # smallest s with max_elem * 2^s >= amax: s is floor(log2 amax) - floor(log2 max) or one more
        s0 = _floor_log2(safe) - int(np.floor(np.log2(f.max)))
        s = jnp.where(jnp.ldexp(jnp.float32(f.max), s0) >= safe, s0, s0 + 1)
    else:
        raise ValueError(f"MX scale rule {rule!r} is not accepted; accepted: ocp, ceil")
    s = jnp.where(amax > 0, s, -E8M0_BIAS)
    return jnp.clip(s, -E8M0_BIAS, E8M0_BIAS).astype(jnp.int32)


def e8m0_decode(code: jax.Array) -> jax.Array:
    """uint8 E8M0 codes -> float32 2^(code - 127), NaN for 255."""
    c = code.astype(jnp.int32)
    return jnp.where(c == E8M0_NAN, jnp.nan, jnp.ldexp(jnp.float32(1.0), c - E8M0_BIAS))


# --------------------------------------------------------------------------------------------------
# FP4 codes and packing
# --------------------------------------------------------------------------------------------------


def e2m1_to_codes(v: jax.Array) -> jax.Array:
    """E2M1 values (float32, already representable) -> uint8 4-bit codes sign<<3 | magnitude index."""
    mag = jnp.abs(v)
    idx = (mag[..., None] >= jnp.asarray(_E2M1_VALUES[1:])).sum(-1).astype(jnp.uint8)
    return jnp.where(jnp.signbit(v), idx | 8, idx).astype(jnp.uint8)


def codes_to_e2m1(c: jax.Array) -> jax.Array:
    """uint8 4-bit codes -> float32 E2M1 values (code 8 is -0.0)."""
    mag = jnp.asarray(_E2M1_VALUES)[(c & 7).astype(jnp.int32)]
    return jnp.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: jax.Array) -> jax.Array:
    """uint8 4-bit codes [..., 2n] -> bytes [..., n]: element 2i in the low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {codes.shape}")
    pairs = rearrange(codes.astype(jnp.uint8), "... (n nibble) -> ... n nibble", nibble=2)
    return (pairs[..., 0] & 15) | ((pairs[..., 1] & 15) << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """bytes [..., n] -> uint8 4-bit codes [..., 2n] (inverse of `pack_fp4`)."""
    lo, hi = packed & 15, packed >> 4
    return rearrange(jnp.stack([lo, hi], axis=-1), "... n nibble -> ... (n nibble)")


# --------------------------------------------------------------------------------------------------
# The pytree
# --------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantArray:
    """A block-quantised array: `data` (elements: float8 arrays, or uint8 bytes holding two E2M1
    codes each), `scales` (uint8 E8M0 codes for MX, float8_e4m3fn for NVFP4) and, for NVFP4, the
    float32 `second` scale (broadcastable to the blocked layout). Static: the format name, the
    quantised axis of the original array, its shape, and whether blocks are 16 x 16 (`block_2d`).

    Layout: the quantised axis moved last and zero-padded to whole blocks ([..., nb * block]);
    scales [..., nb] (2-D blocks: the axis before it is padded to 16 too and scales are
    [..., rows / 16, nb])."""

    data: jax.Array
    scales: jax.Array
    second: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    block_2d: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def element(self) -> ElementFormat:
        return FORMATS[self.fmt][0]

    @property
    def block(self) -> int:
        return FORMATS[self.fmt][1]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self).astype(dtype)


# the blocked layout's last axis as (block nb, element of the block blk), and back
_SPLIT_BLOCKS = "... (nb blk) -> ... nb blk"
_JOIN_BLOCKS = "... nb blk -> ... (nb blk)"
# 2-D NVFP4 blocks: the rows axis too as (row block rb, row of the block blk)
_ROW_BLOCKS = "... (rb blk) nb -> ... rb blk nb"
_ROWS_OF_BLOCKS = "... rb nb -> ... (rb blk) nb"


def _to_blocks(x: jax.Array, axis: int, block: int, pad_rows: int = 0) -> tuple[jax.Array, int]:
    """Move `axis` last, zero-pad it to a multiple of `block` (and the axis before it to a
    multiple of pad_rows), -> (array [..., n_padded], normalised axis)."""
    axis = axis % x.ndim
    x = jnp.moveaxis(x, axis, -1)
    pad = [(0, 0)] * x.ndim
    pad[-1] = (0, -x.shape[-1] % block)
    if pad_rows:
        pad[-2] = (0, -x.shape[-2] % pad_rows)
    return jnp.pad(x, pad), axis


def _from_blocks(y: jax.Array, axis: int, shape: tuple[int, ...]) -> jax.Array:
    moved = tuple(np.delete(np.array(shape), axis)) + (shape[axis],)
    y = y[tuple(slice(0, n) for n in moved)]
    return jnp.moveaxis(y, -1, axis)


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "rule"))
def mx_quantize(
    x: jax.Array,
    fmt: str = "mxfp8_e4m3",
    axis: int = -1,
    rule: ScaleRule = "ocp",
    key: jax.Array | None = None,
) -> QuantArray:
    """MX quantisation along `axis`: fmt mxfp8_e4m3 | mxfp8_e5m2 | mxfp4; rule "ocp" | "ceil";
    `key` for stochastic rounding of the elements."""
    elem, block = FORMATS[fmt]
    if fmt == "nvfp4":
        raise ValueError("use nvfp4_quantize for NVFP4")
    shape = tuple(x.shape)
    xb, axis = _to_blocks(x.astype(jnp.float32), axis, block)
    blocks = rearrange(xb, _SPLIT_BLOCKS, blk=block)
    amax = _amax(blocks, -1)
    s = mx_scale_exponent(amax, elem, rule)
    v = round_to_format(jnp.ldexp(blocks, -s[..., None]), elem, key)
    code = jnp.where(jnp.isfinite(amax), s + E8M0_BIAS, E8M0_NAN).astype(jnp.uint8)
    v = rearrange(v, _JOIN_BLOCKS)
    data = pack_fp4(e2m1_to_codes(v)) if elem is E2M1 else v.astype(elem.dtype)
    return QuantArray(data, code, None, fmt, axis, shape)


# s_second's divisor 448 * 6 = 2688 = NVFP4_DIVISOR_ODD * 2^NVFP4_DIVISOR_SHIFT
NVFP4_DIVISOR_ODD = 21
NVFP4_DIVISOR_SHIFT = 7
F32_TINY = 2.0**-126  # float32's smallest normal
E4M3_SMALLEST = 2.0**-9  # E4M3's smallest subnormal: the least nonzero block scale


def nvfp4_second_scale(amax: jax.Array) -> jax.Array:
    """float32 amax / (448 * 6), correctly rounded (to nearest, ties to even) for amax >= 2^-126;
    2^-126 where the quotient would be below it (see the module docstring); 1 where amax == 0;
    NaN where amax is not finite.

    Integer arithmetic, so that no compiler can turn the division into a multiplication by a rounded
    reciprocal: amax = m 2^(e - 150) with the 24-bit significand m, and amax / (21 * 2^7) = n / 21 *
    2^(e - 162) with n = 32 m < 2^29. n / 21 = q + r / 21 has 24 or 25 integer bits; with 25 the last
    is dropped into the remainder (then over 42). The dropped fraction rounds q up when above one half;
    it is never exactly one half (that needs r = 0 and an odd q, but then n = 21 q would be odd)."""
    amax = amax.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    e = (bits >> 23) & 0xFF
    n = ((bits & 0x7FFFFF) | 0x800000) << 5
    d = NVFP4_DIVISOR_ODD
    q, r = jax.lax.div(n, jnp.int32(d)), jax.lax.rem(n, jnp.int32(d))
    wide = q >= 2**24
    num = jnp.where(wide, (q & 1) * d + r, r)  # the dropped fraction is num / den
    den = jnp.where(wide, 2 * d, d)
    q = jnp.where(wide, q >> 1, q)
    up = (2 * num > den).astype(jnp.int32)
    s = jnp.ldexp((q + up).astype(jnp.float32), e - 150 - 5 - NVFP4_DIVISOR_SHIFT + wide)
    s = jnp.where((e == 0) | ~(s >= F32_TINY), F32_TINY, s)  # subnormal amax or quotient: clamped
    return jnp.where(jnp.isfinite(amax), jnp.where(amax > 0, s, 1.0), jnp.nan)


def _second_scale(x: jax.Array, second, axis: int) -> jax.Array:
    """float32 s_second = amax / (448 * 6) over the chosen axes (keepdims), `nvfp4_second_scale`."""
    if second == "tensor":
        axes = tuple(range(x.ndim))
    elif second == "token":
        axes = (axis % x.ndim,)
    else:
        axes = tuple(a % x.ndim for a in second)
    return nvfp4_second_scale(_amax(x, axes, keepdims=True))


def nvfp4_block_scale(amax: jax.Array, s2: jax.Array) -> jax.Array:
    """float32 E4M3 block scales: amax / (6 s_second) rounded to nearest even E4M3 (saturating at
    448), at least 2^-9 for a nonzero block (0 for an all-zero one, NaN where s_second is NaN)."""
    t = amax / (E2M1.max * s2)
    t = jnp.where((amax > 0) & (t < E4M3_SMALLEST), E4M3_SMALLEST, t)
    return round_to_format(t, E4M3)


@functools.partial(jax.jit, static_argnames=("axis", "second", "block_2d"))
def nvfp4_quantize(
    x: jax.Array,
    axis: int = -1,
    second: Literal["tensor", "token"] | tuple[int, ...] = "tensor",
    block_2d: bool = False,
    key: jax.Array | None = None,
) -> QuantArray:
    """NVFP4 along `axis`: E2M1 elements, an E4M3 scale per 16 (or 16 x 16 with block_2d, the
    axis before `axis` in the moved layout being the other), and a float32 second-level scale per
    tensor, per token (row) or over the given axes."""
    if block_2d and (x.ndim < 2 or second == "token"):
        raise ValueError("2-D NVFP4 blocks need a matrix and a second-level scale not per token")
    shape = tuple(x.shape)
    x = x.astype(jnp.float32)
    s2 = jnp.moveaxis(_second_scale(x, second, axis), axis % x.ndim, -1)  # [..., 1 or n]
    b = NVFP4_BLOCK
    xb, axis = _to_blocks(x, axis, b, pad_rows=b if block_2d else 0)
    blocks = rearrange(xb, _SPLIT_BLOCKS, blk=b)  # [..., rows, nb, 16]
    amax = _amax(blocks, -1)  # [..., rows, nb]
    if block_2d:
        amax = rearrange(amax, _ROW_BLOCKS, blk=b).max(axis=-2)  # [..., rows/16, nb]
    if s2.shape[-1] != 1:
        raise ValueError(f"the second-level scale's axes {second} must include the quantised axis {axis}")
    if block_2d and s2.shape[-2] != 1:
        raise ValueError("2-D NVFP4 blocks need a second-level scale constant along the rows")
    sb = nvfp4_block_scale(amax, s2)  # [..., nb] or [..., rows / 16, nb]
    sb_full = repeat(sb, _ROWS_OF_BLOCKS, blk=b) if block_2d else sb  # [..., rows, nb]
    scale = sb_full[..., None] * s2[..., None]  # float32 product, rounded once
    v = round_to_format(jnp.where(scale > 0, blocks / jnp.where(scale > 0, scale, 1.0), 0.0), E2M1, key)
    v = rearrange(jnp.where(jnp.isnan(scale), jnp.nan, v), _JOIN_BLOCKS)
    data = pack_fp4(e2m1_to_codes(jnp.nan_to_num(v)))
    return QuantArray(data, sb.astype(jnp.float8_e4m3fn), s2, "nvfp4", axis, shape, block_2d)


@jax.jit
def dequantize(q: QuantArray) -> jax.Array:
    """The float32 values the codes stand for, in the original layout and shape."""
    elem, block = FORMATS[q.fmt]
    if elem is E2M1:
        v = codes_to_e2m1(unpack_fp4(q.data))
    else:
        v = q.data.astype(jnp.float32)
    blocks = rearrange(v, _SPLIT_BLOCKS, blk=block)
    if q.fmt == "nvfp4":
        sb = q.scales.astype(jnp.float32)
        s2 = q.second if q.second is not None else jnp.float32(1.0)
        if q.block_2d:
            sb = repeat(sb, _ROWS_OF_BLOCKS, blk=NVFP4_BLOCK)
        out = (blocks * sb[..., None]) * s2[..., None]
    else:
        out = blocks * e8m0_decode(q.scales)[..., None]
    return _from_blocks(rearrange(out, _JOIN_BLOCKS), q.axis, q.shape)


def quantize(x: jax.Array, fmt: str, axis: int = -1, **kw) -> QuantArray:
    """`mx_quantize` or `nvfp4_quantize` by format name."""
    if fmt == "nvfp4":
        return nvfp4_quantize(x, axis, **kw)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not accepted; accepted: {', '.join(FORMATS)}")
    return mx_quantize(x, fmt, axis, **kw)


def fake_quantize(x: jax.Array, fmt: str, axis: int = -1, **kw) -> jax.Array:
    """dequantize(quantize(x)) as float32: the values a block-scaled matmul multiplies."""
    return dequantize(quantize(x, fmt, axis, **kw))
