"""The MoE layer: route the tokens (`router`), compute their routed experts by the dispatch
`dispatch.choose_dispatch` picks, add the shared experts, and gather the load statistics; with a
mesh, per device inside `jax.shard_map`.

Dispatch is dropless. Expert parallelism: inside `jax.shard_map`, assignments are exchanged over the
expert mesh axis (`expert_parallel.py`, `model.moe_ep_exchange`): on GPU/TPU by `ragged_all_to_all`
of the real rows into a receive buffer bounded by `model.moe_ep_capacity_factor` (overflow dropped
and counted), on CPU by `all_to_all` of worst-case [ep, T*K] buffers (the reference; never drops);
computed by the local experts (`grouped.grouped_swiglu`), and returned by the inverse exchange.
Inference steps take `decode.py`'s kernels instead where they apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.sharding import PartitionSpec as P

from composer_jax.config import ModelConfig
from composer_jax.model.moe import expert_parallel
from composer_jax.model.moe.decode import decode_expert_parallel, decode_strategy, decode_swiglu, whole
from composer_jax.model.moe.dispatch import Dispatch, choose_dispatch, on_accelerator
from composer_jax.model.moe.grouped import gathered_swiglu, grouped_swiglu, moe_recipe, tiled_dispatch_swiglu
from composer_jax.model.moe.params import moe_specs
from composer_jax.model.moe.router import Routing, expert_counts, route, sequence_balance
from composer_jax.sharding import MeshRules

STATS = ("expert_counts", "seq_balance", "moe_dropped", "moe_a2a_rows")


@dataclasses.dataclass(frozen=True)
class BlockAxes:
    """How one device's block of the layer sits in the mesh (the defaults: one device).

    ep_axis / ep: the mesh axis the experts are split over and its size; reduce_axes: the axes the
    expert and shared MLP hidden dimension is split over (summed after the layer); batch_axes /
    seq_axes: the axes the tokens' batch and sequence are split over; seq_shards: the product of
    the seq_axes sizes; token_shards: devices the tokens are split over (batch and seq axes)."""

    ep_axis: str | None = None
    ep: int = 1
    reduce_axes: tuple[str, ...] = ()
    batch_axes: tuple[str, ...] = ()
    seq_axes: tuple[str, ...] = ()
    seq_shards: int = 1
    token_shards: int = 1


def _sorted_dispatch(
    xt: jax.Array,
    experts: jax.Array,
    ws: tuple[jax.Array, jax.Array, jax.Array],
    cfg: ModelConfig,
    ep: int,
    ep_axis: str | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Assignments sorted by expert, through `grouped_swiglu` (and exchanged over the expert axis
    when ep > 1, `expert_parallel.py`) and back: -> (y [tokens, k, embed], dropped int32[]
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
        exchange = expert_parallel.ep_exchange(cfg)
        if exchange == "padded":
            ys = expert_parallel.padded_exchange(xs, sorted_e, compute, e, ep, ep_axis)
            dropped, sent = zero, jnp.full((), (ep - 1) * a, jnp.int32)
        else:
            rows = expert_parallel.ragged_buffer_rows(a, ep, e, k, cfg.moe_ep_capacity_factor)
            ys, dropped, sent = expert_parallel.ragged_exchange(xs, sorted_e, compute, e, ep, ep_axis, rows, exchange)
    y = rearrange(jnp.zeros((a, d), ys.dtype).at[order].set(ys), "(n k) d -> n k d", k=k)
    return y, dropped, sent


def _routed_experts(
    choice: Dispatch, xt: jax.Array, r: Routing, ws: tuple[Any, Any, Any], cfg: ModelConfig, axes: BlockAxes
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The routed experts of the block's tokens xt [t, d] by the chosen dispatch, combined with the
    gate weights -> (y [t, d], dropped int32[], sent int32[] as `_sorted_dispatch` counts them; a
    gathered expert-parallel decode sends its t rows to each of the ep - 1 peers)."""
    zero = jnp.zeros((), jnp.int32)
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    if choice is Dispatch.DECODE:
        # inference (`forward_cached`): every expert's weights read at most once per step
        strategy = decode_strategy(xt.shape[0], k, e)
        return decode_swiglu(xt, r.experts, r.weights, *ws, strategy, cfg.moe_tile_size), zero, zero
    gate, up, down = whole_ws = tuple(whole(w) for w in ws)
    if choice is Dispatch.DECODE_EXPERT_PARALLEL:
        assert axes.ep_axis is not None
        gathered = axes.ep_axis in axes.batch_axes + axes.seq_axes
        y = decode_expert_parallel(xt, r.experts, r.weights, whole_ws, cfg.moe_tile_size, axes.ep_axis, gathered)
        return y, zero, jnp.full((), (axes.ep - 1) * xt.shape[0] if gathered else 0, jnp.int32)
    dropped = sent = zero
    if choice is Dispatch.GATHERED:
        # a few tokens: fewer assignments than experts, so gathering each assignment's expert
        # weights reads only the experts in use (a grouped matmul reads all of them); exact
        y_assign = gathered_swiglu(xt, r.experts, gate, up, down)
    elif choice is Dispatch.TILED_FROM_TOKENS:
        y_assign = tiled_dispatch_swiglu(
            xt, r.experts, gate, up, down, tile=cfg.moe_tile_size, precision=moe_recipe(cfg)
        )
    else:
        y_assign, dropped, sent = _sorted_dispatch(xt, r.experts, whole_ws, cfg, axes.ep, axes.ep_axis)
    return jnp.einsum("tkd,tk->td", y_assign, r.weights.astype(y_assign.dtype)), dropped, sent


def _local_moe(p: dict, x: jax.Array, routing: jax.Array | None, cfg: ModelConfig, axes: BlockAxes, decode: bool):
    """x: [batch, seq, embed] local block -> (y [batch, seq, embed], experts int32[batch, seq, k],
    stats as `moe_layer` returns them, over the whole mesh). decode: an inference step (a forward
    with a KV cache), which `choose_dispatch` may send to `decode.py`'s kernels."""
    b, s, d = x.shape
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    tokens = lambda a: rearrange(a, "b s ... -> (b s) ...")  # the layer's tokens, row-major over the block
    xt = tokens(x)
    r = route(p["router"], p["router_bias"], xt, cfg, None if routing is None else tokens(routing))
    choice = choose_dispatch(
        impl=cfg.moe_impl,
        precision=cfg.moe_precision,
        ep=axes.ep,
        decode=decode,
        assignments=b * s * k,
        experts=e,
        accelerator=on_accelerator(),
    )
    y, dropped, sent = _routed_experts(choice, xt, r, (p["gate"], p["up"], p["down"]), cfg, axes)
    if cfg.num_shared_experts:
        dt = x.dtype
        h = jax.nn.silu(xt @ p["shared_gate"].astype(dt)) * (xt @ p["shared_up"].astype(dt))
        y = y + h @ p["shared_down"].astype(dt)
    if axes.reduce_axes:  # expert / shared MLP hidden dimension split over tensor-like axes
        y = jax.lax.psum(y, axes.reduce_axes)
    per_seq = lambda a: rearrange(a, "(b s) ... -> b s ...", b=b)
    return per_seq(y), per_seq(r.experts), _layer_stats(r, b, e, dropped, sent, axes)


def _layer_stats(r: Routing, b: int, e: int, dropped: jax.Array, sent: jax.Array, axes: BlockAxes) -> dict:
    """`moe_layer`'s stats of this block, summed over the token axes of the mesh."""
    counts = expert_counts(r.experts, e)
    per_seq = lambda a: rearrange(a, "(b s) ... -> b s ...", b=b)
    balance = sequence_balance(per_seq(r.scores), per_seq(r.experts), e, axes.seq_axes, axes.seq_shards)
    ep_stats = jnp.stack([dropped, sent]).astype(jnp.float32)
    if axes.batch_axes or axes.seq_axes:
        counts, ep_stats = jax.lax.psum((counts, ep_stats), axes.batch_axes + axes.seq_axes)
    if axes.batch_axes:
        balance = jax.lax.psum(balance, axes.batch_axes)
    return {
        "expert_counts": counts,
        "seq_balance": balance,
        "moe_dropped": ep_stats[0],
        # per device: the token shards' rows, averaged (tensor-axis replicas each send their own copy)
        "moe_a2a_rows": ep_stats[1] / axes.token_shards,
    }


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
        return _local_moe(p, x, routing, cfg, BlockAxes(), decode)
    # the shard_map specs come from the logical axes: tokens as activations, each weight by its
    # ParamSpec axes with the model dimension whole inside the block (FSDP gathers it on entry)
    tok_spec = sharding.spec(("act_batch", "act_seq", None), x.shape)
    specs = {
        name: sharding.spec(tuple(None if a == "embed" else a for a in spec.logical_axes), p[name].shape)
        for name, spec in moe_specs(cfg).items()
    }
    axes = _block_axes(sharding, tok_spec, specs, x.shape, cfg, decode)
    fn = jax.shard_map(
        lambda p, x, routing: _local_moe(p, x, routing, cfg, axes, decode),
        mesh=sharding.mesh,
        in_specs=(specs, tok_spec, None if routing is None else tok_spec),
        out_specs=(tok_spec, tok_spec, {k: P() for k in STATS}),
    )
    return fn({k: p[k] for k in specs}, x, routing)


def _as_tuple(part) -> tuple[str, ...]:
    """A PartitionSpec entry as the tuple of mesh axes it names."""
    return () if part is None else ((part,) if isinstance(part, str) else tuple(part))


def _block_axes(
    sharding: MeshRules, tok_spec: P, specs: dict[str, P], shape: tuple[int, ...], cfg: ModelConfig, decode: bool
) -> BlockAxes:
    """Where a device's block of the layer sits in the mesh, from the tokens' and the weights'
    shard_map specs; refuses the layouts the layer cannot run (with what would be accepted)."""
    b, s, _ = shape
    b_axes, s_axes = _as_tuple(tok_spec[0]), _as_tuple(tok_spec[1])
    token_axes = b_axes + s_axes
    ep_axes = sharding.split_axes("experts")
    if len(ep_axes) > 1:
        raise ValueError(f"experts may be split over one mesh axis, got {ep_axes}")
    ep_axis = ep_axes[0] if ep_axes else None
    if ep_axis and ep_axis not in token_axes and not (decode and cfg.moe_precision == "bf16"):
        raise ValueError(
            f"expert parallelism over mesh axis {ep_axis!r} needs the tokens split over it too: batch "
            f"{b} x seq {s} is not divisible so that act_batch/act_seq include {ep_axis!r}; use a batch "
            f"divisible by the product of the batch mesh axes"
        )
    tp_e = _as_tuple(specs["gate"][2])
    if cfg.num_shared_experts and tp_e != _as_tuple(specs["shared_gate"][1]):
        raise ValueError(
            f"routed expert hidden axis {tp_e} and shared expert hidden axis "
            f"{_as_tuple(specs['shared_gate'][1])} must be split over the same mesh axes "
            f"(sharding rules expert_mlp and mlp)"
        )
    return BlockAxes(
        ep_axis=ep_axis,
        ep=sharding.size(ep_axis) if ep_axis else 1,
        reduce_axes=tp_e,
        batch_axes=b_axes,
        seq_axes=s_axes,
        seq_shards=int(np.prod([sharding.size(a) for a in s_axes])),
        token_shards=int(np.prod([sharding.size(a) for a in token_axes])),
    )


def moe_param_count_active(cfg: ModelConfig) -> int:
    """Parameters touched per token in one MoE layer's routed + shared experts (for FLOP counts)."""
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return int(per_expert * (cfg.num_experts_per_tok + cfg.num_shared_experts) + cfg.hidden_size * cfg.num_experts)
