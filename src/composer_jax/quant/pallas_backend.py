"""The "pallas" backend of the quantised grouped matmuls: quantisation and the three products of
forward and backward run as `pallas_kernels` (Triton on a GPU; `interpret=True` on CPU, where the
Pallas interpreter runs the same kernel bodies as ordinary XLA code).

Each function takes the high-precision operands in the layouts `grouped_matmul.py` uses (rows
sorted by group, run-time group sizes) and returns float32. Operands are zero-padded to the
kernels' multiples (32 along every quantised or tiled axis; zeros change no block's amax and add
nothing to a product), so the values are the XLA reference backend's: quantisation bit for bit (MX
blocks and NVFP4 blocks are the same, the group-padded wgrad layout restarts MX blocks at every
group boundary exactly as `mx_fake_quantize_grouped_rows` does), products up to the order of
float32 sums.

  forward  y  [rows, N] = Q_f(x along K) . Q_f(w along K)        grouped_matmul_mxfp8 / _nvfp4
  dgrad    dx [rows, K] = Q_b(dy along N) . Q_b(w along N)^T      grouped_matmul_mxfp8_dgrad
  wgrad    dw [G, K, N] = Q_b(x along rows)^T . Q_b(dy along rows)  grouped_matmul_mxfp8_wgrad
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from einops import rearrange, repeat

from pallas_kernels import grouped_matmul as gm
from pallas_kernels import grouped_matmul_bwd as gm_bwd
from pallas_kernels import mx_quant, nvfp4_quant

if TYPE_CHECKING:
    from composer_jax.quant.recipe import Recipe

ALIGN = 32  # every padded axis: MX block, two NVFP4 blocks, the smallest tile


def rows_tile() -> int:
    """Rows per grouped-matmul tile: 64 on a GPU (Hopper wgmma's M), 32 in the interpreter."""
    return 32 if interpret_mode() else 64


def interpret_mode() -> bool:
    """Pallas kernels compile only for GPUs here; elsewhere they run in the interpreter."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def _check_runnable(*arrays: jax.Array) -> None:
    """The Pallas interpreter (jax 0.10.2) cannot run a kernel on values that vary over the manual
    axes of a `shard_map` with check_vma (the MoE layer's, whenever there is a mesh): it evaluates
    the kernel's untyped body on typed values and fails on the first constant. Compiled for a GPU
    the same call lowers (tested); in the interpreter say so instead of failing inside JAX."""
    varying: set = set()
    for a in arrays:
        mat = getattr(jax.typeof(a), "mat", None)
        varying |= set(mat.varying) if mat is not None else set()
    if varying and interpret_mode():
        raise NotImplementedError(
            f"model.moe_quant_backend='pallas' in interpret mode (backend {jax.default_backend()!r}) cannot run "
            f"inside the MoE layer's shard_map (operands vary over mesh axes {sorted(varying)}); on CPU use "
            "moe_quant_backend='xla' with a mesh, or run without one; on a GPU the kernels compile and run there"
        )


def _pad(a: jax.Array, axis: int, multiple: int = ALIGN) -> jax.Array:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, -a.shape[axis] % multiple)
    return jnp.pad(a, widths)


def _tile(n: int) -> int:
    """Output-column tile for a padded extent n (a multiple of 32)."""
    return 128 if n % 128 == 0 else 64 if n % 64 == 0 else 32


def mx_along_cols(a: jax.Array, rule: str) -> tuple[jax.Array, jax.Array]:
    """MXFP8 E4M3 of a [M, C] matrix in blocks along C: -> (e4m3 [M', C'], uint8 [M', C'/32]),
    M and C zero-padded to multiples of 32."""
    a = _pad(_pad(a, 0), 1)
    return mx_quant.mxfp8_quantize(a, axis=1, rule=rule, tile=ALIGN, interpret=interpret_mode())


def mx_along_rows(a: jax.Array, rule: str) -> tuple[jax.Array, jax.Array]:
    """MXFP8 E4M3 of a [M, C] matrix in blocks along M: -> (e4m3 [M', C'], uint8 [M'/32, C'])."""
    a = _pad(_pad(a, 0), 1)
    return mx_quant.mxfp8_quantize(a, axis=0, rule=rule, tile=ALIGN, interpret=interpret_mode())


def nvfp4_rows(a: jax.Array, s2: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NVFP4 of a [M, C] matrix in blocks along C, the second-level scale per row (or `s2` [M, 1]
    given): -> (packed uint8 [M', C'/2], e4m3 [M', C'/16], float32 [M', 1])."""
    m = a.shape[0]
    a = _pad(_pad(a, 0), 1)
    if s2 is not None:
        s2 = jnp.pad(s2.reshape(m, 1).astype(jnp.float32), ((0, a.shape[0] - m), (0, 0)), constant_values=1.0)
    return nvfp4_quant.nvfp4_quantize(a, s2, tile=ALIGN, interpret=interpret_mode())


def mx_weight_along_k(w: jax.Array, rule: str) -> tuple[jax.Array, jax.Array]:
    """w [G, K, N] in blocks along K -> (e4m3 [G, K', N'], uint8 [G, K'/32, N'])."""
    g = w.shape[0]
    # the experts' K rows stacked: K is padded to a multiple of 32, so no block spans two experts
    v, s = mx_along_rows(rearrange(_pad(_pad(w, 1), 2), "g k n -> (g k) n"), rule)
    per_expert = lambda a: rearrange(a, "(g rows) n -> g rows n", g=g)
    return per_expert(v), per_expert(s)


def nvfp4_weight_along_k(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w [G, K, N] in blocks along K, one second-level scale per expert matrix -> (packed uint8
    [G, K'/2, N'], e4m3 [G, K'/16, N'], float32 [G])."""
    g = w.shape[0]
    s2 = nvfp4_quant.second_scale(rearrange(w, "g k n -> g (k n)"))  # [G, 1]
    w = _pad(_pad(w, 1), 2)
    n = w.shape[2]
    # each expert's output columns as rows blocked along K (the kernel quantises rows), each row
    # carrying its expert's second-level scale
    packed, sb, _ = nvfp4_rows(rearrange(w, "g k n -> (g n) k"), repeat(s2, "g one -> (g n) one", n=n))
    along_k = lambda a: rearrange(a, "(g n) kb -> g kb n", g=g)
    return along_k(packed), along_k(sb), rearrange(s2, "g one -> (g one)")


def forward(x: jax.Array, w: jax.Array, sizes: jax.Array, r: Recipe) -> jax.Array:
    """x [rows, K] sorted by group, w [G, K, N], sizes int32 [G] -> float32 [rows, N] (rows past
    sum(sizes) 0), both operands quantised along K by the recipe's forward format."""
    _check_runnable(x, w)
    rows, n = x.shape[0], w.shape[2]
    np_ = -(-n // ALIGN) * ALIGN
    tn = _tile(np_)
    if r.fwd == "mxfp8":
        xv, xs = mx_along_cols(x, r.mx_rule)
        wv, ws = mx_weight_along_k(w, r.mx_rule)
        y = gm.grouped_matmul_mxfp8(xv, xs, wv, ws, sizes, tm=rows_tile(), tn=tn, interpret=interpret_mode())
    elif r.fwd == "nvfp4":
        s2 = None
        if r.nvfp4_second == "tensor":
            s2 = jnp.broadcast_to(nvfp4_quant.second_scale(x.reshape(1, -1)), (rows, 1))
        xp, xsb, xs2 = nvfp4_rows(x, s2)
        wp, wsb, ws2 = nvfp4_weight_along_k(w)
        y = gm.grouped_matmul_nvfp4(
            xp, xsb, xs2, wp, wsb, ws2, sizes, tm=rows_tile(), tn=tn, interpret=interpret_mode()
        )
    else:
        raise ValueError(f"the pallas backend has no forward format {r.fwd!r}; accepted: mxfp8, nvfp4")
    return y[:rows, :n]


def dgrad(dy: jax.Array, w: jax.Array, sizes: jax.Array, r: Recipe) -> jax.Array:
    """dy [rows, N], w [G, K, N] -> float32 [rows, K] = dy . w[g]^T per group, MXFP8 along N."""
    _check_runnable(dy, w)
    rows, k = dy.shape[0], w.shape[1]
    g = w.shape[0]
    dyv, dys = mx_along_cols(dy, r.mx_rule)
    wp = _pad(_pad(w, 1), 2)
    kp = wp.shape[1]
    wv, ws = mx_along_cols(rearrange(wp, "g k n -> (g k) n"), r.mx_rule)
    per_expert = lambda a: rearrange(a, "(g k) cols -> g k cols", g=g)
    dx = gm_bwd.grouped_matmul_mxfp8_dgrad(
        dyv,
        dys,
        per_expert(wv),
        per_expert(ws),
        sizes,
        tm=rows_tile(),
        tk=_tile(kp),
        interpret=interpret_mode(),
    )
    return dx[:rows, :k]


def wgrad(x: jax.Array, dy: jax.Array, sizes: jax.Array, r: Recipe) -> jax.Array:
    """x [rows, K], dy [rows, N] sorted by group -> float32 [G, K, N] = x_g^T dy_g, MXFP8 along the
    rows in blocks that restart at every group boundary (the group-padded layout)."""
    _check_runnable(x, dy)
    k, n = x.shape[1], dy.shape[1]
    xv, xs = mx_along_rows(gm_bwd.to_group_padded(_pad(x, 1), sizes), r.mx_rule)
    dv, ds = mx_along_rows(gm_bwd.to_group_padded(_pad(dy, 1), sizes), r.mx_rule)
    dw = gm_bwd.grouped_matmul_mxfp8_wgrad(
        xv, xs, dv, ds, sizes, tk=_tile(xv.shape[1]), tn=_tile(dv.shape[1]), interpret=interpret_mode()
    )
    return dw[:, :k, :n]
