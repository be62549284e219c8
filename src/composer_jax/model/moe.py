"""Mixture of experts: router, dropless dispatch, expert parallelism, router replay, load statistics.

Routing (DeepSeek-V2/V3, Kimi K2, Qwen3-MoE):
  scores = sigmoid(x W_r) or softmax(x W_r)                          (float32)
  selection: greedy top-k; or group-limited: keep the `topk_group` best of `n_group` expert groups
  (V2: group score = max; V3 "noaux_tc": sum of the top-2 of scores + bias), then top-k inside them.
  The score-correction bias is used for selection only; gate weights are the unbiased scores,
  optionally renormalised over the top-k, times routed_scaling_factor.

Dispatch is dropless: the T*K (token, expert) assignments are sorted by expert and multiplied by
their expert's weights with a grouped matmul:
  - "ragged": `jax.lax.ragged_dot` (a real grouped GEMM on GPU);
  - "tiled":  each expert's rows padded to a multiple of a tile and run as one batched einsum over
              tiles with per-tile gathered weights. On XLA:CPU ragged_dot lowers to a masked dense
              dot doing G x the FLOPs (measured: docs/architecture.md, "MoE dispatch is dropless
              and sorted"; bench/moe_layer.py), tiling wastes at most G*(tile-1) rows;
  - "dense":  every expert on every row, then select (reference for tests; G x the FLOPs).
Expert parallelism: inside `jax.shard_map`, assignments are exchanged over the expert mesh axis
(`model/expert_parallel.py`, `model.moe_ep_exchange`): on GPU/TPU by `ragged_all_to_all` of the
real rows into a receive buffer bounded by `model.moe_ep_capacity_factor` (overflow dropped and
counted), on CPU by `all_to_all` of worst-case [ep, T*K] buffers (the reference; never drops);
computed by the local experts, and returned by the inverse exchange.
Precision (`model.moe_precision`): "bf16" multiplies in the compute dtype (the code below exactly as
without quantisation); "mxfp8" and "nvfp4_fwd_mxfp8_bwd" run the tiled and ragged grouped matmuls
(and so expert parallelism, which calls them) through `quant.grouped_matmul`, on the backend
`model.moe_quant_backend` (xla reference or pallas kernels).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange, repeat
from jax.sharding import PartitionSpec as P

from composer_jax.config import ModelConfig
from composer_jax.model import expert_parallel
from composer_jax.model.moe_decode import decode_expert_parallel, decode_strategy, decode_swiglu, whole
from composer_jax.model.params import moe_specs, router_biases, with_router_biases
from composer_jax.quant.grouped_matmul import ragged_matmul, tile_matmul
from composer_jax.quant.recipe import Recipe, as_recipe, recipe
from composer_jax.sharding import MeshRules, vary_like

STATS = ("expert_counts", "seq_balance", "moe_dropped", "moe_a2a_rows")


class Routing(NamedTuple):
    weights: jax.Array  # float32[tokens, k]
    experts: jax.Array  # int32[tokens, k]
    scores: jax.Array  # float32[tokens, experts] (sigmoid or softmax, before selection)


def route(
    router_w: jax.Array, router_bias: jax.Array, x: jax.Array, cfg: ModelConfig, routing: jax.Array | None = None
) -> Routing:
    """x: [tokens, embed] -> Routing. `routing` (int32[tokens, k], recorded experts) replaces the
    selection (router replay): those experts are used, with gate weights from the current router."""
    logits = x.astype(jnp.float32) @ router_w.astype(jnp.float32)
    if cfg.score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    if routing is not None:
        experts = routing.astype(jnp.int32)
    else:
        choice = scores + router_bias.astype(jnp.float32) if cfg.topk_method == "noaux_tc" else scores
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            grouped = rearrange(choice, "t (group e) -> t group e", group=cfg.n_group)
            if cfg.topk_method == "noaux_tc":
                group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
            else:
                group_score = grouped.max(-1)
            _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
            keep = (
                jnp.zeros(group_score.shape, bool).at[jnp.arange(group_score.shape[0])[:, None], top_groups].set(True)
            )
            choice = jnp.where(repeat(keep, "t group -> t (group e)", e=e // cfg.n_group), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return Routing(weights * cfg.routed_scaling_factor, experts, scores)


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """int32[tokens, k] -> float32[num_experts] number of assignments per expert."""
    return jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)


def router_bias_update(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): b_e += u * sign(mean load - load_e).

    bias, counts: float32[..., experts] (a leading layers axis is fine)."""
    mean = counts.mean(-1, keepdims=True)
    return bias + rate * jnp.sign(mean - counts)


def update_router_biases(params: dict, counts: dict[str, jax.Array], rate: float) -> dict:
    """Apply `router_bias_update` to every MoE stack's router bias (main layers and MTP).

    counts: the `expert_counts` / `mtp_expert_counts` of `ModelOutput.aux` summed over the batch,
    float32[layers, experts] each; stacks without counts keep their bias."""
    biases = router_biases(params)
    return with_router_biases(
        params, {k: router_bias_update(b, counts[k], rate) for k, b in biases.items() if k in counts}
    )


# --------------------------------------------------------------------------------------------------
# Grouped SwiGLU over rows sorted by group
# --------------------------------------------------------------------------------------------------


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
    if impl == "auto":
        impl = "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "tiled"
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


# --------------------------------------------------------------------------------------------------
# The MoE layer on one device's tokens (called inside shard_map when there is a mesh)
# --------------------------------------------------------------------------------------------------


def sequence_balance(scores: jax.Array, experts: jax.Array, num_experts: int, seq_axes=(), seq_shards: int = 1):
    """DeepSeek-V3's complementary sequence-wise balance loss, summed over the rows of the block.

    scores: float32[batch, seq, experts]; experts: int32[batch, seq, k]. Per sequence,
    f_i = E / (k S) * #{tokens choosing i}, P_i = mean_t s_it / sum_j s_jt, loss = sum_i f_i P_i
    (1 when balanced and scores uniform). With the sequence split over `seq_axes`, the per-row
    sums are all-reduced first.
    """
    b, s, k = experts.shape
    chosen = jnp.zeros((b, num_experts), jnp.float32).at[jnp.arange(b)[:, None], experts.reshape(b, s * k)].add(1.0)
    p_sum = (scores / scores.sum(-1, keepdims=True)).sum(1)
    if seq_axes:
        chosen, p_sum = jax.lax.psum((chosen, p_sum), seq_axes)
    seq = s * seq_shards
    f = chosen * num_experts / (k * seq)
    return jnp.sum(f * p_sum / seq)


def ep_exchange(cfg: ModelConfig) -> str:
    """The expert-parallel exchange `cfg.moe_ep_exchange` names, "auto" resolved for this backend:
    the ragged all-to-all on GPU/TPU, the padded one on XLA:CPU (which has no ragged-all-to-all)."""
    if cfg.moe_ep_exchange != "auto":
        return cfg.moe_ep_exchange
    return "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "padded"


def _sorted_dispatch(
    xt: jax.Array,
    experts: jax.Array,
    ws: tuple[jax.Array, jax.Array, jax.Array],
    cfg: ModelConfig,
    ep: int,
    ep_axis: str | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Assignments sorted by expert, through `grouped_swiglu` (and exchanged over the expert axis
    when ep > 1, `model/expert_parallel.py`) and back: -> (y [tokens, k, embed], dropped int32[]
    assignments of this device refused by the ragged buffer bound, sent int32[] assignment rows
    this device dispatched to other devices)."""
    n, d = xt.shape
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    a = n * k
    flat_e = rearrange(experts, "n k -> (n k)")
    flat_tok = jnp.arange(a, dtype=jnp.int32) // k
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    xs = xt[flat_tok[order]]

    def compute(rows: jax.Array, sizes: jax.Array) -> jax.Array:
        return grouped_swiglu(rows, sizes, *ws, impl=cfg.moe_impl, tile=cfg.moe_tile_size, precision=moe_recipe(cfg))

    zero = jnp.zeros((), jnp.int32)
    if ep == 1:
        ys, dropped, sent = compute(xs, jnp.zeros((e,), jnp.int32).at[flat_e].add(1)), zero, zero
    else:
        assert ep_axis is not None
        exchange = ep_exchange(cfg)
        if exchange == "padded":
            ys = expert_parallel.padded_exchange(xs, sorted_e, compute, e, ep, ep_axis)
            dropped, sent = zero, jnp.full((), (ep - 1) * a, jnp.int32)
        else:
            rows = expert_parallel.ragged_buffer_rows(a, ep, e, k, cfg.moe_ep_capacity_factor)
            ys, dropped, sent = expert_parallel.ragged_exchange(xs, sorted_e, compute, e, ep, ep_axis, rows, exchange)
    y = rearrange(jnp.zeros((a, d), ys.dtype).at[order].set(ys), "(n k) d -> n k d", k=k)
    return y, dropped, sent


def _gathered_swiglu(xt: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Each assignment through its own expert's weights, gathered: xt [t, d], experts int32[t, k]
    -> [t, k, d]. Reads t*k experts' weights, which is less than a grouped matmul's all-experts read
    when t*k < experts (small training blocks)."""
    dt = xt.dtype
    k = experts.shape[1]
    e = rearrange(experts, "t k -> (t k)")
    x = repeat(xt, "t d -> (t k) d", k=k)
    h = jax.nn.silu(jnp.einsum("ad,adf->af", x, gate[e].astype(dt))) * jnp.einsum("ad,adf->af", x, up[e].astype(dt))
    return rearrange(jnp.einsum("af,afd->ad", h, down[e].astype(dt)), "(t k) d -> t k d", k=k)


def _local_moe(
    p: dict,
    x: jax.Array,
    routing: jax.Array | None,
    cfg: ModelConfig,
    ep_axis: str | None,
    ep: int,
    reduce_axes: tuple[str, ...],
    batch_axes: tuple[str, ...] = (),
    seq_axes: tuple[str, ...] = (),
    seq_shards: int = 1,
    token_shards: int = 1,
    decode: bool = False,
):
    """x: [batch, seq, embed] local block -> (y [batch, seq, embed], experts int32[batch, seq, k],
    stats as `moe_layer` returns them, over the whole mesh). token_shards: devices the tokens are
    split over (the product of batch_axes and seq_axes sizes). decode: an inference step (a forward
    with a KV cache): `decode_swiglu` without quantisation, on an expert-parallel mesh through the
    dropless `moe_decode.decode_expert_parallel`."""
    b, s, d = x.shape
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    tokens = lambda a: rearrange(a, "b s ... -> (b s) ...")  # the layer's tokens, row-major over the block
    xt = tokens(x)
    r = route(p["router"], p["router_bias"], xt, cfg, None if routing is None else tokens(routing))
    ws = (p["gate"], p["up"], p["down"])
    impl = cfg.moe_impl
    # every expert on this device, the automatic implementation, no quantisation
    unquantised_local = ep == 1 and impl == "auto" and cfg.moe_precision == "bf16"
    if impl == "auto" and not (unquantised_local and (decode or b * s * k < e)):
        impl = "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "tiled"
    dropped = sent = jnp.zeros((), jnp.int32)
    if not (unquantised_local and decode):
        ws = tuple(whole(w) for w in ws)
    if unquantised_local and decode:
        # inference (a forward with a KV cache): every expert's weights read at most once per step
        y = decode_swiglu(xt, r.experts, r.weights, *ws, decode_strategy(b * s, k, e), cfg.moe_tile_size)
    elif decode and ep > 1 and cfg.moe_precision == "bf16":
        assert ep_axis is not None
        gathered = ep_axis in batch_axes + seq_axes
        y = decode_expert_parallel(xt, r.experts, r.weights, ws, cfg.moe_tile_size, ep_axis, gathered)
        sent = jnp.full((), (ep - 1) * b * s if gathered else 0, jnp.int32)
    else:
        if unquantised_local and b * s * k < e:
            # a few tokens: fewer assignments than experts, so gathering each assignment's expert
            # weights reads only the experts in use (a grouped matmul reads all of them); exact
            y_assign = _gathered_swiglu(xt, r.experts, *ws)
        elif ep == 1 and impl == "tiled":
            y_assign = tiled_dispatch_swiglu(xt, r.experts, *ws, tile=cfg.moe_tile_size, precision=moe_recipe(cfg))
        else:
            y_assign, dropped, sent = _sorted_dispatch(xt, r.experts, ws, cfg, ep, ep_axis)
        y = jnp.einsum("tkd,tk->td", y_assign, r.weights.astype(y_assign.dtype))
    if cfg.num_shared_experts:
        dt = x.dtype
        h = jax.nn.silu(xt @ p["shared_gate"].astype(dt)) * (xt @ p["shared_up"].astype(dt))
        y = y + h @ p["shared_down"].astype(dt)
    if reduce_axes:  # expert / shared MLP hidden dimension split over tensor-like axes
        y = jax.lax.psum(y, reduce_axes)
    counts = expert_counts(r.experts, e)
    per_seq = lambda a: rearrange(a, "(b s) ... -> b s ...", b=b)
    balance = sequence_balance(per_seq(r.scores), per_seq(r.experts), e, seq_axes, seq_shards)
    ep_stats = jnp.stack([dropped, sent]).astype(jnp.float32)
    if batch_axes or seq_axes:
        counts, ep_stats = jax.lax.psum((counts, ep_stats), batch_axes + seq_axes)
    if batch_axes:
        balance = jax.lax.psum(balance, batch_axes)
    stats = {
        "expert_counts": counts,
        "seq_balance": balance,
        "moe_dropped": ep_stats[0],
        # per device: the token shards' rows, averaged (tensor-axis replicas each send their own copy)
        "moe_a2a_rows": ep_stats[1] / token_shards,
    }
    return per_seq(y), per_seq(r.experts), stats


def moe_layer(
    p: dict,
    x: jax.Array,
    cfg: ModelConfig,
    sharding: MeshRules | None,
    routing: jax.Array | None = None,
    decode: bool = False,
):
    """x: [batch, seq, embed] -> (y [batch, seq, embed], experts int32[batch, seq, k], stats); routing:
    int32[batch, seq, k] recorded experts to replay instead of routing (None: the router picks);
    stats = {"expert_counts": float32[experts], "seq_balance": float32[] summed over sequences,
    "moe_dropped": float32[] assignments the expert-parallel buffer bound dropped (0 unless
    model.moe_ep_capacity_factor > 0 on the ragged exchange), "moe_a2a_rows": float32[] assignment
    rows one device dispatched to other devices (mean over devices; the combine returns as many)}.
    With a mesh, runs per device inside `jax.shard_map`. decode: the forward is an inference step
    with a KV cache (`decode_swiglu` instead of the training dispatch where it applies)."""
    if sharding is None or all(n == 1 for n in dict(sharding.mesh.shape).values()):
        return _local_moe(p, x, routing, cfg, None, 1, (), decode=decode)
    b, s, d = x.shape
    # the shard_map specs come from the logical axes: tokens as activations, each weight by its
    # ParamSpec axes with the model dimension whole inside the block (FSDP gathers it on entry)
    tok_spec = sharding.spec(("act_batch", "act_seq", None), x.shape)
    as_tuple = lambda part: () if part is None else ((part,) if isinstance(part, str) else tuple(part))
    b_axes, s_axes = as_tuple(tok_spec[0]), as_tuple(tok_spec[1])
    token_axes = b_axes + s_axes
    ep_axes = sharding.split_axes("experts")
    if len(ep_axes) > 1:
        raise ValueError(f"experts may be split over one mesh axis, got {ep_axes}")
    ep_axis = ep_axes[0] if ep_axes else None
    ep = sharding.size(ep_axis) if ep_axis else 1
    if ep_axis and ep_axis not in token_axes and not (decode and cfg.moe_precision == "bf16"):
        raise ValueError(
            f"expert parallelism over mesh axis {ep_axis!r} needs the tokens split over it too: batch "
            f"{b} x seq {s} is not divisible so that act_batch/act_seq include {ep_axis!r}; use a batch "
            f"divisible by the product of the batch mesh axes"
        )
    specs = {
        name: sharding.spec(tuple(None if a == "embed" else a for a in spec.logical_axes), p[name].shape)
        for name, spec in moe_specs(cfg).items()
    }
    tp_e = as_tuple(specs["gate"][2])
    if cfg.num_shared_experts and tp_e != as_tuple(specs["shared_gate"][1]):
        raise ValueError(
            f"routed expert hidden axis {tp_e} and shared expert hidden axis "
            f"{as_tuple(specs['shared_gate'][1])} must be split over the same mesh axes "
            f"(sharding rules expert_mlp and mlp)"
        )
    p = {k: p[k] for k in specs}

    def body(p, x, routing):
        return _local_moe(
            p,
            x,
            routing,
            cfg,
            ep_axis,
            ep,
            tp_e,
            b_axes,
            s_axes,
            int(np.prod([sharding.size(a) for a in s_axes])),
            int(np.prod([sharding.size(a) for a in token_axes])),
            decode,
        )

    fn = jax.shard_map(
        body,
        mesh=sharding.mesh,
        in_specs=(specs, tok_spec, None if routing is None else tok_spec),
        out_specs=(tok_spec, tok_spec, {k: P() for k in STATS}),
    )
    return fn(p, x, routing)


def moe_param_count_active(cfg: ModelConfig) -> int:
    """Parameters touched per token in one MoE layer's routed + shared experts (for FLOP counts)."""
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return int(per_expert * (cfg.num_experts_per_tok + cfg.num_shared_experts) + cfg.hidden_size * cfg.num_experts)
