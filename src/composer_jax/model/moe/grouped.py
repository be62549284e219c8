"""Routed SwiGLU over (token, expert) assignments: the grouped matmul implementations a dispatch
runs (`model.moe_impl`), all dropless.

The T*K assignments are sorted by expert and multiplied by their expert's weights:
  - "ragged": `jax.lax.ragged_dot` (a real grouped GEMM on GPU);
  - "tiled":  each expert's rows padded to a multiple of a tile and run as one batched einsum over
              tiles with per-tile gathered weights. On XLA:CPU ragged_dot lowers to a masked dense
              dot doing G x the FLOPs (measured: docs/architecture.md, "MoE dispatch is dropless
              and sorted"; bench/moe_layer.py), tiling wastes at most G*(tile-1) rows;
              `tiled_dispatch_swiglu` is the same scheme straight from the tokens, moving rows by
              gathers only;
  - "dense":  every expert on every row, then select (reference for tests; G x the FLOPs);
  - gathered: each assignment through its own expert's gathered weights (`gathered_swiglu`), for
              blocks with fewer assignments than experts.
Precision (`model.moe_precision`): "bf16" multiplies in the compute dtype; "mxfp8" and
"nvfp4_fwd_mxfp8_bwd" run the tiled and ragged grouped matmuls through `quant.grouped_matmul`, on
the backend `model.moe_quant_backend` (xla reference or pallas kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange, repeat

from composer_jax.config import ModelConfig
from composer_jax.model.moe.dispatch import grouped_impl, on_accelerator
from composer_jax.quant.grouped_matmul import ragged_matmul, tile_matmul
from composer_jax.quant.recipe import Recipe, as_recipe, recipe
from composer_jax.sharding import vary_like


def moe_recipe(cfg: ModelConfig) -> str | Recipe:
    """The expert matmuls' precision: "bf16" (no quantisation), else the `quant` recipe named by
    `model.moe_precision` on the backend `model.moe_quant_backend`."""
    if cfg.moe_precision == "bf16":
        return "bf16"
    return recipe(cfg.moe_precision, backend=cfg.moe_quant_backend)


def _tile_size(rows: int, groups: int, max_tile: int) -> int:
    avg = max(1, -(-rows // groups))
    return int(max(8, min(max_tile, 1 << (avg - 1).bit_length())))


def _tile_layout(sizes: jax.Array, m: int, num_tiles: int):
    """Every group padded to a multiple of m rows, groups in order: -> (padded start row of each
    group, group of each of the num_tiles tiles; trailing all-padding tiles get the last group)."""
    padded = ((sizes + m - 1) // m) * m
    padded_ends = jnp.cumsum(padded)
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * m, side="right"), sizes.shape[0] - 1)
    return padded_ends - padded, tile_group


def _tiles_swiglu(
    xp: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, precision: str | Recipe = "bf16"
) -> jax.Array:
    """xp: [tiles, m, embed]; per-tile weights [tiles, embed, f] / [tiles, f, embed] -> [tiles, m, embed]."""
    if precision != "bf16":
        mm = functools.partial(tile_matmul, r=as_recipe(precision))
        return mm(jax.nn.silu(mm(xp, gate)) * mm(xp, up), down)
    h = jax.nn.silu(jnp.einsum("tmd,tdf->tmf", xp, gate)) * jnp.einsum("tmd,tdf->tmf", xp, up)
    return jnp.einsum("tmf,tfd->tmd", h, down)


def _grouped_tiled(
    x: jax.Array, sizes: jax.Array, ws: tuple[jax.Array, ...], tile: int, precision: str | Recipe = "bf16"
) -> jax.Array:
    n, d = x.shape
    g = ws[0].shape[0]
    m = _tile_size(n, g, tile)
    num_tiles = -(-n // m) + g  # static bound: each group wastes < one tile
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded_starts, tile_group = _tile_layout(sizes, m, num_tiles)
    row = jnp.arange(n, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, row, side="right")  # == g for rows past the valid ones
    valid = row_group < g
    rg = jnp.minimum(row_group, g - 1)
    dest = jnp.where(valid, padded_starts[rg] + row - starts[rg], num_tiles * m)
    xp = jnp.zeros((num_tiles * m, d), x.dtype).at[dest].set(x, mode="drop")
    gate, up, down = (w[tile_group].astype(x.dtype) for w in ws)
    y = _tiles_swiglu(rearrange(xp, "(tile m) d -> tile m d", m=m), gate, up, down, precision)
    y = rearrange(y, "tile m d -> (tile m) d")
    return jnp.where(valid[:, None], y.at[dest].get(mode="fill", fill_value=0), 0).astype(x.dtype)


# --------------------------------------------------------------------------------------------------
# Tiled dispatch straight from the tokens, with gathers only (no scatters in either direction)
# --------------------------------------------------------------------------------------------------


@jax.custom_vjp
def _copy_rows(x: jax.Array, idx: jax.Array, inv: jax.Array) -> jax.Array:
    """y[r] = x[idx[r]] (0 where idx[r] is out of range). inv: int[x_rows, m] lists the rows of y
    that copy each row of x (out of range = none), so the backward is a gather and a sum instead
    of a scatter-add: d x[t] = sum_j d y[inv[t, j]]."""
    return _gather_or_zero(x, idx)


def _gather_or_zero(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] with out-of-range rows 0, as an in-bounds gather from x plus one zero row (a "fill"
    gather adds a select over the whole output on XLA:CPU)."""
    n = x.shape[0]
    x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])
    return x.at[jnp.clip(idx, 0, n)].get(mode="promise_in_bounds")


def _copy_rows_fwd(x, idx, inv):
    return _copy_rows(x, idx, inv), (idx, inv)


def _copy_rows_bwd(res, dy):
    idx, inv = res
    dx = _gather_or_zero(dy, inv).sum(axis=1)
    f0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)
    return dx, f0(idx), f0(inv)


_copy_rows.defvjp(_copy_rows_fwd, _copy_rows_bwd)


@jax.custom_vjp
def _expert_weights_per_tile(w: jax.Array, tile_group: jax.Array) -> jax.Array:
    """w[tile_group]: [groups, ...] -> [tiles, ...]; the backward sums the tiles of each group as
    a one-hot matmul (dense, fast on CPU) rather than a scatter-add."""
    return w[tile_group]


def _ewpt_fwd(w, tile_group):
    return w[tile_group], (tile_group, w.shape[0])


def _ewpt_bwd(res, dt):
    tile_group, groups = res
    onehot = jax.nn.one_hot(tile_group, groups, dtype=dt.dtype)  # [tiles, groups]
    dw = (onehot.T @ dt.reshape(dt.shape[0], -1)).reshape((groups,) + dt.shape[1:])
    return dw, np.zeros(tile_group.shape, jax.dtypes.float0)


_expert_weights_per_tile.defvjp(_ewpt_fwd, _ewpt_bwd)


def tiled_dispatch_swiglu(
    xt: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    tile: int,
    precision: str | Recipe = "bf16",
) -> jax.Array:
    """Routed SwiGLU of every (token, expert) assignment, straight from the tokens.

    xt: [tokens, embed]; experts: int[tokens, k]; gate/up [E, embed, f]; down [E, f, embed] ->
    [tokens, k, embed] (assignment j of token t in row [t, j]). The assignments are laid out in
    expert order with every expert padded to a multiple of the tile (the "tiled" scheme), but the
    rows move by gathers only: tokens -> padded tiles and tiles -> assignments, and their
    backward passes are gathers too (`_copy_rows`). Equal to `grouped_swiglu(..., "tiled")` on the
    sorted rows."""
    n, d = xt.shape
    k = experts.shape[1]
    g = gate.shape[0]
    a = n * k
    m = _tile_size(a, g, tile)
    num_tiles = -(-a // m) + g  # static bound: each expert wastes < one tile
    rows = num_tiles * m
    flat_e = rearrange(experts, "n k -> (n k)").astype(jnp.int32)  # assignment n*k + j: token n's j-th
    sizes = jnp.zeros((g,), jnp.int32).at[flat_e].add(1)
    padded_starts, tile_group = _tile_layout(sizes, m, num_tiles)
    starts = jnp.cumsum(sizes) - sizes
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    rank = jnp.arange(a, dtype=jnp.int32) - starts[sorted_e]
    dest = jnp.zeros((a,), jnp.int32).at[order].set(padded_starts[sorted_e] + rank)  # padded row of each assignment
    row_assign = jnp.full((rows,), a, jnp.int32).at[dest].set(jnp.arange(a, dtype=jnp.int32))  # a = padding
    xp = _copy_rows(vary_like(xt, row_assign), row_assign // k, rearrange(dest, "(n k) -> n k", k=k))  # padding: zeros
    per_tile = lambda w: _expert_weights_per_tile(vary_like(w, tile_group), tile_group).astype(xt.dtype)
    tiles = rearrange(xp, "(tile m) d -> tile m d", m=m)
    y = _tiles_swiglu(tiles, per_tile(gate), per_tile(up), per_tile(down), precision)
    y = rearrange(y, "tile m d -> (tile m) d")
    return rearrange(_copy_rows(vary_like(y, dest), dest, row_assign[:, None]), "(n k) d -> n k d", k=k)


def _grouped_ragged(
    x: jax.Array, sizes: jax.Array, ws: tuple[jax.Array, ...], precision: str | Recipe = "bf16"
) -> jax.Array:
    gate, up, down = (w.astype(x.dtype) for w in ws)
    sizes = sizes.astype(jnp.int32)
    if precision == "bf16":
        mm = functools.partial(jax.lax.ragged_dot, group_sizes=sizes)
    else:
        mm = functools.partial(ragged_matmul, sizes=sizes, r=as_recipe(precision))
    h = jax.nn.silu(mm(x, gate)) * mm(x, up)
    y = mm(h, down)
    valid = jnp.arange(x.shape[0]) < sizes.sum()
    return jnp.where(valid[:, None], y, 0)


def _grouped_dense(x: jax.Array, sizes: jax.Array, ws: tuple[jax.Array, ...]) -> jax.Array:
    gate, up, down = (w.astype(x.dtype) for w in ws)
    g = gate.shape[0]
    row_group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right")
    onehot = jax.nn.one_hot(row_group, g, dtype=x.dtype)  # all-zero rows past the valid ones
    h = jax.nn.silu(jnp.einsum("nd,gdf->ngf", x, gate)) * jnp.einsum("nd,gdf->ngf", x, up)
    y = jnp.einsum("ngf,gfd->ngd", h, down)
    return jnp.einsum("ngd,ng->nd", y, onehot)


def grouped_swiglu(
    x: jax.Array,
    sizes: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    impl: str,
    tile: int = 128,
    precision: str | Recipe = "bf16",
) -> jax.Array:
    """x: [rows, embed] sorted by group; sizes: int[groups] (sum <= rows; rows past the sum give 0);
    gate/up: [groups, embed, f]; down: [groups, f, embed] -> [rows, embed]. `precision`: a
    `quant.grouped_matmul` recipe name ("bf16" = no quantisation; "dense" accepts only that)."""
    impl = grouped_impl(impl, on_accelerator())
    ws = (gate, up, down)
    if impl == "tiled":
        return _grouped_tiled(x, sizes, ws, tile, precision)
    if impl == "ragged":
        return _grouped_ragged(x, sizes, ws, precision)
    if impl == "dense":
        if precision != "bf16":
            raise ValueError(f"moe_impl='dense' (the reference) runs only moe_precision='bf16', got {precision!r}")
        return _grouped_dense(x, sizes, ws)
    raise ValueError(f"moe_impl={impl!r} is not accepted; accepted: auto, tiled, ragged, dense")


def gathered_swiglu(xt: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Each assignment through its own expert's weights, gathered: xt [t, d], experts int32[t, k]
    -> [t, k, d]. Reads t*k experts' weights, which is less than a grouped matmul's all-experts read
    when t*k < experts (small training blocks)."""
    dt = xt.dtype
    k = experts.shape[1]
    e = rearrange(experts, "t k -> (t k)")
    x = repeat(xt, "t d -> (t k) d", k=k)
    h = jax.nn.silu(jnp.einsum("ad,adf->af", x, gate[e].astype(dt))) * jnp.einsum("ad,adf->af", x, up[e].astype(dt))
    return rearrange(jnp.einsum("af,afd->ad", h, down[e].astype(dt)), "(t k) d -> t k d", k=k)
