"""The MoE layer's routed experts in inference steps (`forward_cached`: prefill, decode, verify).

`decode_swiglu` computes a step's routed SwiGLU with every expert's weights read at most once and
in place: an expert loop that skips the experts no token chose, the real assignments in tiles of a
few rows ("grouped"), every expert on every token ("dense", for comparison), or the training
path's tiled dispatch for long prefills; `decode_strategy` picks the scheme by the step's size
(`bench/moe_decode.py` measures them). `LayerView` lets a layer scan hand over one layer of the
stacked expert weights without copying it. On an expert-parallel mesh `decode_expert_parallel`
replaces the training exchange by a dropless all-gather / reduce-scatter over the expert axis.
`layer.py` routes the tokens and calls these (`dispatch.choose_dispatch` says when); the "tiled"
scheme is the training path's `grouped.tiled_dispatch_swiglu`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from einops import rearrange

from composer_jax.model.moe.grouped import tiled_dispatch_swiglu
from composer_jax.sharding import vary_like

# decode-mode choice of `decode_swiglu` (bench/moe_decode.py measures the candidates): the expert
# loop while a step has at most LOOP_ASSIGNMENTS_PER_EXPERT x experts assignments, the grouped
# tiles of the real assignments up to GROUPED_MAX_TOKENS tokens, the training path's tiled dispatch
# beyond (long prefills)
LOOP_ASSIGNMENTS_PER_EXPERT = 2
GROUPED_MAX_TOKENS = 1024


EXPERT_WEIGHTS = ("gate", "up", "down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerView:
    """Layer `layer` of a stacked routed-expert weight `stack` [layers, experts, ...], read expert
    by expert where it is used. A scan over a layer stack slices each layer's parameters out of
    the stacked arrays, and XLA:CPU materialises such a slice that feeds a loop: for the reference
    model 12.6 MB of expert weights copied per MoE layer per decode step (more than the step's
    reads of the experts it uses). The inference path (`transformer._run_stack` with a cache,
    `transformer.mtp_forward_cached`) hands `decode_swiglu` views instead, and its "loop" and
    "grouped" schemes slice only the experts they run straight out of the stack."""

    stack: jax.Array
    layer: jax.Array  # int32 scalar

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    def expert(self, e: jax.Array) -> jax.Array:
        """The weight of expert e of this layer, [...]."""
        start = (self.layer, e) + (0,) * (self.stack.ndim - 2)
        return jax.lax.dynamic_slice(self.stack, start, (1, 1, *self.stack.shape[2:]))[0, 0]

    def materialise(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, keepdims=False)


def whole(w):
    """A weight as an array (a `LayerView` materialised)."""
    return w.materialise() if isinstance(w, LayerView) else w


def _expert(w, e: jax.Array) -> jax.Array:
    """Expert e's weight of [experts, ...] `w` (or of a `LayerView`)."""
    return w.expert(e) if isinstance(w, LayerView) else jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def _base(w) -> jax.Array:
    return w.stack if isinstance(w, LayerView) else w


def decode_strategy(tokens: int, k: int, experts: int) -> str:
    """Which `decode_swiglu` scheme a step of `tokens` tokens (k assignments each) over `experts`
    local experts uses: "loop", "grouped" or "tiled" ("dense" is kept for comparison)."""
    if tokens * k <= LOOP_ASSIGNMENTS_PER_EXPERT * experts:
        return "loop"
    return "grouped" if tokens <= GROUPED_MAX_TOKENS else "tiled"


def _combine_matrix(experts: jax.Array, weights: jax.Array, num_experts: int, first: jax.Array | int = 0):
    """experts int[t, k], weights [t, k] -> [t, num_experts]: each token's gate weight of experts
    first..first+num_experts-1 (0 for those it did not choose, and for choices outside the range;
    a replayed duplicate adds up, as the per-assignment sum does)."""
    t = experts.shape[0]
    local = experts - first
    ok = (local >= 0) & (local < num_experts)
    rows = jnp.broadcast_to(jnp.arange(t)[:, None], experts.shape)
    return (
        jnp.zeros((t, num_experts), weights.dtype).at[rows, jnp.where(ok, local, num_experts)].add(weights, mode="drop")
    )


def decode_swiglu(
    xt: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    strategy: str,
    tile: int = 128,
    first_expert: jax.Array | int = 0,
    rows: int | None = None,
) -> jax.Array:
    """Routed SwiGLU of a decode / verify / prefill step, combined: xt [t, d], experts int32[t, k],
    weights [t, k] (gate weights) -> sum_j weights[t, j] * expert_{experts[t, j]}(xt[t]), [t, d].
    gate/up/down may hold a slice of the experts, first_expert.. (an expert-parallel device's):
    then only the assignments to those experts are summed.

    Every scheme reads each expert's weights at most once per step, in place (no gathered copies):
      - "loop":  a loop over the experts; an expert no token chose is skipped (`lax.cond`), one that
                 is chosen runs on all t tokens (t is small) and is weighted by the combine matrix.
                 A step of t tokens reads only the distinct experts its t*k assignments name, which
                 is what a speculative verify window of tokens sharing experts needs.
      - "dense": every expert on every token as one batched matmul, weighted by the combine matrix
                 (E/k x the assignments' FLOPs, but one pass over the weights with no sort or
                 scatter; the fastest on XLA:CPU while t is moderate).
      - "grouped": only the real assignments, sorted by expert and cut into tiles of a few rows, in a
                 loop over the occupied tiles (`grouped_swiglu_rows`); an expert's weights are read once
                 per tile of it (once while its tokens fit one tile). rows: the tile's rows
                 (default `grouped_rows`).
      - "tiled": `tiled_dispatch_swiglu` (the training path's grouped matmul; all experts only).
    The products are the assignments' own; only the order of the final sum differs (rounding).
    gate/up/down may be `LayerView`s (one layer of stacked weights): "loop" and "grouped" then read
    each expert they run straight from the stack; "dense" and "tiled" take the layer whole."""
    dt = xt.dtype
    g = gate.shape[0]
    if strategy in ("tiled", "dense"):
        gate, up, down = whole(gate), whole(up), whole(down)
    if strategy == "tiled":
        y = tiled_dispatch_swiglu(xt, experts, gate, up, down, tile=tile)
        return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))
    if strategy == "grouped":
        return grouped_swiglu_rows(xt, experts, weights.astype(dt), gate, up, down, first_expert, rows)
    comb = _combine_matrix(experts, weights.astype(dt), g, first_expert)
    if strategy == "dense":
        h = jax.nn.silu(jnp.einsum("td,edf->etf", xt, gate.astype(dt))) * jnp.einsum("td,edf->etf", xt, up.astype(dt))
        return jnp.einsum("etf,efd->td", h * comb.T[:, :, None], down.astype(dt))  # one [t, E*f] @ [E*f, d]
    if strategy != "loop":
        raise ValueError(f"decode strategy {strategy!r} is not accepted; accepted: loop, dense, grouped, tiled")
    used = _combine_matrix(experts, jnp.ones(experts.shape, jnp.int32), g, first_expert).sum(0) > 0

    def body(i, acc):
        def run(acc):
            w = lambda m: _expert(m, i).astype(dt)
            h = jax.nn.silu(xt @ w(gate)) * (xt @ w(up))
            return acc + (h @ w(down)) * jax.lax.dynamic_index_in_dim(comb, i, axis=1)

        return jax.lax.cond(used[i], run, lambda acc: acc, acc)

    init = vary_like(jnp.zeros_like(xt), xt, comb, _base(gate), _base(up), _base(down))
    return jax.lax.fori_loop(0, g, body, init)


def grouped_rows(tokens: int, k: int, experts: int) -> int:
    """Rows per tile of the "grouped" scheme for a step of `tokens` tokens (k assignments each) over
    `experts` experts: the step's tokens when few (a verify window: one tile per distinct expert),
    else the mean assignments per expert rounded up to a power of two, at most 64."""
    if tokens <= 8:
        return tokens
    mean = -(-tokens * k // experts)
    return min(64, 1 << max(0, mean - 1).bit_length())


def grouped_swiglu_rows(
    xt: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    first_expert: jax.Array | int,
    rows: int | None = None,
) -> jax.Array:
    """`decode_swiglu`'s "grouped" scheme: the assignments sorted by expert, each expert's run cut
    into tiles of `rows` rows, and a loop over the tiles actually occupied (a dynamic trip count):
    a tile gathers its tokens' rows, runs its expert's SwiGLU on them with the weights read in place,
    and scatter-adds the gate-weighted results into their tokens' rows. Only the real assignments
    are computed (plus the padding of each expert's last tile), and an expert no token chose costs
    nothing."""
    xt = jnp.asarray(xt)
    dt = xt.dtype
    t, k = experts.shape
    g = gate.shape[0]
    r = rows or grouped_rows(t, k, g)
    local = rearrange(experts - first_expert, "t k -> (t k)")  # assignment t*k + j: token t's j-th
    key = jnp.where((local >= 0) & (local < g), local, g).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros((g,), jnp.int32).at[key].add(1, mode="drop")  # assignments outside the slice: none
    seg_start = jnp.cumsum(counts) - counts
    tiles = (counts + r - 1) // r
    tiles_end = jnp.cumsum(tiles)
    pad = jnp.zeros((r,), jnp.int32)
    tok = jnp.concatenate([(order // k).astype(jnp.int32), pad])  # token of each sorted assignment
    w = jnp.concatenate([rearrange(weights, "t k -> (t k)")[order], pad.astype(dt)])

    def body(j, acc):
        e = jnp.sum(tiles_end <= j).astype(jnp.int32)  # the expert of tile j
        off = (j - tiles_end[e] + tiles[e]) * r  # this tile's first row within the expert's run
        start = seg_start[e] + off
        idx = jax.lax.dynamic_slice_in_dim(tok, start, r)
        real = jnp.arange(r) < counts[e] - off
        xr = jnp.take(xt, idx, axis=0)
        m = lambda a: _expert(a, e).astype(dt)
        h = jax.nn.silu(xr @ m(gate)) * (xr @ m(up))
        y = (h @ m(down)) * jax.lax.dynamic_slice_in_dim(w, start, r)[:, None]
        return acc.at[idx].add(jnp.where(real[:, None], y, 0))

    init = vary_like(jnp.zeros_like(xt), xt, experts, weights, _base(gate), _base(up), _base(down))
    return jax.lax.fori_loop(0, tiles_end[-1], body, init)


def decode_expert_parallel(
    xt: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    ws: tuple[jax.Array, jax.Array, jax.Array],
    tile: int,
    ep_axis: str,
    gathered: bool,
) -> jax.Array:
    """Routed experts of an inference step on an expert-parallel mesh, dropless: every device runs
    its E/ep experts on every token of its expert group (all-gathered over the expert axis when the
    tokens are split over it, `gathered`; as they are when replicated over it, e.g. a batch-1
    prefill) and the partial sums are added over the axis (reduce-scattered back to each device's
    tokens). No capacity bound applies, so no assignment is dropped. -> [tokens, d]."""
    e_local = ws[0].shape[0]
    first = jax.lax.axis_index(ep_axis) * e_local
    x = xt
    if gathered:
        x, experts, weights = (jax.lax.all_gather(a, ep_axis, tiled=True) for a in (x, experts, weights))
    strategy = decode_strategy(x.shape[0], experts.shape[1], e_local)
    strategy = "grouped" if strategy == "tiled" else strategy
    gate, up, down = ws
    y = decode_swiglu(x, experts, weights, gate, up, down, strategy, tile, first)
    if gathered:
        return jax.lax.psum_scatter(y, ep_axis, scatter_dimension=0, tiled=True)
    return jax.lax.psum(y, ep_axis)
